"""Fused elementwise ops of the model's CPU forward pass (``csrc/elementwise.c``), through ctypes.

``rms_norm``, ``add_rms_norm`` (the residual add and the next norm in one pass), ``silu_and_mul``
and ``rope_qk`` (q and k heads in one call) replace torch sequences of three to five passes
over memory each (vLLM's CPU build fuses the same four). Each reproduces the torch code's
roundings (llama.py's HF ``rms_norm``, ``F.silu(gate) * up``, rope.py's rotation): with one
torch thread on an AVX2/AVX512 CPU the results are bit-identical to it (the C file says how).
The same library holds a reduction and a copy: ``row_argmax`` (greedy sampling's maxima and
first indices, ``torch.max(dim=-1)``'s values) and ``write_kv`` (the KV store,
``reference.write_kv``'s semantics).

``usable(*tensors)`` says whether the native path applies: the library loaded
(``loraplex/kernels/native.py``: not ``LORAPLEX_NATIVE_KERNELS=0``, a C compiler, a good build) and
every tensor a contiguous CPU tensor of one dtype, float32 or bfloat16. Callers keep their
torch code for the rest (CUDA, float16, views with odd strides). The ops raise ``ValueError``
on a tensor ``usable`` refuses.
"""

from __future__ import annotations

import ctypes
import functools
import platform

import torch

from loraplex.kernels import native

__all__ = ["add_rms_norm", "available", "rms_norm", "rope_qk", "row_argmax", "silu_and_mul",
           "usable", "write_kv"]

_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
# Below this many elements an op runs on one thread: an OpenMP fork costs more than it saves.
_PARALLEL_MIN_ELEMS = 1 << 15
_p, _i64, _int, _float = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float


def _library() -> ctypes.CDLL | None:
    lib = native.library("elementwise")
    if lib is not None and lib.loraplex_rope_qk.argtypes is None:  # first use of this load
        lib.loraplex_add_rms_norm.argtypes = [_int, _p, _p, _p, _p, _i64, _i64, _float, _i64, _int]
        lib.loraplex_silu_and_mul.argtypes = [_int, _p, _p, _i64, _i64, _i64, _int]
        lib.loraplex_rope_qk.argtypes = [_int, _p, _i64, _p, _p, _p, _p, _i64, _i64, _i64, _i64,
                                         _int]
        lib.loraplex_row_argmax.argtypes = [_p, _i64, _i64, _i64, _p, _p, _int]
        lib.loraplex_write_kv.argtypes = [_p, _i64, _p, _i64, _p, _p, _i64, _i64, _i64, _i64,
                                          _int]
        lib.loraplex_write_kv.restype = _int
        for fn in (lib.loraplex_add_rms_norm, lib.loraplex_silu_and_mul, lib.loraplex_rope_qk,
                   lib.loraplex_row_argmax):
            fn.restype = None
    return lib


def available() -> bool:
    """Whether the native library loads (building it on first use)."""
    return _library() is not None


def _takes(tensors: tuple[torch.Tensor, ...]) -> bool:
    # all contiguous CPU tensors of one dtype, float32 or bfloat16
    first = tensors[0]
    return first.dtype in _DTYPES and all(
        t.is_cpu and t.dtype == first.dtype and t.is_contiguous() for t in tensors)


def usable(*tensors: torch.Tensor) -> bool:
    """Whether the native ops take these tensors: library loaded, all contiguous CPU tensors
    of one dtype, float32 or bfloat16."""
    return _takes(tensors) and _library() is not None


def _lib_for(*tensors: torch.Tensor) -> ctypes.CDLL:
    lib = _library()
    if lib is None or not _takes(tensors):
        raise ValueError("native elementwise ops need contiguous CPU float32/bfloat16 tensors "
                         "of one dtype and the compiled library")
    return lib


@functools.cache
def _lanes() -> int:
    # torch's Vectorized<float>::size() in its elementwise kernels (the kernels it dispatches
    # to): where their vector loops end, and a scalar tail with libm's exp begins, hangs on it.
    capability = torch.backends.cpu.get_cpu_capability()
    if capability.startswith("AVX512"):
        return 16
    if capability.startswith("AVX2"):
        return 8
    # DEFAULT: the generic 32-byte vector on x86; 16-byte (NEON) vectors elsewhere
    return 8 if platform.machine() in ("x86_64", "AMD64") else 4


