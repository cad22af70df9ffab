"""The fused native elementwise ops (loraplex/kernels/cpu_elementwise.py) against the torch
sequences they replace in the forward pass, at SmolLM2's shapes (hidden 576, intermediate 1536, 9/3
heads x 64).

Each pair runs interleaved in this process (torch, native, torch, native, ...), timed by the
thread's CPU time (``time.thread_time``: torch on one thread; the machine is shared), and the
table reports the median microseconds per call of each and their ratio. Run it under the
shared benchmark lock on a shared machine:

    OMP_NUM_THREADS=1 flock /work/wt/bench.lock .venv/bin/python benchmarks/elementwise_bench.py
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from loraplex.kernels import cpu_elementwise
from loraplex.server.engine.models.llama import _rms_norm_torch
from loraplex.server.engine.models.rope import RotaryEmbedding


def _time(fn: Callable[[], object], calls: int) -> float:
    start = time.thread_time()
    for _ in range(calls):
        fn()
    return (time.thread_time() - start) / calls * 1e6


def _pairs(rows: int, dtype: torch.dtype, hidden: int, inter: int, heads: int, kv_heads: int,
           dim: int) -> dict[str, tuple[Callable[[], object], Callable[[], object]]]:
    hid, delta = torch.randn(rows, hidden).to(dtype), torch.randn(rows, hidden).to(dtype)
    weight = torch.randn(hidden).to(dtype)
    gate_up = torch.randn(rows, 2 * inter).to(dtype)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim).to(dtype)
    freqs = torch.arange(rows, dtype=torch.float32)[:, None] * torch.rand(dim // 2)[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    eps, q_size, kv_size = 1e-5, heads * dim, kv_heads * dim

    def add_norm_torch() -> object:
        hid.add_(delta)
        return _rms_norm_torch(hid, weight, eps)

    def silu_torch() -> object:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate, inplace=True) * up

    def rope_torch() -> object:
        q = qkv[:, :q_size].view(rows, heads, dim)
        k = qkv[:, q_size:q_size + kv_size].view(rows, kv_heads, dim)
        return RotaryEmbedding.apply(q, cos, sin), RotaryEmbedding.apply(k, cos, sin)

    return {
        "rms_norm": (lambda: _rms_norm_torch(hid, weight, eps),
                     lambda: cpu_elementwise.rms_norm(hid, weight, eps)),
        "add_rms_norm": (add_norm_torch,
                         lambda: cpu_elementwise.add_rms_norm(hid, delta, weight, eps)),
        "silu_and_mul": (silu_torch, lambda: cpu_elementwise.silu_and_mul(gate_up)),
        "rope q+k": (rope_torch,
                     lambda: cpu_elementwise.rope_qk(qkv, cos, sin, heads, kv_heads, dim)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1536, 32])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=15, help="interleaved rounds per pair")
    parser.add_argument("--budget-ms", type=float, default=20.0,
                        help="CPU ms per timed batch of calls (sets the calls per batch)")
    args = parser.parse_args()
    if not cpu_elementwise.available():
        raise SystemExit("the native library does not load (LORAPLEX_NATIVE_KERNELS=0 or no cc)")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), "
          f"{torch.backends.cpu.get_cpu_capability()}")
    print(f"{'op':<14} {'dtype':<9} {'rows':>5} {'torch us':>10} {'native us':>10} {'ratio':>7}")
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        for rows in args.rows:
            for name, (slow, fast) in _pairs(rows, dtype, 576, 1536, 9, 3, 64).items():
                calls = max(1, int(args.budget_ms * 1e3 / max(_time(slow, 3), 1.0)))
                a, b = [], []
                for _ in range(args.repeats):
                    a.append(_time(slow, calls))
                    b.append(_time(fast, calls))
                ta, tb = statistics.median(a), statistics.median(b)
                print(f"{name:<14} {dtype_name:<9} {rows:>5} {ta:>10.1f} {tb:>10.1f} "
                      f"{tb / ta:>6.2f}x")


if __name__ == "__main__":
    main()
