"""The step-level engine: ``add_request`` / ``step`` / ``abort`` / ``has_unfinished``.

``step()`` is ``scheduler.schedule() -> ScheduledBatch``, ``runner.run(batch) -> RunOutput``,
sampling, ``scheduler.update(batch, accepted)`` and the output processor (``output.py``).
``add_request`` and ``abort`` may be called from any thread (the gRPC worker drives ``step``
from its own thread): they validate at once and hand the request to the engine thread through
an inbox drained at the start of each step.
"""

from __future__ import annotations

import logging
import queue
import secrets
import time
from dataclasses import replace

import torch

from loraplex.adapter_store.store import AdapterSource
from loraplex.kernels import huge_pages
from loraplex.kernels.layout import kv_page_elems
from loraplex.server.config import EngineConfig
from loraplex.server.engine import cpu_threads, gc_freeze
from loraplex.server.engine.adapter_cache import AdapterManager
from loraplex.server.engine.batch import Accepted, ScheduledBatch
from loraplex.server.engine.calibration import calibrate
from loraplex.server.engine.model_runner import ModelRunner, RunOutput
from loraplex.server.engine.models.builtin import resolve_model_path
from loraplex.server.engine.models.config import ModelConfig, parse_dtype
from loraplex.server.engine.models.llama import LlamaModel
from loraplex.server.engine.models.loader import load_weights, model_revision
from loraplex.server.engine.output import OutputProcessor
from loraplex.server.engine.pager import Pager
from loraplex.server.engine.parallel.driver import TensorParallel
from loraplex.server.engine.parallel.group import RankFailure
from loraplex.server.engine.prefix_cache import PrefixCache
from loraplex.server.engine.profile import ProfileResult, pool_pages, profile_batch, profile_run
from loraplex.server.engine.request import Request, RequestOutput, RequestStatus, SamplingParams
from loraplex.server.engine.sampler import SamplingMetadata, sample
from loraplex.server.engine.scheduler import Scheduler
from loraplex.server.engine.spec.speculator import Speculator
from loraplex.server.engine.stats import EngineStats, collect_stats
from loraplex.server.engine.step_cost import StepCostModel, StepTimer
from loraplex.server.engine.structured import GrammarService
from loraplex.server.engine.tokenizer import load_tokenizer, prompt_token_ids
from loraplex.server.engine.warmup import warm_up
from loraplex.server.params import ChatMessages

logger = logging.getLogger(__name__)

# After a step that ran nothing while requests wait on other threads (an adapter loading, a
# grammar compiling): how long a driving loop waits before the next step (EngineLoop: unless
# a new request or an abort wakes it). Stepping again at once spins the driving thread with
# the GIL those threads need (measured: a first adapter's load 2.7-3.9 s instead of ~0.15 s).
STALLED_WAIT_SECONDS = 0.002
SAMPLING_FAILED = ("sampling failed: non-finite probabilities (temperature too small, or "
                   "adapter or model weights that overflow in the activations)")


