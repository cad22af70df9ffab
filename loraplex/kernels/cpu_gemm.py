"""Float32 GEMMs on prepacked weights, in C through ctypes: on AMX tiles (``csrc/gemm_amx.c``)
where the CPU has them, else on FMA vectors (``csrc/gemm_fma.c``).

AMX: a float32 ``linear`` computed, from 15 rows up, as six bfloat16 tile products of the
three-part split of each operand (the C file says why that keeps float32's accuracy), and
under 15 rows as float32 FMAs on the same packed weights: faster than oneDNN's prepacked
float32 GEMM at every row count measured (1.3-1.5x on 32 decode rows, 1.2-1.6x on prefill
chunks, at SmolLM2's shapes).

FMA: plain float32 FMAs, 6 x 16 register tiles on AVX2 (12 x 32 with AVX-512), weights in
16-column panels (32), depth chunks and row blocks sized for L2, x rearranged per row block
into a scratch, the next panel prefetched while a panel's row groups run: on a Zen 3 core
1.1-1.3x oneDNN on 32 decode rows and 1.0-1.1x on prefill chunks at the benchmark Llama's and
SmolLM2's shapes (before the scratch and the prefetch); on a Zen 5 core 1.32-1.55x on 32 rows,
0.94-1.06x on 256-1536, 0.96-1.38x on one row. ``LORAPLEX_FMA_GEMM=auto`` (the default) turns
it on only where that was measured (x86 with AVX2 and FMA, no AVX-512; AVX-512 on AMD's family
0x1A, Zen 5, and later); ``1`` on any CPU without AMX (correct everywhere: the tests run it on
every machine); ``0`` never.

``pack(weight)`` rearranges a ``[d_out, d_in]`` weight once into the chosen kernel's panel
order (still float32: 4 bytes an element, the weight's own size; the model drops the dense
copy), on transparent huge pages (``huge_pages``); ``linear(x, packed)`` runs it.
``backend()`` says which kernel serves this process (``"amx"``, ``"fma"`` or ``None``),
``enabled()`` whether one does: the native library loaded (``loraplex/kernels/native.py``),
the CPU allows it and its switch is not off (``LORAPLEX_AMX_GEMM``, ``LORAPLEX_FMA_GEMM``).

bf16 (``csrc/gemm_bf16.c``): on a CPU with AVX512-BF16 and no AMX (Zen 4, Zen 5) bf16
projections run on pair dot products (vdpbf16ps) over weights packed in 16-column panels of
depth pairs (still bf16, the weight's own size): the products exact, summed in float32, one
rounding; against oneDNN's prepacked bf16 GEMM on a Zen 4 core at SmolLM2's shapes 1.3-2.2x
on one row, 1.1-1.2x on 32 (decode steps), 0.97-1.03x on 1536 (prefill chunks; 0.81-0.95x on
a Zen 5 core). ``bf16_enabled()`` says whether it serves this process (``LORAPLEX_BF16_GEMM=0``
turns it off); ``pack`` of a bf16 weight packs for it (``kind="bf16"``) and ``linear`` runs it.
On a CPU with AMX the same packed weights run on AMX tiles (``kind="bf16_amx"``): 1.2-1.4x
oneDNN's prepacked bf16 GEMM on decode-sized calls (1-64 rows) and slower on prefill chunks.
So a bf16 model keeps oneDNN's weights for prefill and a copy in one of these kinds for decode
steps (``bf16_decode_kind()``; ``LORAPLEX_BF16_DECODE_TILES=0``: one copy).
Callers keep their oneDNN/torch GEMM for the rest (no backend, fp16, bf16 elsewhere).
"""

from __future__ import annotations

import ctypes
import threading

import torch

from loraplex.kernels import huge_pages, native
from loraplex.server import env

__all__ = ["BACKENDS", "PackedWeight", "backend", "backends", "bf16_available",
           "bf16_decode_kind", "bf16_enabled", "bf16_tiles_available", "enabled",
           "linear", "pack"]

BACKENDS = ("amx", "fma")

_p, _i64, _int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


def _amx_library() -> ctypes.CDLL | None:
    lib = native.library("gemm_amx")
    if lib is not None and lib.loraplex_amx_linear.argtypes is None:  # first use of this load
        lib.loraplex_amx_packed_elems.argtypes = [_i64, _i64]
        lib.loraplex_amx_packed_elems.restype = _i64
        lib.loraplex_amx_scratch_elems.argtypes = [_i64, _i64, _int]
        lib.loraplex_amx_scratch_elems.restype = _i64
        lib.loraplex_amx_pack.argtypes = [_p, _i64, _i64, _i64, _p, _int]
        lib.loraplex_amx_pack.restype = None
        lib.loraplex_amx_linear.argtypes = [_p, _i64, _p, _p, _p, _i64, _i64, _i64, _i64, _p,
                                            _int]
        lib.loraplex_amx_linear.restype = _int
    return lib


