"""The timing log of a run: one ``RequestRecord`` per request, whoever served it.

The gRPC runner, the in-process engine replay and the transformers baseline all produce a
``RunLog``, and the report reads nothing else, so every system is measured the same way.
Times are seconds on one monotonic clock, counted from the start of the run.

Latency is counted from ``send_time``. The gRPC runner sets it when the call is made (the
client's own lag behind the schedule is reported apart); the in-process replays set it to the
scheduled arrival, so time a request waits while the server is busy counts against it.
"""

from __future__ import annotations

import functools
import json
import os
import platform
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

LOG_FORMAT = "loraplex-runlog"
LOG_VERSION = 1
OK = "OK"


@dataclass
class RequestRecord:
    """One request as the client saw it.

    Attributes:
        arrival_time: when the trace scheduled it (None in a closed loop).
        send_time: when it was sent; latencies count from here.
        end_time: when its last chunk or its error arrived.
        token_times: when each output token arrived (tokens of one chunk share a time).
        status: ``OK`` or the gRPC status code's name (``DEADLINE_EXCEEDED``, ...);
            ``CANCELLED`` for requests the runner itself cut off at its time bound.
        warmup: sent during warm-up; reported apart, not in the main figures.
    """

    request_id: str
    tenant: str
    adapter: str
    arrival_time: float | None
    send_time: float
    end_time: float = float("nan")
    token_times: list[float] = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    status: str = OK
    error: str = ""
    warmup: bool = False

    @property
    def ok(self) -> bool:
        return self.status == OK

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_times)

    @property
    def ttft(self) -> float | None:
        """Time to first token (None without tokens)."""
        return self.token_times[0] - self.send_time if self.token_times else None

    @property
    def e2e(self) -> float:
        """Send to last chunk (or to the error)."""
        return self.end_time - self.send_time

    @property
    def itls(self) -> list[float]:
        """Gaps between consecutive output tokens."""
        return np.diff(self.token_times).tolist() if len(self.token_times) > 1 else []

    @property
    def tpot(self) -> float | None:
        """Mean inter-token latency of this request (time per output token after the first);
        None with fewer than two tokens."""
        if len(self.token_times) < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (len(self.token_times) - 1)

    @property
    def client_lag(self) -> float | None:
        """How late the request was sent compared with its schedule (open loop only)."""
        return None if self.arrival_time is None else self.send_time - self.arrival_time

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> RequestRecord:
        return cls(**d)


@dataclass
class RunLog:
    """A run's records and what produced them (``meta``: system, target, trace, config)."""

    records: list[RequestRecord]
    meta: dict = field(default_factory=dict)

    def save(self, path: str | os.PathLike[str]) -> None:
        """JSONL: a header with ``meta``, then one record per line."""
        with open(path, "w", encoding="utf-8") as f:
            f.write(json.dumps({"format": LOG_FORMAT, "version": LOG_VERSION,
                                "meta": self.meta}) + "\n")
            for r in self.records:
                f.write(json.dumps(r.to_dict()) + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> RunLog:
        """Read a log written by ``save`` (``ValueError`` if it is not one)."""
        with open(path, encoding="utf-8") as f:
            lines = [line for line in f if line.strip()]
        header = json.loads(lines[0]) if lines else {}
        if header.get("format") != LOG_FORMAT or header.get("version") != LOG_VERSION:
            raise ValueError(f"{path}: not a {LOG_FORMAT} v{LOG_VERSION} file")
        return cls([RequestRecord.from_dict(json.loads(line)) for line in lines[1:]],
                   header.get("meta", {}))

    @property
    def measured(self) -> list[RequestRecord]:
        """The records the main figures use (warm-up excluded)."""
        return [r for r in self.records if not r.warmup]


def provenance() -> dict:
    """What produced a result: the CPU, cores, Python, torch and the loraplex commit (with
    ``-dirty`` for uncommitted changes; ``unknown`` outside a git checkout)."""
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f
                        if line.startswith("model name")), cpu)
    except OSError:
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"cpu": cpu, "cores": os.cpu_count(), "gpu": gpu, "python": platform.python_version(),
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "commit": git_commit()}


@functools.cache
def git_commit() -> str:
    """The checkout's short commit, ``-dirty`` if tracked files changed; ``unknown`` outside
    a git checkout (what every benchmark and load-test report records). Read once a process,
    on the first call (a benchmark's check of a clean tree, at its start): the tree whose code
    the process runs, which a later edit (a doc, while a benchmark runs) does not change."""
    root = Path(__file__).resolve().parent.parent
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, check=True,
                             capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=root, check=True, capture_output=True, text=True,
                               timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return sha + ("-dirty" if dirty else "")
