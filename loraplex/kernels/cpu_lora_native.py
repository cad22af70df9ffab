"""LoRA's short segments on the CPU in one C call per fused projection (``csrc/lora.c``).

Why: in a decode step LoRA is segments x layers x projections tiny products; as torch ops
(``cpu.lora_segments``' short path) each costs a fixed ~5 us whatever its size. The C kernel
does every short segment of a projection in one call, reading each module's ``A`` and ``B^T``
in place (views of the pool, float32 or bfloat16) and writing only the module's own columns
(no zero padding), so the cost left is the arithmetic and one ctypes call.

A group's module table (addresses, strides, ranks, columns) is built once and kept on its
``GroupBlocks`` (``native``), with the tensors it points into: a resident adapter's blocks
neither move nor change, and the table goes with the blocks on eviction. Long float32 segments
run here too (with the output's rows prefetched the kernel beats torch's GEMMs at rank 8-16);
long bf16 ones run in ``lora_long_bf16_segments`` with the oneDNN path's rounding of ``h`` to
bf16: on AMX tiles where the CPU has them (``has_long_bf16_tiles``; ``LORAPLEX_AMX_LORA=0``
keeps them off), else on AVX512-BF16's pair dot products.
"""

from __future__ import annotations

import array
import ctypes
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch

from loraplex.kernels import native
from loraplex.server import env

if TYPE_CHECKING:
    from loraplex.kernels.cpu import GroupBlocks, GroupLayers, SegmentBlocks

__all__ = ["LayerCall", "RegionModule", "has_long_bf16", "has_long_bf16_tiles", "long_bf16_call",
           "lora_long_bf16_segments", "lora_short_segments", "region_tables", "set_stream",
           "short_call", "stream_segments", "tiles_available"]

_DTYPES = {torch.float32: 0, torch.bfloat16: 1}  # csrc/lora.c's DT_F32, DT_BF16
_MODULE_FIELDS = 9  # csrc/lora.c's module_t
_SEGMENT_FIELDS = 4  # csrc/lora.c's segment_t
_ERRORS = {1: "a segment's rows lie outside x", 2: "a module's columns lie outside y",
           3: "an A block's row length is not x's width", 4: "unsupported dtype",
           5: "out of memory", 6: "AMX tiles asked for where they cannot run"}


class NativeTable(NamedTuple):
    """A group's ``module_t`` rows for ``csrc/lora.c`` and the tensors they point into."""

    table: torch.Tensor  # [num_modules, 9] int64
    address: int
    num_modules: int
    keep: tuple[torch.Tensor, ...]  # the blocks the table points into (copies held here)
    bf16: bool  # every block bf16 (``lora_long_bf16_segments`` takes only those)


def _block(t: torch.Tensor) -> torch.Tensor:
    # The kernel reads rows of unit element stride in float32 or bfloat16; anything else
    # (fp16 blocks, a strided view) becomes a float32 copy, made once.
    if t.dtype not in _DTYPES:
        t = t.float()
    return t if t.stride(1) == 1 else t.contiguous()


def module_table(group: GroupBlocks) -> NativeTable:
    """The group's table, built on first use and cached on ``group.native``."""
    cached = group.native
    if cached is not None:
        return cached
    rows, keep = [], []
    for m in group.modules:
        a, bt = _block(m.a_t.t()), _block(m.bt)  # [r, d_in], [r, d_out]
        if bt.shape[1] != m.end - m.start or a.shape[0] != bt.shape[0] or a.dtype != bt.dtype:
            raise ValueError(f"module blocks disagree: A {tuple(a.shape)} {a.dtype}, "
                             f"B^T {tuple(bt.shape)} {bt.dtype}, columns {m.start}:{m.end}")
        rows.append([a.data_ptr(), a.stride(0), bt.data_ptr(), bt.stride(0), a.shape[0],
                     m.start, m.end, a.shape[1], _DTYPES[a.dtype]])
        keep += [a, bt]
    table = torch.tensor(rows, dtype=torch.int64).reshape(-1, _MODULE_FIELDS)
    group.native = NativeTable(table, table.data_ptr(), len(rows), tuple(keep),
                               all(t.dtype == torch.bfloat16 for t in keep))
    return group.native