def _fma_library() -> ctypes.CDLL | None:
    lib = native.library("gemm_fma")
    if lib is not None and lib.loraplex_fma_linear.argtypes is None:  # first use of this load
        lib.loraplex_fma_tuned.argtypes = []
        lib.loraplex_fma_tuned.restype = _int
        lib.loraplex_fma_packed_elems.argtypes = [_i64, _i64]
        lib.loraplex_fma_packed_elems.restype = _i64
        lib.loraplex_fma_pack.argtypes = [_p, _i64, _i64, _i64, _p, _int]
        lib.loraplex_fma_pack.restype = None
        lib.loraplex_fma_scratch_elems.argtypes = [_i64, _i64, _int]
        lib.loraplex_fma_scratch_elems.restype = _i64
        lib.loraplex_fma_linear.argtypes = [_p, _i64, _p, _p, _p, _i64, _i64, _i64, _i64, _p,
                                            _int]
        lib.loraplex_fma_linear.restype = None
    return lib


def _bf16_library() -> ctypes.CDLL | None:
    lib = native.library("gemm_bf16")
    if lib is not None and lib.loraplex_bf16_linear.argtypes is None:  # first use of this load
        lib.loraplex_bf16_gemm_available.argtypes = []
        lib.loraplex_bf16_gemm_available.restype = _int
        lib.loraplex_bf16_packed_elems.argtypes = [_i64, _i64]
        lib.loraplex_bf16_packed_elems.restype = _i64
        lib.loraplex_bf16_pack.argtypes = [_p, _i64, _i64, _i64, _p, _int]
        lib.loraplex_bf16_pack.restype = None
        lib.loraplex_bf16_linear.argtypes = [_p, _i64, _p, _p, _p, _i64, _i64, _i64, _i64,
                                             _int]
        lib.loraplex_bf16_linear.restype = _int
        lib.loraplex_bf16_linear_tiles.argtypes = lib.loraplex_bf16_linear.argtypes
        lib.loraplex_bf16_linear_tiles.restype = _int
    return lib


def bf16_available() -> bool:
    """Whether the bf16 pair dot product GEMM can run here (the library builds and the CPU has
    AVX512-BF16), whatever the switch and AMX: the tests run it wherever it can."""
    lib = _bf16_library()
    return lib is not None and bool(lib.loraplex_bf16_gemm_available())


def bf16_enabled() -> bool:
    """Whether bf16 projections run on it in this process: available, no AMX (oneDNN's bf16
    GEMM runs on AMX tiles there) and ``LORAPLEX_BF16_GEMM`` not ``0``."""
    return env.bf16_gemm() and bf16_available() and not _amx_usable()


def bf16_tiles_available() -> bool:
    """Whether the bf16 GEMM can run on AMX tiles here (``kind="bf16_amx"``: an AMX build, the
    CPU's AMX-BF16, the kernel's tile data permission), whatever the switches."""
    lib = _bf16_library()
    if lib is None or not bf16_available():
        return False
    return native.probe_once(lib, "loraplex_bf16_amx_init", "AMX bf16 GEMM")


def bf16_decode_kind() -> str | None:
    """The kind of the second copy a bf16 model on oneDNN's GEMMs keeps of its projections for
    decode-sized calls, or None (one copy): ``"bf16_amx"`` where ``bf16_tiles_available()``,
    else ``"bf16"`` where ``bf16_enabled()`` (AVX512-BF16 without AMX: on a Zen 5 core the pair
    GEMM runs prefill chunks at 0.81-0.95x of oneDNN's speed, decode steps at 1.1-1.7x); None
    with ``LORAPLEX_BF16_DECODE_TILES=0`` (then the one copy is oneDNN's on AMX
    CPUs, the pair GEMM's elsewhere)."""
    if not env.bf16_decode_tiles():
        return None
    if bf16_tiles_available():
        return "bf16_amx"
    return "bf16" if bf16_enabled() else None


def _amx_usable() -> bool:
    lib = _amx_library()
    if lib is None:
        return False
    return native.probe_once(lib, "loraplex_amx_init", "AMX float32 GEMM")


