"""Compile, for sm_90 (H100/H200) and without a GPU, the launches the launchers would make on
an H200 at serving sizes; print one JSON line per distinct launch (registers, spills, shared
memory, how the 16-bit global loads were vectorized).

The interpreter accepts kernels that the GPU compiler rejects (``tl.dot`` tiles under 16, for
one), so this is what tells on CPU that the kernels build for the GPU. Run as a module in a
process of its own (``python -m tests.kernels.sm90_compile``): kernels must be decorated
without ``TRITON_INTERPRET``. The launchers run for real up to the launch, which is captured.
With ``--variants``: every kernel variant a 7B Llama worker's warm-up compiles, instead.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from typing import Any

if any(m.startswith("loraplex.kernels.") and m.endswith(("sgmv", "paged_attention"))
       for m in sys.modules):
    raise RuntimeError("run sm90_compile in a fresh process")
os.environ.pop("TRITON_INTERPRET", None)
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import torch  # noqa: E402
import triton  # noqa: E402
from triton._C.libtriton import native_specialize_impl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.nvidia.compiler import CUDABackend  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from loraplex.kernels import paged_attention as pa  # noqa: E402
from loraplex.kernels import sgmv, sgmv_plan  # noqa: E402
from loraplex.kernels.metadata import AttentionMetadata  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
H200_SMS = 132
PAGE_ELEMS = 2 * 16 * 8 * 128  # a KV page of 16 tokens, 8 KV heads of 128
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                         "cuobjdump")


def _capture(fn: Any, *args: Any, **kwargs: Any) -> list[tuple[Any, tuple, dict]]:
    """Run a launcher on CPU tensors; return the (kernel, args, constexprs) it launches."""
    launched: list[tuple[Any, tuple, dict]] = []

    def fake_run(self: JITFunction, *a: Any, grid: Any, warmup: bool, **kw: Any) -> None:
        launched.append((self, a, kw))

    run, JITFunction.run = JITFunction.run, fake_run
    checks = sgmv.check_kernel_device, pa.check_kernel_device
    sgmv.check_kernel_device = pa.check_kernel_device = lambda t: None
    try:
        fn(*args, **kwargs)
    finally:
        JITFunction.run = run
        sgmv.check_kernel_device, pa.check_kernel_device = checks
    return launched


def compile_launch(kernel: Any, args: tuple, constexprs: dict) -> dict[str, Any]:
    """Compile one captured launch for sm_90, specialised as a real launch would be."""
    constexprs = dict(constexprs)
    options = {"num_warps": constexprs.pop("num_warps", 4)}
    signature: dict[str, str] = {}
    consts: dict[str, Any] = {}
    attrs: dict[tuple[int, ...], Any] = {}
    skip = {kernel.arg_names[n] if isinstance(n, int) else n for n in kernel.do_not_specialize}
    for i, name in enumerate(kernel.arg_names):
        if name in constexprs:
            signature[name], consts[name] = "constexpr", constexprs[name]
            continue
        ty, key = native_specialize_impl(CUDABackend, args[i], False, name not in skip, True)
        if ty == "constexpr":  # ints equal to 1 become constants, as at a real launch
            signature[name], consts[name] = "constexpr", key
        else:
            signature[name] = ty
            if key:
                attrs[(i,)] = CUDABackend.parse_attr(key)
    compiled = triton.compile(ASTSource(kernel, signature, constexprs=consts, attrs=attrs),
                              target=TARGET, options=options)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([CUOBJDUMP, "-res-usage", f.name], capture_output=True,
                               text=True, check=True).stdout
    regs, stack = re.search(r"REG:(\d+) STACK:(\d+)", usage).groups()
    ptx = compiled.asm["ptx"]
    return {
        "kernel": kernel.__name__,
        "constexprs": {k: v for k, v in sorted(constexprs.items())},
        "num_warps": options["num_warps"],
        "registers": int(regs),
        "spill_bytes": int(stack),
        "shared_bytes": compiled.metadata.shared,
        # 2-byte global loads (plain or async copies) mean an unvectorized 16-bit gather
        "scalar_16bit_loads": len(re.findall(r"ld\.global(?:\.[a-z]+)*\.b16\b", ptx))
        + len(re.findall(r"cp\.async\.c[ag]\.shared\.global[^;]*, 0x2,", ptx)),
        "vector_loads": len(re.findall(r"ld\.global(?:\.[a-z]+)*\.v4\.b32", ptx))
        + len(re.findall(r"cp\.async\.c[ag]\.shared\.global[^;]*, 0x10,", ptx)),
    }


def _lora_launches(tokens: int, segments: int, d_in: int, d_out: int, rank: int,
                   dtype: torch.dtype) -> list[tuple[Any, tuple, dict]]:
    num_pages = 8
    pool = torch.empty(num_pages, PAGE_ELEMS, dtype=dtype)
    table = torch.zeros(segments, num_pages, dtype=torch.int32)
    indptr = torch.zeros(segments + 1, dtype=torch.int32)
    ranks = torch.zeros(segments, dtype=torch.int32)
    offsets = torch.zeros(segments, dtype=torch.int64)
    x = torch.empty(tokens, d_in, dtype=dtype)
    seg = (pool, table, indptr, ranks, offsets)
    shrink = sgmv_plan.plan_shrink(tokens, segments, d_in, rank, PAGE_ELEMS, H200_SMS)
    expand = sgmv_plan.plan_expand(tokens, segments, d_out, rank, PAGE_ELEMS, H200_SMS)
    h = torch.empty(tokens, rank, dtype=torch.float32)
    y = torch.empty(tokens, d_out, dtype=dtype)
    scales = torch.ones(segments, dtype=torch.float32)
    return (_capture(sgmv.sgmv_shrink, x, *seg, rank, plan=shrink)
            + _capture(sgmv.sgmv_expand, h, *seg, scales, y, plan=expand))


def _attention_launches(q_lens: list[int], seq_lens: list[int], head_dim: int,
                        dtype: torch.dtype) -> list[tuple[Any, tuple, dict]]:
    num_heads, num_kv_heads, page_size = 32, 8, 16
    num_seqs = len(q_lens)
    meta = AttentionMetadata(
        page_table=torch.zeros(num_seqs, 4, dtype=torch.int32),
        query_start=torch.zeros(num_seqs + 1, dtype=torch.int32),
        seq_lens=torch.zeros(num_seqs, dtype=torch.int32),
        slot_mapping=torch.zeros(sum(q_lens), dtype=torch.int64),
        q_lens=tuple(q_lens), seq_lens_host=tuple(seq_lens),
        max_query_len=max(q_lens), max_seq_len=max(seq_lens))
    pool = torch.empty(4, 2 * page_size * num_kv_heads * head_dim, dtype=dtype)
    q = torch.empty(sum(q_lens), num_heads, head_dim, dtype=dtype)
    k = torch.empty(sum(q_lens), num_kv_heads, head_dim, dtype=dtype)
    plan = pa.plan_attention(num_seqs, num_kv_heads, head_dim, meta.max_seq_len, dtype,
                             H200_SMS)
    return (_capture(pa.paged_attention, q, pool, meta, page_size, num_kv_heads,
                     head_dim ** -0.5, plan=plan)
            + _capture(pa.write_kv, pool, k, k, meta.slot_mapping, page_size))


def h200_launches() -> list[tuple[str, tuple[Any, tuple, dict]]]:
    """(case, launch) for serving sizes of a 7B Llama (d = 4096 / 11008, heads of 128)."""
    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
    cases = {
        "lora decode, 256 adapters, r64": _lora_launches(256, 256, 4096, 4096, 64, bf16),
        "lora decode, 1 token, r16": _lora_launches(1, 1, 4096, 11008, 16, bf16),
        "lora decode, 16 adapters, r8": _lora_launches(256, 16, 11008, 4096, 8, fp16),
        "lora prefill, 4 adapters, r64": _lora_launches(4096, 4, 4096, 11008, 64, bf16),
        "lora prefill fp32, r16": _lora_launches(512, 4, 4096, 4096, 16, fp32),
        "lora odd dims (no vector hint)": _lora_launches(64, 8, 1003, 997, 16, fp16),
        "attention decode, 64 seqs": _attention_launches([1] * 64, [2048] * 64, 128, bf16),
        "attention decode, split keys": _attention_launches([1], [32768], 128, bf16),
        "attention mixed": _attention_launches([1, 1, 512], [900, 40, 1500], 128, bf16),
        "attention mixed fp32": _attention_launches([1, 300], [100, 600], 128, fp32),
        "attention mixed, heads of 256": _attention_launches([1, 64], [500, 64], 256, bf16),
    }
    return [(case, launch) for case, launches in cases.items() for launch in launches]


def variant_launches(dtype: torch.dtype = torch.bfloat16, max_rank: int = 64
                     ) -> list[tuple[str, tuple[Any, tuple, dict]]]:
    """(case, launch) for every kernel variant a 7B Llama worker warms up
    (``loraplex/kernels/variants.py``), laid out as warm-up launches them."""
    from loraplex.kernels.variants import attention_variants, lora_variants
    from loraplex.server.engine.models.config import ModelConfig
    from loraplex.server.engine.warmup import module_geometry

    config = ModelConfig.from_hf_dict(dict(
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=32000,
        hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, max_position_embeddings=4096))
    page_size, head_dim = 16, config.head_dim
    page_elems = 2 * page_size * config.num_kv_heads * head_dim
    pool = torch.empty(8, page_elems, dtype=dtype)
    table, indptr = torch.zeros(1, 8, dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32)
    ranks, offsets = torch.tensor([16], dtype=torch.int32), torch.zeros(1, dtype=torch.int64)
    out: list[tuple[str, tuple[Any, tuple, dict]]] = []
    geometry = module_geometry(config)
    for v in lora_variants(geometry, page_elems, max_rank, dtype):
        geo = geometry[v.module]
        if v.op == "shrink":
            x = torch.empty(1, geo.d_in, dtype=dtype)
            launches = _capture(sgmv.sgmv_shrink, x, pool, table, indptr, ranks, offsets, 16,
                                plan=v.plan)
        else:
            h = torch.empty(1, 16, dtype=torch.float32)
            y = torch.empty(1, geo.y_stride, dtype=dtype)[:, geo.y_start:geo.y_start + geo.d_out]
            launches = _capture(sgmv.sgmv_expand, h, pool, table, indptr, ranks, offsets,
                                torch.ones(1), y, plan=v.plan)
        out += [(f"{v.op} {v.module} {v.plan}", launch) for launch in launches]
    for a in attention_variants(config.num_heads, config.num_kv_heads, head_dim, page_size,
                                dtype, 4096):
        for q_lens in ([1, 1], [1, 64]):
            out += [(f"attention {a.kind} {a.plan}", launch) for launch in _capture(
                pa.paged_attention, torch.empty(sum(q_lens), config.num_heads, head_dim,
                                                dtype=dtype),
                torch.empty(4, page_elems, dtype=dtype), _meta(q_lens, [100, 100]), page_size,
                config.num_kv_heads, head_dim ** -0.5, plan=a.plan)]
    return out


def _meta(q_lens: list[int], seq_lens: list[int]) -> AttentionMetadata:
    num_seqs = len(q_lens)
    return AttentionMetadata(
        page_table=torch.zeros(num_seqs, 8, dtype=torch.int32),
        query_start=torch.zeros(num_seqs + 1, dtype=torch.int32),
        seq_lens=torch.zeros(num_seqs, dtype=torch.int32),
        slot_mapping=torch.zeros(sum(q_lens), dtype=torch.int64),
        q_lens=tuple(q_lens), seq_lens_host=tuple(seq_lens),
        max_query_len=max(q_lens), max_seq_len=max(seq_lens))


def main() -> None:
    seen: set[str] = set()
    launches = variant_launches() if "--variants" in sys.argv else h200_launches()
    for case, (kernel, args, constexprs) in launches:
        data = next(n for n in ("pool_ptr", "out_ptr") if n in kernel.arg_names)
        dtype = str(args[kernel.arg_names.index(data)].dtype)
        key = f"{kernel.__name__}{sorted(constexprs.items())}{dtype}"
        if key in seen:
            continue
        seen.add(key)
        result = compile_launch(kernel, args, constexprs)
        print(json.dumps(dict(case=case, dtype=dtype, **result)), flush=True)


if __name__ == "__main__":
    main()