@functools.cache
def _sum_lanes() -> int:
    # The vector width of torch's sum kernel, which orders the sum of squares: measured as
    # 8 on an AVX512 machine too (torch 2.13 does not dispatch its sum kernel to AVX512).
    return min(_lanes(), 8)


def _threads(numel: int) -> int:
    return torch.get_num_threads() if numel >= _PARALLEL_MIN_ELEMS else 1


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


def add_rms_norm(hidden: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """``hidden += delta`` in place, then ``rms_norm(hidden, weight, eps)``, in one pass.

    Math (HF's RMSNorm): ``h = float32(hidden)``; ``y = dtype(h / sqrt(mean(h^2) + eps))``;
    ``out = weight * y`` in the dtype (so bf16 rounds twice, as HF does).

    Args:
        hidden: ``[T, n]`` float32 or bfloat16, contiguous; updated in place when ``delta``
            is given.
        delta: ``[T, n]`` like ``hidden``, or None (plain ``rms_norm``).
        weight: ``[n]`` of the same dtype.
        eps: added to the mean square.

    Returns:
        ``[T, n]``, a new tensor of the dtype.

    Raises:
        ValueError: a tensor the native path does not take (see ``usable``), or shapes that
            do not match.
    """
    tensors = (hidden, weight) if delta is None else (hidden, delta, weight)
    lib = _lib_for(*tensors)
    n = hidden.shape[-1]
    if weight.shape != (n,) or (delta is not None and delta.shape != hidden.shape):
        raise ValueError(f"add_rms_norm: hidden {tuple(hidden.shape)}, delta "
                         f"{None if delta is None else tuple(delta.shape)}, weight "
                         f"{tuple(weight.shape)}")
    out = torch.empty_like(hidden)
    rows = hidden.numel() // n if n else 0
    lib.loraplex_add_rms_norm(_DTYPES[hidden.dtype], _ptr(hidden),
                              None if delta is None else _ptr(delta), _ptr(weight), _ptr(out),
                              rows, n, eps, _sum_lanes(), _threads(hidden.numel()))
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``add_rms_norm(x, None, weight, eps)``: HF's RMSNorm, ``x`` left as it is."""
    return add_rms_norm(x, None, weight, eps)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for the fused gate/up projection's output.

    Math: ``gate, up = gate_up.chunk(2, -1)``; ``s = dtype(gate / (1 + exp(-gate)))``;
    ``out = s * up`` in the dtype (torch's in-place ``F.silu`` then the product).

    Args:
        gate_up: ``[T, 2 * I]`` float32 or bfloat16, contiguous.

    Returns:
        ``[T, I]``, a new tensor of the dtype.

    Raises:
        ValueError: a tensor the native path does not take, or an odd last dimension.
    """
    lib = _lib_for(gate_up)
    if gate_up.shape[-1] % 2:
        raise ValueError(f"silu_and_mul: odd last dimension {gate_up.shape[-1]}")
    inter = gate_up.shape[-1] // 2
    out = gate_up.new_empty((*gate_up.shape[:-1], inter))
    rows = out.numel() // inter if inter else 0
    # torch's vector loop does 2 Vectorized<scalar_t> a turn; a bf16 vector holds 2x the floats
    vec_block = 2 * _lanes() * (2 if gate_up.dtype == torch.bfloat16 else 1)
    lib.loraplex_silu_and_mul(_DTYPES[gate_up.dtype], _ptr(gate_up), _ptr(out), rows, inter,
                              vec_block, _threads(gate_up.numel()))
    return out


def rope_qk(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int,
            num_kv_heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate the q and k heads of a fused qkv output by RoPE, into new tensors.

    Math, per head ``x = [x1, x2]`` (halves of ``head_dim``) with ``c = cos[t]``,
    ``s = sin[t, :half]``: ``[x1 * c1 - x2 * s, x2 * c2 + x1 * s]``, every product and sum
    rounded to the dtype (rope.py's ``RotaryEmbedding.apply``, HF's ``rotate_half`` form).

    Args:
        qkv: ``[T, >= (num_heads + num_kv_heads) * head_dim]``, contiguous; q's heads first,
            then k's (v's columns are not read).
        cos, sin: ``[T, head_dim]`` tables of the same dtype (both halves equal).
        num_heads, num_kv_heads, head_dim: the layout (``head_dim`` even).

    Returns:
        ``q [T, num_heads, head_dim]`` and ``k [T, num_kv_heads, head_dim]``, new tensors.

    Raises:
        ValueError: a tensor the native path does not take, or shapes that do not match.
    """
    lib = _lib_for(qkv, cos, sin)
    rows = qkv.shape[0]
    if (qkv.dim() != 2 or head_dim % 2 or qkv.shape[1] < (num_heads + num_kv_heads) * head_dim
            or cos.shape != (rows, head_dim) or sin.shape != (rows, head_dim)):
        raise ValueError(f"rope_qk: qkv {tuple(qkv.shape)}, cos {tuple(cos.shape)}, sin "
                         f"{tuple(sin.shape)}, heads {num_heads}/{num_kv_heads} x {head_dim}")
    q = qkv.new_empty((rows, num_heads, head_dim))
    k = qkv.new_empty((rows, num_kv_heads, head_dim))
    lib.loraplex_rope_qk(_DTYPES[qkv.dtype], _ptr(qkv), qkv.shape[1], _ptr(cos), _ptr(sin),
                         _ptr(q), _ptr(k), rows, num_heads, num_kv_heads, head_dim,
                         _threads(rows * (num_heads + num_kv_heads) * head_dim))
    return q, k


def row_argmax(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Each row's maximum and the first index holding it: ``torch.max(x, dim=-1)``'s values
    and indices (a row with a NaN: maximum NaN, the index of its first NaN), about ten times
    faster on the CPU, where torch's op runs one element at a time. None where the native path
    does not take ``x``: not a ``[R, V]`` float32 CPU tensor with contiguous rows, ``V == 0``,
    or no library (the caller runs ``torch.max``)."""
    if (x.dim() != 2 or x.dtype != torch.float32 or not x.is_cpu or x.shape[1] == 0
            or (x.stride(1) != 1 and x.shape[1] > 1)):
        return None
    lib = _library()
    if lib is None:
        return None
    rows, n = x.shape
    maxes = torch.empty(rows, dtype=torch.float32)
    index = torch.empty(rows, dtype=torch.int64)
    lib.loraplex_row_argmax(_ptr(x), x.stride(0), rows, n, _ptr(maxes), _ptr(index),
                            _threads(x.numel()))
    return maxes, index


def write_kv(kv_pool: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor, page_size: int) -> bool:
    """``reference.write_kv`` (each token's K and V into its slot of the pool), one copy a row.
    Returns False where the native path does not take the tensors (off the CPU, dtypes that
    differ, a pool that is not contiguous or not ``[num_pages, 2 * P * row]``, K/V rows whose
    heads are not contiguous, slots not a contiguous int64 vector, no library): the caller then
    runs the reference.

    Raises:
        IndexError: a slot outside the pool (nothing written), as the reference's indexing.
    """
    if k.dim() != 3 or v.shape != k.shape or slot_mapping.shape != (k.shape[0],):
        return False
    tokens, heads, dim = k.shape
    row = heads * dim
    if (not (kv_pool.is_cpu and k.is_cpu and v.is_cpu and slot_mapping.is_cpu)
            or not (kv_pool.dtype == k.dtype == v.dtype) or slot_mapping.dtype != torch.int64
            or kv_pool.dim() != 2 or not kv_pool.is_contiguous()
            or kv_pool.shape[1] != 2 * page_size * row or not slot_mapping.is_contiguous()
            or any(t.stride(2) != 1 or t.stride(1) != dim for t in (k, v) if tokens and dim)):
        return False
    lib = _library()
    if lib is None:
        return False
    if tokens == 0:
        return True
    size = k.element_size()
    status = lib.loraplex_write_kv(_ptr(k), k.stride(0) * size, _ptr(v), v.stride(0) * size,
                                   _ptr(kv_pool), _ptr(slot_mapping), tokens, row * size,
                                   page_size, kv_pool.shape[0] * page_size,
                                   _threads(2 * tokens * row))
    if status != 0:
        raise IndexError(f"write_kv: a slot outside the pool's {kv_pool.shape[0] * page_size}")
    return True