def backends() -> list[str]:
    """The kernels that can run on this machine, whatever the switches: ``"amx"`` where the
    CPU has AMX tiles, ``"fma"`` wherever the native library builds (the tests run both)."""
    out = []
    if _amx_usable():
        out.append("amx")
    if _fma_library() is not None:
        out.append("fma")
    return out


def backend() -> str | None:
    """The kernel this process's float32 projections run on: AMX where the CPU has it (and
    ``LORAPLEX_AMX_GEMM`` is not ``0``), else the FMA kernel where ``LORAPLEX_FMA_GEMM``
    allows it (``auto``: the CPUs it was measured faster on), else ``None`` (oneDNN)."""
    if env.amx_gemm() and _amx_usable():
        return "amx"
    mode = env.fma_gemm()
    if mode == "off":
        return None
    lib = _fma_library()
    if lib is None:
        return None
    if mode == "on" or lib.loraplex_fma_tuned():
        return "fma"
    return None


def enabled() -> bool:
    """Whether ``pack``/``linear`` serve this process (``backend()`` is not ``None``)."""
    return backend() is not None


class PackedWeight:
    """A ``[d_out, d_in]`` weight in one kernel's panel order (its own dtype: float32 for
    ``"amx"`` and ``"fma"``, bf16 for ``"bf16"`` and ``"bf16_amx"``: the same pair panels, run on
    pair dot products or on AMX tiles)."""

    def __init__(self, data: torch.Tensor, d_out: int, d_in: int, kind: str,
                 lib: ctypes.CDLL) -> None:
        self.data = data  # the kernel's packed_elems(d_out, d_in) elements
        self.d_out = d_out
        self.d_in = d_in
        self.kind = kind  # "amx", "fma", "bf16" or "bf16_amx"
        self.lib = lib  # the library that packed it runs it

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


def pack(weight: torch.Tensor, kind: str | None = None) -> PackedWeight:
    """The panel-order copy of a CPU float32 ``[d_out, d_in]`` weight (any row stride, unit
    column stride) for ``kind`` (``"amx"`` or ``"fma"``; default ``backend()``), or of a bf16
    one for ``"bf16"`` (the default for a bf16 weight) or ``"bf16_amx"`` (AMX tiles).

    Raises:
        ValueError: that kernel cannot run here, or the weight is not such a tensor.
    """
    if kind in ("bf16", "bf16_amx") or (kind is None and weight.dtype == torch.bfloat16):
        return _pack_bf16(weight, kind or "bf16")
    kind = kind if kind is not None else backend()
    if kind not in BACKENDS or kind not in backends():
        raise ValueError(f"the {kind or 'native'} float32 GEMM is not available here")
    if (weight.dim() != 2 or weight.dtype != torch.float32 or not weight.is_cpu
            or weight.stride(1) != 1):
        raise ValueError("pack takes a CPU float32 [d_out, d_in] weight with unit column "
                         f"stride, got {weight.dtype} {tuple(weight.shape)} on {weight.device}")
    d_out, d_in = weight.shape
    threads = torch.get_num_threads()
    lib = _amx_library() if kind == "amx" else _fma_library()
    if lib is None:  # backends() loaded it
        raise ValueError(f"the {kind} float32 GEMM is not available here")
    if kind == "amx":
        data = huge_pages.empty(lib.loraplex_amx_packed_elems(d_out, d_in), torch.float32)
        lib.loraplex_amx_pack(weight.data_ptr(), weight.stride(0), d_out, d_in,
                              data.data_ptr(), threads)
    else:
        data = huge_pages.empty(lib.loraplex_fma_packed_elems(d_out, d_in), torch.float32)
        lib.loraplex_fma_pack(weight.data_ptr(), weight.stride(0), d_out, d_in,
                              data.data_ptr(), threads)
    return PackedWeight(data, d_out, d_in, kind, lib)


def _pack_bf16(weight: torch.Tensor, kind: str) -> PackedWeight:
    if not bf16_available():
        raise ValueError("the bf16 GEMM is not available here (no AVX512-BF16, or native "
                         "kernels off)")
    if kind == "bf16_amx" and not bf16_tiles_available():
        raise ValueError("the bf16 GEMM on AMX tiles is not available here (no AMX)")
    if (weight.dim() != 2 or weight.dtype != torch.bfloat16 or not weight.is_cpu
            or weight.stride(1) != 1):
        raise ValueError("pack takes a CPU bf16 [d_out, d_in] weight with unit column "
                         f"stride, got {weight.dtype} {tuple(weight.shape)} on {weight.device}")
    lib = _bf16_library()
    if lib is None:  # bf16_available() loaded it
        raise ValueError("the bf16 GEMM is not available here")
    d_out, d_in = weight.shape
    data = huge_pages.empty(lib.loraplex_bf16_packed_elems(d_out, d_in), torch.bfloat16)
    lib.loraplex_bf16_pack(weight.data_ptr(), weight.stride(0), d_out, d_in, data.data_ptr(),
                           torch.get_num_threads())
    return PackedWeight(data, d_out, d_in, kind, lib)


