"""Turns a scheduled batch into tensors, performs the copies it carries (adapter weights into
pages, copy-on-write pages), runs the model, and returns the logits of the requests whose
known tokens are now all computed (those sample a new token), each row mapped to its request."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from loraplex.kernels import native
from loraplex.kernels.metadata import AttentionMetadata
from loraplex.server.engine import cpu_memory
from loraplex.server.engine.adapter_cache import AdapterManager
from loraplex.server.engine.batch import ScheduledBatch
from loraplex.server.engine.lora import LoraBatch, lora_ops
from loraplex.server.engine.models.llama import ForwardContext, LlamaModel
from loraplex.server.engine.request import Request, TokenLogprob
from loraplex.server.engine.sampler import token_logprobs

# Prompt logprobs take logits of every prompt position that asks: computed this many rows at
# a time, so a long prefill chunk never holds [chunk, vocab] float32 logits at once.
PROMPT_LOGITS_ROWS = 256


class StepTokens(NamedTuple):
    """One step's tokens in batch order (requests of one adapter adjacent): what every
    tensor-parallel rank needs to run the same forward pass."""

    input_ids: list[int]  # [T]
    positions: list[int]  # [T]
    page_tables: list[list[int]]  # per request, its KV pages
    q_lens: list[int]  # per request, tokens in this step
    seq_lens: list[int]  # per request, tokens computed once this step is done


class RunOutput(NamedTuple):
    """A step's logits, each row mapped to the request it belongs to.

    A request owns one row (its last token's) when its known tokens are all computed after
    the step; a request verifying a draft of d tokens owns 1 + d adjacent rows (speculation),
    so readers go through ``row_requests`` and ``rows_of``, never through row = request.
    """

    row_requests: list[Request]  # [R] the request of each row
    logits: torch.Tensor  # [R, vocab] float32
    # Per request that asked: the prompt logprobs this step computed, continuing its list.
    prompt_logprobs: tuple[tuple[Request, list[TokenLogprob]], ...] = ()

    @property
    def requests(self) -> list[Request]:
        """The distinct requests that own rows, in row order."""
        return list({id(r): r for r in self.row_requests}.values())

    def rows_of(self, request: Request) -> list[int]:
        """The rows ``request`` owns, in order."""
        return [i for i, r in enumerate(self.row_requests) if r is request]


def attention_kernels(name: str) -> tuple[Callable[..., None], Callable[..., torch.Tensor]]:
    """(write_kv, paged_attention) for ``torch`` (the CPU kernels) or ``triton``."""
    if name == "triton":
        from loraplex.kernels import paged_attention as triton_attention

        return triton_attention.write_kv, triton_attention.paged_attention
    from loraplex.kernels import cpu

    return cpu.write_kv, cpu.paged_attention


class ModelRunner:
    """Owns the model and the per-layer page pools ``[num_layers, num_pages, page_elems]``."""

    def __init__(self, model: LlamaModel, pools: torch.Tensor, page_size: int,
                 kernels: str = "torch") -> None:
        self.model = model
        self.pools = pools
        self.page_size = page_size
        self.device = model.device
        self.kernels = kernels
        self.write_kv, self.attention = attention_kernels(kernels)
        self.lora_ops = lora_ops(kernels)
        if self.device.type == "cpu" and kernels == "torch":
            # the compile (about a second) happens at start-up, never in a request's latency
            native.build_engine_kernels()
        if self.device.type == "cpu":
            cpu_memory.keep_freed_memory()  # no page faults for each step's fresh buffers
        # Set on tensor-parallel ranks (parallel/): the row-parallel layers' all-reduce.
        self.all_reduce: Callable[[torch.Tensor], None] | None = None

    def device_context(self) -> contextlib.AbstractContextManager[Any]:
        """Makes the model's GPU the current device. Triton launches on the current device,
        which is per thread (device 0 in a thread that never set it), not on its tensors'."""
        if self.device.type == "cuda":
            return torch.cuda.device(self.device)
        return contextlib.nullcontext()

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch, adapters: AdapterManager | None = None) -> RunOutput:
        """Compute ``batch``: first the copies it carries (adapter weights into their
        reserved pages, then copy-on-write pages), then the forward pass; logits only for
        the requests that will sample."""
        with self.device_context():
            if adapters is not None and batch.adapter_loads:
                adapters.copy_in(batch.adapter_loads)
            return self._run(batch, adapters)

    def _run(self, batch: ScheduledBatch, adapters: AdapterManager | None) -> RunOutput:
        # Requests of one adapter run as one segment: order the batch by adapter.
        order = sorted(zip(batch.requests, batch.num_new_tokens),
                       key=lambda rn: rn[0].adapter_digest or "")
        requests = [r for r, _ in order]
        counts = [n for _, n in order]
        input_ids: list[int] = []
        positions: list[int] = []
        seq_lens: list[int] = []
        sample_rows: list[int] = []
        sampling: list[Request] = []
        prompt_rows: list[tuple[Request, int, int, int]] = []  # (request, row, position, rows)
        for req, n in order:
            start = req.num_computed_tokens
            end = start + n
            num_prompt = req.num_prompt_tokens
            if req.params.prompt_logprobs is not None:
                # Position p's logits score prompt token p + 1; those scored already (before a
                # preemption) are not scored again.
                first = max(start, len(req.prompt_logprobs))
                last = min(end, num_prompt - 1)
                if first < last:
                    prompt_rows.append((req, len(input_ids) + first - start, first,
                                        last - first))
            draft = req.draft_token_ids
            if end <= num_prompt:
                input_ids.extend(req.prompt_token_ids[start:end])
            elif draft:
                # A verification row: the last known token, then the draft (speculation).
                input_ids.extend((req.all_token_ids + draft)[start:end])
            else:
                input_ids.extend(req.all_token_ids[start:end])
            positions.extend(range(start, end))
            seq_lens.append(end)
            if end == req.num_tokens + len(draft):
                # 1 + d rows: the logits after the last known token and after each draft token
                num_rows = len(draft) + 1
                sample_rows.extend(range(len(input_ids) - num_rows, len(input_ids)))
                sampling.extend([req] * num_rows)
        lora = self._lora_batch(requests, counts, adapters)  # waits for the adapter copies
        if batch.page_copies:
            # Copy-on-write of shared pages, in every layer at once: all sources are read
            # before any destination is written, and before this step writes any KV. (Only
            # here: the engine refuses n > 1 with tensor parallelism.)
            sources = torch.tensor([s for s, _ in batch.page_copies], device=self.pools.device)
            targets = torch.tensor([d for _, d in batch.page_copies], device=self.pools.device)
            self.pools[:, targets] = self.pools[:, sources]
        step = StepTokens(input_ids, positions, [r.page_ids for r in requests], counts,
                          seq_lens)
        hidden = self.forward(step, lora)
        prompt_logprobs = tuple((req, self._prompt_logprobs(hidden, req, row, position, count))
                                for req, row, position, count in prompt_rows)
        if not sampling:
            return RunOutput([], hidden.new_empty(0, 0, dtype=torch.float32), prompt_logprobs)
        rows = torch.tensor(sample_rows, dtype=torch.long, device=self.device)
        return RunOutput(sampling, self.model.compute_logits(hidden[rows]), prompt_logprobs)

    def _prompt_logprobs(self, hidden: torch.Tensor, req: Request, row: int, position: int,
                         count: int) -> list[TokenLogprob]:
        """Logprobs of prompt tokens ``position + 1 ...``, scored by ``hidden[row:row + count]``
        (the hidden states of positions ``position ...``)."""
        out: list[TokenLogprob] = []
        for at in range(0, count, PROMPT_LOGITS_ROWS):
            rows = min(PROMPT_LOGITS_ROWS, count - at)
            logits = self.model.compute_logits(hidden[row + at:row + at + rows])  # [rows, V]
            targets = req.prompt_token_ids[position + at + 1:position + at + 1 + rows]
            out.extend(token_logprobs(logits, targets, req.params.prompt_logprobs or 0))
        return out

    def forward(self, step: StepTokens, lora: LoraBatch | None) -> torch.Tensor:
        """The model over one step's tokens -> hidden states ``[T, hidden]``."""
        meta = AttentionMetadata.build(step.page_tables, step.q_lens, step.seq_lens,
                                       self.page_size, self.device)
        ctx = ForwardContext(meta, self.pools, self.page_size, self.write_kv, self.attention,
                             lora, self.all_reduce)
        ids = torch.tensor(step.input_ids, dtype=torch.long, device=self.device)
        pos = torch.tensor(step.positions, dtype=torch.long, device=self.device)
        return self.model.forward(ids, pos, ctx)

    def _lora_batch(self, requests: list[Request], counts: list[int],
                    adapters: AdapterManager | None) -> LoraBatch | None:
        if adapters is None:
            return None
        # Every step waits for the copies issued before it, even one with no LoRA request:
        # pages whose copy was issued for a request that never ran may now hold this step's KV.
        adapters.wait_for_copies()
        if all(r.adapter_digest is None for r in requests):
            return None
        segments: list[str | None] = []
        seg_lens: list[int] = []
        for req, n in zip(requests, counts):
            if segments and segments[-1] == req.adapter_digest:
                seg_lens[-1] += n
            else:
                segments.append(req.adapter_digest)
                seg_lens.append(n)
        resident = [adapters.resident(d) if d is not None else None for d in segments]
        return LoraBatch(self.model.config, self.pools, self.lora_ops, resident, seg_lens)
