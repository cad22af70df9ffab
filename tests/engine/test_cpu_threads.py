"""One OpenMP team per process (server/engine/cpu_threads.py): a confined helper thread opens
none, a thread from ``run_on_own_thread`` takes its team with it, and the engine steps with
the count it was built with on any thread.

The team counts run in a child process with two OpenMP threads (the tests' own processes run
with one, where no team ever forms): an OpenMP team shows as one more OS thread of the process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import torch

from loraplex.server.config import EngineConfig, SchedulerConfig
from loraplex.server.engine import cpu_threads
from loraplex.server.engine.engine import Engine
from loraplex.server.engine.request import SamplingParams

CHILD = r"""
import json, os, time
from concurrent.futures import ThreadPoolExecutor
import torch
from loraplex.server.engine import cpu_threads

def tasks():
    return len(os.listdir("/proc/self/task"))

def big():
    torch.ones(4_000_000).mul_(2)  # far above torch's grain size: a parallel region
    return torch.get_num_threads()

def settle(count):  # a joined thread's OS thread, and its team's, end a moment later
    deadline = time.monotonic() + 5
    while tasks() > count and time.monotonic() < deadline:
        time.sleep(0.01)
    return tasks()

out = {"main": torch.get_num_threads()}
start = tasks()
with ThreadPoolExecutor(1, initializer=cpu_threads.confine) as pool:
    out["confined"] = pool.submit(big).result()
    out["confined_extra"] = tasks() - start - 1  # less the pool's own thread
settle(start)
with ThreadPoolExecutor(1) as pool:
    out["plain"] = pool.submit(big).result()
    out["plain_extra"] = tasks() - start - 1
settle(start)
out["own"] = cpu_threads.run_on_own_thread(big)
out["own_left"] = settle(start) - start
out["main_after"] = torch.get_num_threads()
print(json.dumps(out))
"""


def test_confined_threads_open_no_team_and_an_own_thread_takes_its_team_along() -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    proc = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["main"] == 2
    # a confined thread runs the parallel op on itself: no OpenMP thread appears
    assert out["confined"] == 1
    assert out["confined_extra"] == 0
    # the control: the same op on a plain thread opens a team (one more OS thread), which is
    # what the count above would have shown without confine()
    assert out["plain"] == 2
    assert out["plain_extra"] == 1
    # run_on_own_thread: every core while it runs, nothing left once it returns
    assert out["own"] == 2
    assert out["own_left"] == 0
    # confining helpers changed neither the main thread nor the count new threads start with
    assert out["main_after"] == 2


def test_run_on_own_thread_returns_and_raises_on_the_callers_thread() -> None:
    caller = threading.get_ident()
    assert cpu_threads.run_on_own_thread(threading.get_ident) != caller

    def fail() -> None:
        raise KeyError("from the build thread")

    try:
        cpu_threads.run_on_own_thread(fail)
    except KeyError as exc:
        assert "from the build thread" in str(exc)
    else:
        raise AssertionError("the build thread's exception was not re-raised")


def test_engine_steps_with_its_own_count_on_any_thread(tiny_llama) -> None:
    engine = Engine(EngineConfig(model=str(tiny_llama), num_pages=32,
                                 scheduler=SchedulerConfig(page_size=4)))
    built_with = engine.num_threads
    assert built_with == torch.get_num_threads()
    engine.add_request("r", [1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True))
    seen: list[int] = []

    def step_elsewhere() -> None:
        torch.set_num_threads(built_with + 1)  # a thread started with another count
        try:
            while engine.has_unfinished():
                engine.step()
                seen.append(torch.get_num_threads())
        finally:
            torch.set_num_threads(built_with)  # torch's default for later threads, as it was

    thread = threading.Thread(target=step_elsewhere)
    thread.start()
    thread.join()
    assert seen and all(n == built_with for n in seen)
    engine.close()