class Engine:
    """One worker's continuous-batching engine over a paged KV pool."""

    def __init__(self, config: EngineConfig, adapter_source: AdapterSource | None = None) -> None:
        """Load the model and size the pool.

        Args:
            config: the engine's settings.
            adapter_source: where adapters come from by digest (the adapter store, or a
                ``DirectoryAdapterSource``); without one, requests naming an adapter are refused.
        """
        self.config = config
        # the CPU threads it steps with, on whichever thread steps it (cpu_threads.py)
        self.num_threads = torch.get_num_threads()
        self.model_path = resolve_model_path(config.model)
        self.model_config = ModelConfig.from_pretrained(self.model_path)
        self.dtype = parse_dtype(config.dtype)
        self.device = torch.device(config.device)
        self.max_model_len = self._max_model_len()
        self.tokenizer = load_tokenizer(self.model_path)  # None: token-id prompts only
        kernels = config.kernels
        if kernels == "auto":
            kernels = "triton" if self.device.type == "cuda" else "torch"
        self.kernels = kernels
        # Tensor parallelism (parallel/): ranks 1..N-1 start now; this process is rank 0 and
        # holds its shard; the pool's pages are shard-sized on every rank.
        self.parallel: TensorParallel | None = None
        if config.tensor_parallel_size > 1:
            self.parallel = TensorParallel(config, self.model_path, self.model_config, kernels,
                                           self.max_model_len, adapter_source is not None)
            model = self.parallel.model
        else:
            model = load_weights(self.model_path, self.model_config, self.dtype, self.device)
        try:
            self._build(config, model, adapter_source)
        except BaseException:
            self.close()
            raise

    def _build(self, config: EngineConfig, model: LlamaModel,
               adapter_source: AdapterSource | None) -> None:
        kernels = self.kernels
        self.page_elems = kv_page_elems(config.page_size, model.config.num_kv_heads,
                                        self.model_config.head_dim)
        self.profile: ProfileResult | None = None  # the profiling pass, where one sized the pool
        num_pages = self._num_pages(model, adapter_source is not None)
        # on a CPU on huge pages: decode attention and LoRA read pages scattered over it
        pools = huge_pages.zeros((self.model_config.num_layers, num_pages, self.page_elems),
                                 self.dtype, self.device)
        if self.parallel is not None:
            self.runner: ModelRunner = self.parallel.runner(pools, kernels)
        else:
            self.runner = ModelRunner(model, pools, config.page_size, kernels)
        self.pager = Pager(num_pages)
        self.adapters: AdapterManager | None = None
        if adapter_source is not None:
            self.adapters = AdapterManager(
                adapter_source, self.model_config, self.pager, pools, config.max_rank,
                config.host_cache_bytes,
                sharding=self.parallel.sharding if self.parallel is not None else None)
        self.base_revision = model_revision(self.model_path)
        self.prefix_cache: PrefixCache | None = None
        if config.enable_prefix_caching:
            self.prefix_cache = PrefixCache(self.pager, config.page_size, self.base_revision,
                                            config.share_prefix_across_tenants)
        target_s = config.scheduler.target_itl_ms / 1000.0
        self.step_timer = StepTimer(StepCostModel(), target_s)
        eos = set(self.model_config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.speculator: Speculator | None = None
        if config.speculative_method == "ngram":
            self.speculator = Speculator(config.num_speculative_tokens,
                                         config.speculative_ngram_min,
                                         config.speculative_ngram_max, self.max_model_len,
                                         cost_gate=config.speculative_cost_gate)
        self.scheduler = Scheduler(config.scheduler, self.pager, self.adapters,
                                   self.prefix_cache, cost=self.step_timer.model.predict,
                                   eos_token_ids=eos, max_model_len=self.max_model_len,
                                   speculator=self.speculator)
        self.grammars: GrammarService | None = None  # structured output (needs a tokenizer)
        if self.tokenizer is not None:
            stops = eos | {t for t in (self.tokenizer.end_of_turn_id,) if t is not None}
            self.grammars = GrammarService(self.tokenizer, self.model_config.vocab_size, stops,
                                           config.grammar_compile_timeout,
                                           config.grammar_cache_bytes)
        self.outputs = OutputProcessor(self.scheduler, self.tokenizer, self.grammars,
                                       self.model_config.vocab_size, config.jump_forward)
        self._inbox: queue.SimpleQueue[tuple[str, object]] = queue.SimpleQueue()
        # Without an operator's seed, from the OS: replicas and restarts must not repeat the
        # same "random" draws for unseeded requests.
        seed = config.seed if config.seed is not None else secrets.randbits(63)
        self._seed_rng = torch.Generator().manual_seed(seed)
        self._num_steps = 0
        # whether the last step ran a batch (False: everything waits, e.g. on adapter loads)
        self.last_step_ran = False
        if self.device.type == "cuda" and kernels == "triton":
            self.warmup()
            if self.parallel is not None:
                self.parallel.group.wait_ready()  # until every rank has warmed up too
        gate = self.speculator is not None and config.speculative_cost_gate
        if (target_s > 0 or gate) and self.parallel is None:
            # With tensor parallelism the cost model learns from live steps only: a
            # calibration step would have to run on every rank.
            calibrate(self.runner, self.pager, self.step_timer.model,
                      config.scheduler.max_num_batched_tokens, self.max_model_len)
        self._froze_gc = gc_freeze.freeze()  # no full collection walks start-up's objects
        logger.info("engine ready: %s, %s, %d pages of %d tokens, kernels=%s",
                    self.model_path, config.dtype, num_pages, config.page_size, kernels)

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """The model's end-of-sequence tokens (the scheduler stops requests at them)."""
        return self.scheduler.eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, token_ids: frozenset[int]) -> None:
        self.scheduler.eos_token_ids = frozenset(token_ids)

    def close(self) -> None:
        """Stop the tensor-parallel ranks and the adapter loaders (idempotent)."""
        if self.parallel is not None:
            self.parallel.close()
        adapters = getattr(self, "adapters", None)
        if adapters is not None:
            adapters.close()
        if getattr(self, "_froze_gc", False):
            gc_freeze.release()
            self._froze_gc = False

    # -- set-up ------------------------------------------------------------------------------
    def warmup(self) -> None:
        """Compile every kernel variant before serving (``warmup.py``: dummy model steps with
        and without a LoRA segment, a split-keys decode, each LoRA variant up to ``max_rank``)
        on borrowed free pages, which all return to the pager. Called by ``__init__`` with
        Triton kernels on CUDA."""
        rank = min(16, self.config.max_rank) if self.adapters is not None else None
        warm_up(self.runner, self.pager, self.max_model_len, rank, self.config.max_rank)

    def _max_model_len(self) -> int:
        length = self.model_config.max_position_embeddings
        if self.model_config.sliding_window:
            # Served exactly only while every sequence fits the window.
            length = min(length, self.model_config.sliding_window)
        if self.config.max_model_len is not None:
            if self.config.max_model_len > length:
                raise ValueError(f"max_model_len: {self.config.max_model_len} exceeds the "
                                 f"model's {length}")
            length = self.config.max_model_len
        return length

    def _num_pages(self, model: LlamaModel, lora: bool) -> int:
        """``num_pages``, else on CUDA what the free memory holds after a profiling forward
        pass at ``max_num_batched_tokens`` (with a ``max_rank`` adapter when adapters are
        served) has measured the activations' peak (``profile.py``); on CPU
        ``pool_memory_bytes``."""
        if self.config.num_pages is not None:
            return self.config.num_pages
        bytes_per_page = (self.page_elems * self.model_config.num_layers
                          * torch.empty(0, dtype=self.dtype).element_size())
        if self.device.type == "cuda":
            sched = self.config.scheduler
            q_lens = profile_batch(sched.max_num_batched_tokens, sched.max_num_seqs,
                                   self.max_model_len)
            self.profile = profile_run(model, self.config.page_size, self.kernels, q_lens,
                                       self.config.max_rank if lora else None)
            free, _ = torch.cuda.mem_get_info(self.device)
            num_pages = pool_pages(free, self.profile.peak_activation_bytes or 0,
                                   self.config.gpu_memory_utilization, bytes_per_page)
            logger.info("pool: %d pages after a profiling pass of %d tokens in %d sequences "
                        "(activation peak %d bytes, %d bytes free)", num_pages,
                        self.profile.num_tokens, self.profile.num_seqs,
                        self.profile.peak_activation_bytes, free)
            return num_pages
        num_pages = self.config.pool_memory_bytes // bytes_per_page
        if num_pages < 2:
            raise ValueError(f"pool_memory_bytes: {self.config.pool_memory_bytes} bytes hold "
                             f"fewer than 2 pages of {bytes_per_page} bytes")
        return int(num_pages)

    # -- requests ------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int] | ChatMessages,
                    params: SamplingParams | None = None, adapter_digest: str | None = None,
                    tenant: str = "default") -> Request:
        """Validate and queue a request (any thread). Raises ``ValueError`` naming the field.

        ``prompt`` is text, token ids, or chat messages, which the model's chat template
        renders (ending with the assistant's turn); a chat request also stops at the
        template's end-of-turn token unless ``ignore_eos`` is set.

        With ``params.n > 1`` the request is n sequences (``Request``s of one group whose
        outputs carry ``request_id`` and their ``index``): the first prefills the prompt, the
        others fork off it when it samples its first token. Returns the first.
        """
        params = params or SamplingParams()
        if not request_id:
            raise ValueError("request_id: must not be empty")
        if adapter_digest is not None and self.adapters is None:
            raise ValueError("adapter: this engine serves no adapters (no adapter source)")
        if self.outputs.has(request_id):
            raise ValueError(f"request_id: {request_id!r} is already in use")
        if params.n > 1 and self.parallel is not None:
            # The copy-on-write page copies run on the driver's pool only (not broadcast).
            raise ValueError("n: n > 1 is not served with tensor parallelism yet; send n "
                             "requests")
        token_ids, params = self._encode(prompt, params)
        if not token_ids or (isinstance(prompt, str) and not prompt):
            raise ValueError("prompt: must not be empty")
        vocab = self.model_config.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in token_ids):
            raise ValueError(f"prompt: token ids must be integers in [0, {vocab})")
        unknown = sorted(t for t, _ in params.logit_bias if t >= vocab)
        if unknown:
            raise ValueError(f"logit_bias: token ids {unknown[:5]} are not in the vocabulary "
                             f"[0, {vocab})")
        total = len(token_ids) + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(f"prompt: {len(token_ids)} prompt tokens + max_tokens "
                             f"{params.max_tokens} exceed the context of {self.max_model_len}")
        if -(-total // self.config.page_size) > self.pager.num_pages:
            raise ValueError(f"max_tokens: {total} tokens do not fit the pool of "
                             f"{self.pager.num_pages} pages")
        seed = params.seed
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,), generator=self._seed_rng))
        group = []
        for i in range(params.n):
            # A NUL never appears in a client's id (the gateway takes printable ones only).
            child_id = request_id if params.n == 1 else f"{request_id}\x00{i}"
            group.append(Request(child_id, list(token_ids), params,
                                 adapter_digest=adapter_digest, tenant=tenant,
                                 generator=torch.Generator().manual_seed((seed + i) % 2**63),
                                 group_id=request_id if params.n > 1 else "", index=i))
        if params.structured is not None:  # sequences 1..n-1 get theirs when they fork
            if self.grammars is None:
                raise ValueError("structured: this model has no tokenizer to compile the "
                                 "grammar against")
            group[0].grammar = self.grammars.submit(params.structured)  # compiles off-thread
        self.outputs.add(group)
        self._inbox.put(("add", group))
        return group[0]

    def sequences(self, request_id: str) -> tuple[Request, ...]:
        """The n sequences of an unfinished request (empty once all have finished)."""
        return self.outputs.sequences(request_id)

    def _encode(self, prompt: str | list[int] | ChatMessages, params: SamplingParams
                ) -> tuple[list[int], SamplingParams]:
        if params.stop and self.tokenizer is None:
            raise ValueError("stop: this model has no tokenizer to match stop strings")
        token_ids = prompt_token_ids(self.tokenizer, prompt)
        if not isinstance(prompt, ChatMessages):
            return token_ids, params
        eot = self.tokenizer.end_of_turn_id if self.tokenizer is not None else None
        if eot is not None and not params.ignore_eos and eot not in params.stop_token_ids:
            params = replace(params, stop_token_ids=(*params.stop_token_ids, eot))
        return token_ids, params

    def abort(self, request_id: str) -> None:
        """Stop a request (any thread); its pages return within the next step."""
        self._inbox.put(("abort", request_id))

    def has_unfinished(self) -> bool:
        # A failed rank counts as work: the next step() raises it, ending the engine thread.
        return (self.scheduler.has_unfinished() or not self._inbox.empty()
                or (self.parallel is not None and self.parallel.failed is not None))

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, list):
                self.scheduler.add(item[0], item[1:])
                if item[0].adapter_digest is not None and self.adapters is not None:
                    self.adapters.prefetch(item[0].adapter_digest)
            elif kind == "abort":
                for req in self.outputs.sequences(str(item)):
                    if not req.finished:
                        self.outputs.finish(req, RequestStatus.FINISHED_ABORTED)

    # -- the step ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one iteration and report progress: each request's new tokens and text, and a
        final output for each request that ended.

        1. Drain the inbox (new requests queue, aborts end).
        2. ``scheduler.schedule() -> ScheduledBatch``: the requests that advance and by how
           many tokens, the pages they got, the copies to perform (adapter weights, shared
           pages), and the waiting requests that can never run (``refused``, now failed).
        3. ``runner.run(batch) -> RunOutput``: the copies, the forward pass, logits rows
           mapped to requests. An exception fails the batch; a ``RankFailure`` ends the
           engine.
        4. Sample each row (an ``n > 1`` prompt's siblings from its sequence 0's row, with
           its grammar's bitmask): ``Accepted`` tokens per request; a failed row fails its
           request.
        5. ``scheduler.update(batch, accepted)``: computed tokens, prefix-cache pages, forks,
           appended tokens and the finishes that need no text (their pages return now).
        6. ``outputs.process``: detokenize, stop strings, jump-forward, ``RequestOutput``s.
        7. Record the step's time against its predicted shape.
        """
        if self.parallel is not None:
            self.parallel.check()  # RankFailure: this engine cannot go on
        cpu_threads.use(self.num_threads)
        self._drain_inbox()
        self.outputs.jump_at_start(self.scheduler.waiting)
        start = time.perf_counter()  # a step's time: scheduling to its outputs
        batch = self.scheduler.schedule(time.monotonic())
        for req, _ in batch.refused:
            self.outputs.finish(req, RequestStatus.FINISHED_ERROR)
        self.last_step_ran = bool(batch.requests)
        if batch.requests:
            self._num_steps += 1
            if self._run(batch):
                self.step_timer.record(batch.shape, time.perf_counter() - start)
        return self.outputs.take()

    def _run(self, batch: ScheduledBatch) -> bool:
        now = time.monotonic()
        try:
            run = self.runner.run(batch, self.adapters)
        except RankFailure:
            raise  # the ranks are out of step: no later step can run
        except Exception as exc:  # a bug or a device fault: fail this batch, keep serving
            logger.exception("model step failed")
            for req in batch.requests:
                req.error = f"internal error in model step: {exc}"
                self.outputs.finish(req, RequestStatus.FINISHED_ERROR)
            return False
        # From here on a failure is one request's: it fails that request, never the step.
        accepted, failures = self._sample(run)
        update = self.scheduler.update(batch, accepted, run.prompt_logprobs, now)
        for req in update.failed:
            self.outputs.finish(req, RequestStatus.FINISHED_ERROR)
        for req, error in failures:
            self.outputs.fail(req, error, log=False)
        for tokens in update.tokens:
            try:
                self.outputs.process(tokens)
            except Exception as exc:
                self.outputs.fail(tokens.request, f"internal error in postprocessing: {exc}")
        return True

    def _sample(self, run: RunOutput) -> tuple[list[Accepted], list[tuple[Request, str]]]:
        """One token per sampling request, from its last row (a forking sequence 0's row is
        also its siblings'), or the verified tokens of a request with a draft, from its
        ``1 + d`` rows (speculation); and the requests whose row failed, with why."""
        rows: list[int] = []
        sampling: list[Request] = []
        for req in run.requests:
            own = run.rows_of(req)
            if req.draft_token_ids:
                rows.extend(own)
                sampling.extend([req] * len(own))
                continue
            for seq in (req, *self.scheduler.pending_forks(req)):
                if seq is not req and req.grammar is not None and seq.grammar is None:
                    # Each sequence its own matcher, from sequence 0's state (before it
                    # samples: the siblings' rows are masked by their own grammar).
                    seq.grammar = req.grammar.fork_for(req, seq)
                rows.append(own[-1])
                sampling.append(seq)
        if not rows:
            return [], []
        # A sampled request verifying a draft draws a uniform per row: rewound after.
        states = {id(r): Speculator.generator_state(r) for r in run.requests
                  if r.draft_token_ids}
        mask_errors: dict[int, str] = {}  # rows whose grammar allows no token, and why
        try:
            metadata = SamplingMetadata.from_requests(sampling, self.model_config.vocab_size,
                                                      self.eos_token_ids, run.logits.device)
            if self.grammars is not None:
                bitmask, mask_errors = self.grammars.bitmask(sampling)
                metadata = replace(metadata, allowed_token_bitmask=bitmask)
            every_row = len(rows) == run.logits.shape[0] and rows == list(range(len(rows)))
            # (sample never writes its logits: a decode step's rows need no copy)
            result = sample(run.logits if every_row else run.logits[rows], metadata)
        except Exception as exc:  # a bug in the sampler: this batch's sampling requests fail
            logger.exception("sampling failed")
            return [], [(req, f"internal error in sampling: {exc}") for req in sampling]
        failed = set(result.failed_rows)
        accepted: list[Accepted] = []
        failures: list[tuple[Request, str]] = []
        i = 0
        while i < len(sampling):
            req = sampling[i]
            own = range(i, i + 1 + len(req.draft_token_ids))  # 1 + d rows when verifying
            i = own.stop
            # A failed row matters only if the rows before it accept the draft up to it.
            bad = next((r for r in own if r in failed), None)
            usable = own if bad is None else range(own.start, bad)
            if bad is not None and (bad == own.start or self._reaches(req, result.token_ids,
                                                                       usable)):
                failures.append((req, mask_errors.get(bad, SAMPLING_FAILED)))
            elif len(own) > 1 and self.speculator is not None:
                tokens = [result.token_ids[r] for r in usable]
                if len(usable) < len(own):  # verify the draft as far as usable rows go
                    del req.draft_token_ids[len(usable) - 1:]
                try:
                    verdict = self.speculator.verify(req, tokens, states.get(id(req)))
                except Exception as exc:  # a bug in verification: this request fails alone
                    logger.exception("verification failed")
                    failures.append((req, f"internal error in speculative verification: "
                                          f"{exc}"))
                    continue
                accepted.append(Accepted(req, verdict.token_ids, [
                    result.logprobs[r] for r in own[:len(verdict.token_ids)]]))
            else:
                accepted.append(Accepted(req, [result.token_ids[own[0]]],
                                         [result.logprobs[own[0]]]))
        return accepted, failures

    @staticmethod
    def _reaches(req: Request, token_ids: list[int], rows: range) -> bool:
        """Whether ``rows`` (the rows before a failed one) accept ``req``'s draft all the way
        to that failed row, whose token would then be needed."""
        return all(token_ids[r] == x for r, x in zip(rows, req.draft_token_ids))

    def stats(self) -> EngineStats:
        return collect_stats(self.scheduler, self.pager, self._num_steps, self.step_timer,
                             self.adapters, self.prefix_cache, self.grammars,
                             self.speculator.stats() if self.speculator is not None else None)
