"""Adapters inside a worker: the host tier (CPU RAM, LRU by bytes), background loads from an
adapter source, and copies into the unified pool's pages.

A request's adapter goes through three places:

1. the **source** (the adapter store, or a local directory): ``fetch(digest)`` on a loader
   thread, never on the engine loop;
2. the **host cache**: the adapter flattened into its page layout
   (``loraplex/kernels/layout.py``), in the model dtype, ready to copy (pinned memory on CUDA);
3. the **pool**: an entry of the pager (kind ADAPTER, keyed by digest), pinned while any
   running request uses it and evicted LRU once none does.

``AdapterManager`` is the scheduler's ``AdmissionGate``: a request is admitted only when its
adapter is resident or in the host cache, and admission charges the adapter's pages. Admission
only reserves them (``acquire`` returns an ``AdapterLoad``, which rides the scheduled batch);
the model runner performs the copy (``copy_in``) before the step's forward pass.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import NoReturn, Protocol

import torch

from loraplex.adapter_store.format import CanonicalAdapter
from loraplex.adapter_store.store import AdapterSource
from loraplex.kernels.cpu import GroupBlocks, GroupLayers
from loraplex.kernels.layout import AdapterLayout, adapter_layout
from loraplex.server.engine import cpu_threads
from loraplex.server.engine.batch import AdapterLoad
from loraplex.server.engine.models.config import LORA_MODULES, ModelConfig
from loraplex.server.engine.pager import PageKind, Pager
from loraplex.server.engine.request import Request

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class HostAdapter:
    """An adapter laid out for the pool: ``flat[layer]`` is its region in every layer."""

    digest: str
    layout: AdapterLayout
    scale: float
    flat: torch.Tensor  # [num_layers, layout.num_elems], model dtype

    @property
    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()


def flatten_adapter(adapter: CanonicalAdapter, config: ModelConfig, dtype: torch.dtype,
                    max_rank: int, pin: bool = False) -> HostAdapter:
    """Lay a ``CanonicalAdapter`` out as its page region; raises ``ValueError`` if it does not
    fit this model or this engine."""
    rank = int(adapter.rank)
    if not 1 <= rank <= max_rank:
        raise ValueError(f"adapter {adapter.digest[:12]}: rank {rank} is outside "
                         f"[1, {max_rank}] served by this engine")
    modules = tuple(m for m in LORA_MODULES if m in set(adapter.target_modules))
    if not modules or len(modules) != len(set(adapter.target_modules)):
        raise ValueError(f"adapter {adapter.digest[:12]}: target modules "
                         f"{adapter.target_modules} are not a subset of {LORA_MODULES}")
    shapes = config.module_shapes()
    layout = adapter_layout(rank, modules, shapes)
    flat = torch.zeros(config.num_layers, layout.num_elems, dtype=dtype)
    for (layer, module), (a, b) in adapter.weights.items():
        d_in, d_out = shapes[module]
        if not 0 <= layer < config.num_layers or module not in layout.a_offsets:
            raise ValueError(f"adapter {adapter.digest[:12]}: weights for layer {layer} "
                             f"{module} do not fit the model")
        if tuple(a.shape) != (rank, d_in) or tuple(b.shape) != (d_out, rank):
            raise ValueError(f"adapter {adapter.digest[:12]}: {module} shapes "
                             f"{tuple(a.shape)}/{tuple(b.shape)} do not fit the model")
        a_off, b_off = layout.a_offsets[module], layout.b_offsets[module]
        # copy_ casts on the way in: no intermediate tensor a module
        flat[layer, a_off:a_off + rank * d_in].view(rank, d_in).copy_(a)
        flat[layer, b_off:b_off + rank * d_out].view(rank, d_out).copy_(b.t())
    # The store refuses non-finite weights, but not knowing the serving dtype it accepts
    # finite ones that the cast turns into inf (beyond 65504 in float16). One pass over the
    # whole region (240 isfinite calls on SmolLM2's q, k, v, o tensors took 4 ms of a 13 ms
    # load); the tensor is named only when it fails.
    if not _all_finite(flat):
        _raise_not_finite(adapter, layout, flat, dtype)
    if pin:
        flat = flat.pin_memory()
    return HostAdapter(adapter.digest, layout, float(adapter.scale), flat)


# a float dtype's integer view and its exponent bits: all ones is inf or NaN
_EXPONENT_BITS = {torch.float32: (torch.int32, 0x7F800000), torch.bfloat16: (torch.int16, 0x7F80),
                  torch.float16: (torch.int16, 0x7C00)}


def _all_finite(t: torch.Tensor) -> bool:
    """``torch.isfinite(t).all()``, from the exponent bits where the dtype has an entry in
    ``_EXPONENT_BITS`` (torch's isfinite on bf16 ran 4x slower than an integer and-compare)."""
    bits = _EXPONENT_BITS.get(t.dtype)
    if bits is None or not t.is_contiguous():
        return bool(torch.isfinite(t).all())
    int_dtype, mask = bits
    return not bool((t.view(int_dtype) & mask).eq_(mask).any())


def _raise_not_finite(adapter: CanonicalAdapter, layout: AdapterLayout, flat: torch.Tensor,
                      dtype: torch.dtype) -> NoReturn:
    """Name the first tensor of ``adapter`` that is not finite in its page region."""
    for (layer, module), (a, b) in adapter.weights.items():
        for half, off, t in (("A", layout.a_offsets[module], a),
                             ("B", layout.b_offsets[module], b)):
            if not _all_finite(flat[layer, off:off + t.numel()]):
                raise ValueError(f"adapter {adapter.digest[:12]}: layers.{layer}.{module}."
                                 f"lora_{half} is not finite in "
                                 f"{str(dtype).removeprefix('torch.')}"
                                 " (its weights overflow the serving dtype)")
    raise ValueError(f"adapter {adapter.digest[:12]}: weights are not finite in "
                     f"{str(dtype).removeprefix('torch.')}")


class PoolSharding(Protocol):
    """How a tensor-parallel engine lays adapters into its ranks' pools (parallel/driver.py):
    the host cache keeps each adapter whole, and each rank's pages receive its shard."""

    def pool_layout(self, layout: AdapterLayout) -> AdapterLayout:
        """The layout of one rank's shard (the same size on every rank)."""
        ...

    def local_region(self, host: HostAdapter, pages: list[int]) -> torch.Tensor:
        """This rank's region ``[num_layers, pool_layout(host.layout).num_elems]``; the other
        ranks' shards go to their pages with the next step."""
        ...


@dataclass(frozen=True)
class ResidentAdapter:
    """An adapter whose weights are in the pool: what the LoRA kernels need of it."""

    digest: str
    layout: AdapterLayout
    scale: float
    pages: tuple[int, ...]
    # The CPU LoRA path's blocks of this adapter per (layer, fused group), resolved on first
    # use (lora.py); its pages do not move while it is resident, and the cache goes with this
    # object when the adapter is evicted.
    blocks: dict[tuple[int, str], GroupBlocks] = field(
        default_factory=dict, compare=False, repr=False)
    # the same blocks of every layer per fused group, for a step's ``cpu.LoraPlan``
    groups: dict[str, GroupLayers] = field(default_factory=dict, compare=False, repr=False)
    # On a CPU pool (no sharding): the host cache's region of this adapter, ``[num_layers,
    # layout.num_elems]``, the very values its pages hold. The CPU path takes its blocks as views
    # of it: every block one contiguous run, where a block that crosses pages would otherwise be
    # a fresh copy made at each copy-in, in among the step's transient buffers (the allocator
    # then took fresh pages for the next prefill's GEMM outputs: a fault storm that made the
    # first prefill step after 10-13 copies-in 1.5-1.9 s slower on SmolLM2 in float32). Held here
    # while resident, even if the host cache's LRU drops it meanwhile.
    host_region: torch.Tensor | None = field(default=None, compare=False, repr=False)


class AdapterManager:
    """Host cache, background loader and pool residency for one engine (``AdmissionGate``)."""

    def __init__(self, source: AdapterSource, config: ModelConfig, pager: Pager,
                 pools: torch.Tensor, max_rank: int, host_cache_bytes: int = 4 << 30,
                 num_loader_threads: int = 2, sharding: PoolSharding | None = None) -> None:
        self.source = source
        self.sharding = sharding
        self.config = config
        self.pager = pager
        self.pools = pools  # [num_layers, num_pages, page_elems]
        self.page_elems = pools.shape[2]
        self.max_rank = max_rank
        self.host_cache_bytes = host_cache_bytes
        self._pin = pools.device.type == "cuda"
        self._lock = threading.Lock()
        self._host: OrderedDict[str, HostAdapter] = OrderedDict()  # LRU, oldest first
        self._host_bytes = 0
        self._loading: set[str] = set()
        self._failed: dict[str, str] = {}
        self._resident: dict[str, ResidentAdapter] = {}
        # Host adapters found ready during this step's scheduling, held so that the loader
        # thread's host-cache evictions cannot drop one between ready() and acquire().
        self._staged: dict[str, HostAdapter] = {}
        # Adapters given pages by acquire() whose weights the runner has not copied in yet.
        self._to_copy: dict[str, HostAdapter] = {}
        # confined: a loader's torch ops must not open a second OpenMP team (cpu_threads.py)
        self._pool = cpu_threads.confined_executor(num_loader_threads, "adapter-load")
        self._copy_stream = torch.cuda.Stream(pools.device) if self._pin else None
        self._pending_copies: list[torch.cuda.Event] = []
        # loads: store -> host cache (loader threads); copies_in: host cache -> pool pages (the
        # step, before its forward pass: the time a switch of adapters costs the batch)
        self.counters = {"loads": 0, "load_seconds": 0.0, "load_failures": 0, "host_hits": 0,
                         "host_misses": 0, "device_hits": 0, "device_misses": 0,
                         "evictions": 0, "copies_in": 0, "copy_in_seconds": 0.0,
                         "warm_loads": 0, "warm_dropped": 0}
        pager.on_evict(PageKind.ADAPTER, self._on_evict)

    # -- the host tier and the loader --------------------------------------------------------
    def prefetch(self, digest: str) -> None:
        """Start loading ``digest`` into the host cache unless it is there or on its way."""
        self._start_load(digest, warm=False)

    def warm(self, digest: str) -> bool:
        """Start loading ``digest`` into the host cache ahead of any request for it (any thread:
        the worker's ``Prefetch``). False when it is resident, cached or on its way already.
        A warm load never evicts: one that does not fit beside the cached adapters is dropped,
        and one that fits goes in as the least recently used, the first a later load evicts.
        A failure is only counted: a request waiting on it starts its own load next step
        (a failure kept would fail a request that comes later, after the cause has passed)."""
        return self._start_load(digest, warm=True)

    def _start_load(self, digest: str, warm: bool) -> bool:
        with self._lock:
            if digest in self._resident or digest in self._host or digest in self._loading:
                return False
            self._loading.add(digest)
            self.counters["warm_loads" if warm else "host_misses"] += 1
        self._pool.submit(self._load, digest, warm)
        return True

    def _load(self, digest: str, warm: bool = False) -> None:
        start = time.perf_counter()
        try:
            adapter = self.source.fetch(digest)
            if getattr(adapter, "digest", digest) != digest:
                raise ValueError(f"source returned adapter {adapter.digest[:12]} for {digest[:12]}")
            host = flatten_adapter(adapter, self.config, self.pools.dtype, self.max_rank,
                                   pin=self._pin)
        except Exception as exc:  # any failure fails only this adapter's requests
            logger.warning("adapter %s failed to load: %s", digest[:12], exc)
            with self._lock:
                self._loading.discard(digest)
                if not warm:  # a warm load's leaves no trace: a request's own load retries it
                    self._failed[digest] = f"adapter {digest[:12]} failed to load: {exc}"
                self.counters["load_failures"] += 1
            return
        with self._lock:
            self._loading.discard(digest)
            if warm and self._host_bytes + host.nbytes > self.host_cache_bytes:
                self.counters["warm_dropped"] += 1  # a request for it loads it again
                return
            self._host[digest] = host
            if warm:
                self._host.move_to_end(digest, last=False)
            self._host_bytes += host.nbytes
            while self._host_bytes > self.host_cache_bytes and len(self._host) > 1:
                _, old = self._host.popitem(last=False)
                self._host_bytes -= old.nbytes
            self.counters["loads"] += 1
            self.counters["load_seconds"] += time.perf_counter() - start

    def take_failures(self) -> dict[str, str]:
        """Digests whose load failed since the last call, with the reason (then forgotten,
        so a later request retries the load)."""
        with self._lock:
            failed, self._failed = self._failed, {}
        return failed

    # -- AdmissionGate ---------------------------------------------------------------------------
    def ready(self, request: Request) -> bool:
        digest = request.adapter_digest
        if digest is None or digest in self._resident:
            return True
        with self._lock:
            host = self._host.get(digest)
        if host is not None:
            self._staged[digest] = host
            return True
        self.prefetch(digest)
        return False

    def host_pages(self, digest: str) -> int | None:
        """Pages the adapter will take in the pool, once it is in the host cache."""
        with self._lock:
            host = self._host.get(digest)
        return self._pool_layout(host).num_pages(self.page_elems) if host is not None else None

    def begin_step(self) -> None:
        """Forget last step's staged host adapters."""
        self._staged.clear()

    def pages_needed(self, request: Request) -> int:
        """Pages admission must find for the adapter: its size unless already pinned (an
        unpinned resident adapter's pages count as allocatable until it is pinned)."""
        digest = request.adapter_digest
        if digest is None:
            return 0
        if digest in self._resident:
            resident = self._resident[digest]
            return 0 if self.pager.pins(digest) else len(resident.pages)
        host = self._staged.get(digest)
        return self._pool_layout(host).num_pages(self.page_elems) if host is not None else 0

    def pages_to_load(self, request: Request) -> int:
        """Pages admitting the request now would copy into the pool (0 when its adapter is
        resident): the step cost model counts the copy."""
        digest = request.adapter_digest
        if digest is None or digest in self._resident:
            return 0
        host = self._staged.get(digest)
        return host.layout.num_pages(self.page_elems) if host is not None else 0

    def acquire(self, request: Request) -> AdapterLoad | None:
        """Pin the request's adapter in the pool. One only in the host cache gets its pages
        now (pinned, and resident from here on for the scheduler's arithmetic); the copy of
        its weights is returned, for the runner to perform (``copy_in``) before the step's
        forward pass reads them."""
        digest = request.adapter_digest
        if digest is None:
            return None
        if digest in self._resident:
            self.pager.pin(digest)
            self.counters["device_hits"] += 1
            if digest in self._to_copy:  # its copy never ran (a failed step): issue it again
                return AdapterLoad(digest, self._resident[digest].pages)
            return None
        self.counters["device_misses"] += 1
        host = self._staged.pop(digest, None)
        if host is None:
            raise RuntimeError(f"adapter {digest[:12]} was admitted without ready()")
        with self._lock:
            if digest in self._host:
                self._host.move_to_end(digest)
        self.counters["host_hits"] += 1
        layout = self._pool_layout(host)
        pages = self.pager.add_entry(digest, PageKind.ADAPTER, layout.num_pages(self.page_elems))
        self._to_copy[digest] = host
        region = (host.flat if self.sharding is None and self.pools.device.type == "cpu"
                  and host.flat.dtype == self.pools.dtype else None)
        self._resident[digest] = ResidentAdapter(digest, layout, host.scale, tuple(pages),
                                                 host_region=region)
        return AdapterLoad(digest, tuple(pages))

    def copy_in(self, loads: Sequence[AdapterLoad]) -> None:
        """Copy each adapter's weights from the host cache into its reserved pages (on CUDA
        on the copy stream: ``wait_for_copies`` orders the step after them). A load whose
        copy never completes (the step failed first) is returned again by the next
        ``acquire`` of that adapter. Counted in ``counters`` (``copies_in``,
        ``copy_in_seconds``: on CUDA the time to issue the copies, not to run them)."""
        for load in loads:
            host = self._to_copy.get(load.digest)
            if host is None:
                continue  # copied already (a batch may carry one adapter's load twice)
            start = time.perf_counter()
            self._copy_in(host, list(load.page_ids))
            del self._to_copy[load.digest]  # only once done: a failed copy is issued again
            self.counters["copies_in"] += 1
            self.counters["copy_in_seconds"] += time.perf_counter() - start

    def _pool_layout(self, host: HostAdapter) -> AdapterLayout:
        return self.sharding.pool_layout(host.layout) if self.sharding else host.layout

    def release(self, request: Request) -> None:
        if request.adapter_digest is not None and request.adapter_digest in self._resident:
            self.pager.unpin(request.adapter_digest)

    def _copy_in(self, host: HostAdapter, pages: list[int]) -> None:
        # One copy of the whole region, then a scatter of its pages on the device. On CUDA the
        # source is the whole contiguous pinned tensor, so the copy is truly asynchronous (a
        # strided slice of it would be staged through pageable memory). The copy stream first
        # waits for the work queued on the compute stream: pages just freed may still be read
        # or written by a step in flight (one in which nothing sampled, so nothing synced).
        stream_ctx = (torch.cuda.stream(self._copy_stream) if self._copy_stream is not None
                      else _nullcontext())
        if self._copy_stream is not None:
            self._copy_stream.wait_stream(torch.cuda.current_stream(self.pools.device))
        region = host.flat if self.sharding is None else self.sharding.local_region(host, pages)
        with stream_ctx:
            n, e = region.shape[1], self.page_elems
            full = n // e  # pages the region fills; the last may be partly used
            flat = region.to(self.pools.device, non_blocking=self._pin)  # [num_layers, n]
            if full:
                index = torch.tensor(pages[:full], device=self.pools.device)
                self.pools.index_copy_(1, index, flat[:, :full * e].view(-1, full, e))
            if n > full * e:
                self.pools[:, pages[full], :n - full * e].copy_(flat[:, full * e:])
            if self._copy_stream is not None:
                event = torch.cuda.Event()
                event.record(self._copy_stream)
                self._pending_copies.append(event)

    def wait_for_copies(self) -> None:
        """Make the compute stream wait for adapter copies issued since the last step."""
        for event in self._pending_copies:
            torch.cuda.current_stream(self.pools.device).wait_event(event)
        self._pending_copies.clear()

    def _on_evict(self, digest: Hashable) -> None:
        # The pager keys ADAPTER entries by digest (acquire adds them so).
        self._resident.pop(str(digest), None)
        self._to_copy.pop(str(digest), None)
        self.counters["evictions"] += 1

    def resident(self, digest: str) -> ResidentAdapter:
        return self._resident[digest]

    def resident_digests(self) -> tuple[str, ...]:
        return tuple(self._resident)

    def host_digests(self) -> tuple[str, ...]:
        with self._lock:
            return tuple(self._host)

    def is_loading(self, digest: str) -> bool:
        with self._lock:
            return digest in self._loading

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class _nullcontext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None