_STREAM_MODES = {"auto": -1, "off": 0, "on": 1}  # loraplex_lora_set_stream's modes


def _short_library() -> ctypes.CDLL | None:
    """The library, its memory-order switch set from ``LORAPLEX_LORA_STREAM`` once."""
    lib = native.library("lora")
    if lib is not None and not lib.__dict__.get("_loraplex_stream_set"):
        set_stream(_STREAM_MODES[env.lora_stream()], lib)
    return lib


def set_stream(mode: int, lib: ctypes.CDLL | None = None) -> int:
    """Where short segments of 1-3 rows (float32, or bf16 where the build has AVX512-BF16)
    run in memory order behind one prefetch stream (``csrc/lora.c``): ``-1`` on the CPUs where
    that was measured faster (AMD's family 0x1A), ``0`` nowhere, ``1`` everywhere (the same
    results either way, bit for bit). Returns the mode it replaces (-1 where the library does
    not load)."""
    lib = lib or native.library("lora")
    if lib is None:
        return -1
    fn = lib.loraplex_lora_set_stream
    if fn.argtypes is None:
        fn.restype, fn.argtypes = ctypes.c_int64, [ctypes.c_int64]
    lib.__dict__["_loraplex_stream_set"] = True
    return int(fn(mode))


def stream_segments() -> int:
    """How many segments this process has run in memory order (``set_stream``), for tests."""
    lib = native.library("lora")
    if lib is None:
        return 0
    fn = lib.loraplex_lora_stream_segments
    fn.restype, fn.argtypes = ctypes.c_int64, []
    return int(fn())


def lora_short_segments(x: torch.Tensor, y: torch.Tensor, segments: Sequence[SegmentBlocks],
                        short: int) -> Sequence[SegmentBlocks]:
    """Run the segments of at most ``short`` rows in one C call; return the others.

    Semantics, for each such segment and each module ``m`` of its group:
    ``y[lo:hi, start:end] += scale * (x[lo:hi] @ A^T) @ BT``, products accumulated in float32,
    ``h`` not rounded, a bf16 ``y`` rounded once per element (as ``cpu.lora_segments``' short
    path). Returns ``segments`` untouched (nothing run) when the library does not load
    (``native.library``), the tensors are not CPU float32/bfloat16 of one dtype, or their rows
    are not of unit element stride.

    Args:
        x: ``[T, d_in]`` float32 or bfloat16.
        y: ``[T, d_out_total]``, the same dtype, updated in place.
        segments: disjoint row ranges, each of rank > 0.
        short: the longest segment run here (``cpu._SHORT_SEGMENT``).
    Returns:
        The segments left for the torch path, in their order.
    Raises:
        ValueError: a segment or module outside ``x`` / ``y`` (checked in C before any write).
        MemoryError: the kernel's buffers could not be allocated.
    """
    code = _DTYPES.get(x.dtype)
    if (code is None or y.dtype != x.dtype or x.device.type != "cpu" or y.device.type != "cpu"
            or x.stride(1) != 1 or y.stride(1) != 1):
        return segments
    lib = _short_library()
    if lib is None:
        return segments
    fields: list[int] = []
    scales: list[float] = []
    rest = []
    for seg in segments:
        if seg.hi - seg.lo > short:
            rest.append(seg)
            continue
        t = seg.group.native or module_table(seg.group)
        fields += (seg.lo, seg.hi, t.address, t.num_modules)
        scales.append(seg.scale)
    if scales:
        _call(lib.loraplex_lora_short, x, y, (code,), fields, scales)
    return rest