def _linear_bf16(x: torch.Tensor, w: PackedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    if (x.dim() != 2 or x.dtype != torch.bfloat16 or not x.is_cpu or x.shape[1] != w.d_in
            or x.stride(1) != 1):
        raise ValueError(f"linear takes CPU bf16 [T, {w.d_in}] rows with unit column stride, "
                         f"got {x.dtype} {tuple(x.shape)}")
    if bias is not None and (bias.shape != (w.d_out,) or bias.dtype != torch.bfloat16
                             or not bias.is_contiguous()):
        raise ValueError(f"bias must be a contiguous bf16 [{w.d_out}], got "
                         f"{bias.dtype} {tuple(bias.shape)}")
    rows = x.shape[0]
    y = torch.empty(rows, w.d_out, dtype=torch.bfloat16)
    if rows == 0:
        return y
    fn = w.lib.loraplex_bf16_linear_tiles if w.kind == "bf16_amx" else w.lib.loraplex_bf16_linear
    status = fn(
        x.data_ptr(), x.stride(0), w.data.data_ptr(),
        bias.data_ptr() if bias is not None else None, y.data_ptr(), y.stride(0), rows,
        w.d_out, w.d_in, torch.get_num_threads())
    if status == 2:
        raise MemoryError("the bf16 GEMM could not allocate its per-thread buffer")
    if status != 0:
        raise RuntimeError("the bf16 GEMM library was built without AVX512-BF16")
    return y


_scratch = threading.local()


def _scratch_for(elems: int) -> torch.Tensor:
    # grow-only, per thread: a fresh multi-MB buffer each call would be a fresh mmap and its
    # page faults
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.numel() < elems:
        buf = _scratch.buf = torch.empty(max(elems, 1 << 16), dtype=torch.int16)
    return buf


def linear(x: torch.Tensor, w: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight^T + bias`` for ``x [T, d_in]`` float32 (unit column stride) and a packed
    weight: ``[T, d_out]`` float32; bf16 in and out for a ``"bf16"`` / ``"bf16_amx"`` weight.

    Raises:
        ValueError: ``x`` or ``bias`` do not match the weight.
    """
    if w.kind in ("bf16", "bf16_amx"):
        return _linear_bf16(x, w, bias)
    if (x.dim() != 2 or x.dtype != torch.float32 or not x.is_cpu or x.shape[1] != w.d_in
            or x.stride(1) != 1):
        raise ValueError(f"linear takes CPU float32 [T, {w.d_in}] rows with unit column "
                         f"stride, got {x.dtype} {tuple(x.shape)}")
    if bias is not None and (bias.shape != (w.d_out,) or bias.dtype != torch.float32
                             or not bias.is_contiguous()):
        raise ValueError(f"bias must be a contiguous float32 [{w.d_out}], got "
                         f"{bias.dtype} {tuple(bias.shape)}")
    lib = w.lib
    rows = x.shape[0]
    y = torch.empty(rows, w.d_out, dtype=torch.float32)
    if rows == 0:
        return y
    threads = torch.get_num_threads()
    bias_ptr = bias.data_ptr() if bias is not None else None
    if w.kind == "fma":
        # x rearranged a row block at a time, as the micro-kernel reads it (float32)
        scratch = _scratch_for(2 * lib.loraplex_fma_scratch_elems(rows, w.d_in, threads))
        lib.loraplex_fma_linear(x.data_ptr(), x.stride(0), w.data.data_ptr(), bias_ptr,
                                y.data_ptr(), y.stride(0), rows, w.d_out, w.d_in,
                                scratch.data_ptr(), threads)
        return y
    scratch = _scratch_for(lib.loraplex_amx_scratch_elems(rows, w.d_in, threads))
    status = lib.loraplex_amx_linear(x.data_ptr(), x.stride(0), w.data.data_ptr(), bias_ptr,
                                     y.data_ptr(), y.stride(0), rows, w.d_out, w.d_in,
                                     scratch.data_ptr(), threads)
    if status != 0:
        raise RuntimeError("the AMX GEMM library was built without AMX")
    return y