def _call(fn: Any, x: torch.Tensor, y: torch.Tensor, extra: tuple[int, ...],
          fields: list[int], scales: list[float]) -> None:
    """``fn(x, x_stride, y, y_stride, rows, d_in, y_cols, *extra, n, segs, scales, threads)``,
    either entry point of ``csrc/lora.c``; its error codes raised."""
    # array.array: the segment fields as C int64 / float32 in one C-level copy of the lists
    seg_arr, scale_arr = array.array("q", fields), array.array("f", scales)
    _invoke(fn, x, y, extra, len(scales), seg_arr.buffer_info()[0], scale_arr.buffer_info()[0])


def _invoke(fn: Any, x: torch.Tensor, y: torch.Tensor, extra: tuple[int, ...], n: int,
            segs: int, scales: int) -> None:
    """``_call`` on segment and scale arrays already in C form (their addresses)."""
    if fn.argtypes is None:  # declared once: plain ints then convert in C, the cheapest call
        fn.restype = ctypes.c_int64
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                       *[ctypes.c_int64] * (5 + len(extra)), ctypes.c_void_p, ctypes.c_void_p,
                       ctypes.c_int64]
    rc = fn(x.data_ptr(), x.stride(0), y.data_ptr(), y.stride(0), x.shape[0], x.shape[1],
            y.shape[1], *extra, n, segs, scales, torch.get_num_threads())
    if rc == 5:
        raise MemoryError("native LoRA: " + _ERRORS[5])
    if rc != 0:
        raise ValueError("native LoRA: " + _ERRORS.get(rc, f"error {rc}"))


def _long_bf16_library() -> ctypes.CDLL | None:
    lib = native.library("lora")
    return lib if lib is not None and hasattr(lib, "loraplex_lora_has_dpbf16") else None


def has_long_bf16() -> bool:
    """Whether the library loads and was built with AVX512-BF16 (``loraplex_lora_long_bf16``)."""
    return _long_bf16_library() is not None


def tiles_available() -> bool:
    """Whether ``loraplex_lora_long_bf16`` can run on AMX tiles here (an AMX build on a CPU with
    AMX-BF16, the kernel's tile data permission granted), whatever the switch."""
    lib = _long_bf16_library()
    if lib is None or not hasattr(lib, "loraplex_lora_amx_init"):
        return False
    return native.probe_once(lib, "loraplex_lora_amx_init", "AMX LoRA (bf16 prefill)")


def has_long_bf16_tiles() -> bool:
    """Whether long bf16 segments run on AMX tiles in this process: ``tiles_available`` and
    ``LORAPLEX_AMX_LORA`` not ``0``."""
    return env.amx_lora() and tiles_available()


def lora_long_bf16_segments(x: torch.Tensor, y: torch.Tensor, segments: Sequence[SegmentBlocks],
                            tiles: bool | None = None) -> Sequence[SegmentBlocks]:
    """Run bf16 segments in one C call on AMX tiles or AVX512-BF16's pair dot products; return
    the others.

    Semantics, for each segment and each module ``m`` of its group (``cpu.lora_segments``'
    long bf16 path, oneDNN's): ``h = bf16(x[lo:hi] @ A^T)``, then
    ``y[lo:hi, start:end] = bf16(y + scale * (h @ BT))``, products accumulated in float32 (in
    another order on tiles than on pair dot products). Returns ``segments`` untouched (nothing
    run) where the kernel is not built (``has_long_bf16``), ``x`` / ``y`` are not CPU bf16 rows
    of unit stride, or a group's blocks are not bf16. ``tiles``: ``None`` as
    ``has_long_bf16_tiles()`` says; on tiles, modules whose depth is not a multiple of 32 or
    whose rank is over 64 still run on pair dot products.

    Raises:
        ValueError: a segment or module outside ``x`` / ``y`` (checked in C before any write),
        or ``tiles=True`` where ``tiles_available()`` is false.
        MemoryError: the kernel's buffers could not be allocated.
    """
    if (x.dtype != torch.bfloat16 or y.dtype != torch.bfloat16 or x.device.type != "cpu"
            or y.device.type != "cpu" or x.stride(1) != 1 or y.stride(1) != 1
            or not segments):
        return segments
    lib = _long_bf16_library()
    if lib is None:
        return segments
    use_tiles = has_long_bf16_tiles() if tiles is None else tiles
    if use_tiles and not tiles_available():
        raise ValueError("native LoRA: " + _ERRORS[6])
    fields: list[int] = []
    scales: list[float] = []
    rest = []
    for seg in segments:
        t = seg.group.native or module_table(seg.group)
        if not t.bf16:
            rest.append(seg)
            continue
        fields += (seg.lo, seg.hi, t.address, t.num_modules)
        scales.append(seg.scale)
    if scales:
        _call(lib.loraplex_lora_long_bf16, x, y, (int(use_tiles),), fields, scales)
    return rest


class LayerTables(NamedTuple):
    """An adapter's module tables of one fused projection in every layer (``layer_tables``)."""

    addresses: np.ndarray  # [num_layers] int64: each layer's ``NativeTable.address``
    num_modules: np.ndarray  # [num_layers] int64
    bf16: bool  # every block of every layer bf16
    keep: tuple[Any, ...] = ()  # what the addresses point into, where no NativeTable holds it


class RegionModule(NamedTuple):
    """Where one module's blocks lie in an adapter's per-layer region (``region_tables``)."""

    a_offset: int  # element offset of A [rank, d_in] in a layer's row of the region
    b_offset: int  # element offset of B^T [rank, d_out]
    rank: int
    start: int  # the module's columns of y
    end: int
    d_in: int


def region_tables(region: torch.Tensor, modules: Sequence[RegionModule]) -> LayerTables | None:
    """Every layer's module table of one group, computed at once from where the blocks lie in
    the adapter's region ``[num_layers, elems]`` (each layer a row; the CPU engine's host
    region, whose values its pages hold): the same rows ``module_table`` makes from the
    group's views of it, without making the views (about 7 ms an adapter at SmolLM2's 30 layers,
    paid at its first step after each copy-in). ``None`` where the region is not unit-stride
    CPU float32/bfloat16 or no module is given: the caller resolves views instead.

    Raises:
        ValueError: a module's blocks lie outside the region's row, or its columns disagree
        with ``rank`` and the width (``end - start``) of its B^T.
    """
    code = _DTYPES.get(region.dtype)
    if (code is None or region.dim() != 2 or region.device.type != "cpu" or not modules
            or region.stride(1) != 1):
        return None
    num_layers, elems = region.shape
    esize = region.element_size()
    rows = np.empty((num_layers, len(modules), _MODULE_FIELDS), dtype=np.int64)
    layer_base = region.data_ptr() + np.arange(num_layers, dtype=np.int64) * (
        region.stride(0) * esize)
    for j, m in enumerate(modules):
        d_out = m.end - m.start
        if (m.rank <= 0 or d_out <= 0 or m.d_in <= 0 or min(m.a_offset, m.b_offset) < 0
                or m.a_offset + m.rank * m.d_in > elems or m.b_offset + m.rank * d_out > elems):
            raise ValueError(f"module blocks outside the region: {m} in a row of {elems}")
        rows[:, j] = [0, m.d_in, 0, d_out, m.rank, m.start, m.end, m.d_in, code]
        rows[:, j, 0] = layer_base + m.a_offset * esize
        rows[:, j, 2] = layer_base + m.b_offset * esize
    step = len(modules) * _MODULE_FIELDS * rows.itemsize
    addresses = rows.ctypes.data + np.arange(num_layers, dtype=np.int64) * step
    return LayerTables(addresses, np.full(num_layers, len(modules), dtype=np.int64), code == 1,
                       (rows, region))


def layer_tables(group: GroupLayers) -> LayerTables:
    """The group's per-layer tables, built on first use and cached on ``group.native``."""
    cached = group.native
    if cached is not None:
        return cached
    tables = [g.native or module_table(g) for g in group.layers]
    group.native = LayerTables(np.array([t.address for t in tables], dtype=np.int64),
                               np.array([t.num_modules for t in tables], dtype=np.int64),
                               all(t.bf16 for t in tables))
    return group.native


class LayerCall:
    """One entry point of ``csrc/lora.c`` over a step's fixed segments, in every layer.

    The segment arrays of all layers are built at once (``[num_layers, n, 4]``), so a layer's
    call is the foreign call alone: in a decode step building them in each call, segment by
    segment, was a third of LoRA's time (SmolLM2, 17 segments, 60 calls a step).
    """

    def __init__(self, fn: Any, extra: tuple[int, ...],
                 segments: Sequence[tuple[int, int, float, GroupLayers]]) -> None:
        tables = [layer_tables(g) for _, _, _, g in segments]
        self.num_layers = len(tables[0].addresses)
        if any(len(t.addresses) != self.num_layers for t in tables):
            raise ValueError("segments' adapters have different numbers of layers")
        n = len(segments)
        fields = np.empty((self.num_layers, n, 4), dtype=np.int64)
        fields[:, :, 0] = [lo for lo, _, _, _ in segments]
        fields[:, :, 1] = [hi for _, hi, _, _ in segments]
        fields[:, :, 2] = np.stack([t.addresses for t in tables], axis=1)
        fields[:, :, 3] = np.stack([t.num_modules for t in tables], axis=1)
        self._fields = fields
        self._scales = np.array([s for _, _, s, _ in segments], dtype=np.float32)
        self._groups = [g for _, _, _, g in segments]  # the tables' owners, while this lives
        self._fn, self._extra, self._n = fn, extra, n
        self._base, self._stride = fields.ctypes.data, n * 4 * 8
        self._scale_addr = self._scales.ctypes.data

    def __call__(self, layer: int, x: torch.Tensor, y: torch.Tensor) -> None:
        """The segments' LoRA of ``layer`` into ``y`` (``x`` / ``y``: CPU rows of unit stride
        in the dtype the call was made for; the kernel checks every segment's bounds)."""
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} outside 0..{self.num_layers - 1}")
        _invoke(self._fn, x, y, self._extra, self._n, self._base + layer * self._stride,
                self._scale_addr)


def short_call(dtype: torch.dtype, segments: Sequence[tuple[int, int, float, GroupLayers]],
               short: int) -> tuple[list[LayerCall], list[tuple[int, int, float, GroupLayers]]]:
    """``lora_short_segments``' routing of a step's segments (``(lo, hi, scale, layers)``) done
    once for every layer: the call (none where the library does not load or ``dtype`` is not
    float32 / bfloat16) and the segments it leaves. ``short``: as ``lora_short_segments``'.
    """
    code = _DTYPES.get(dtype)
    lib = _short_library()
    if code is None or lib is None or not segments:
        return [], list(segments)
    calls = []
    short_segs = [s for s in segments if s[1] - s[0] <= short]
    rest = [s for s in segments if s[1] - s[0] > short]
    if short_segs:
        calls.append(LayerCall(lib.loraplex_lora_short, (code,), short_segs))
    return calls, rest


def long_bf16_call(segments: Sequence[tuple[int, int, float, GroupLayers]]
                   ) -> tuple[list[LayerCall], list[tuple[int, int, float, GroupLayers]]]:
    """``lora_long_bf16_segments``' routing done once for every layer (bf16 ``x`` and ``y``;
    on tiles as ``has_long_bf16_tiles()`` says)."""
    lib = _long_bf16_library()
    if lib is None or not segments:
        return [], list(segments)
    bf16 = [s for s in segments if layer_tables(s[3]).bf16]
    rest = [s for s in segments if not layer_tables(s[3]).bf16]
    tiles = (int(has_long_bf16_tiles()),)
    return ([LayerCall(lib.loraplex_lora_long_bf16, tiles, bf16)] if bf16 else []), rest
