"""The finite set of compiled kernel variants one worker can launch, enumerated from its config.

A variant is what Triton compiles one binary for: the kernel, its ``tl.constexpr`` arguments
(``num_warps`` included) and the specialisation of its other arguments that follow the model
(``% 16`` of a size or stride, 16-byte alignment of a pointer). Batch-dependent arguments are
never specialised (see ``buckets.py``), so they do not appear here.

``serving_variants`` is the set; the engine's warm-up launches one member of each
(``server/engine/warmup.py``), and tests check that every batch a worker can schedule maps into
it (``tests/kernels/test_buckets.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from loraplex.kernels.attention_plan import (
    AttentionPlan,
    attention_constexprs,
    attention_plans,
    write_kv_constexprs,
)
from loraplex.kernels.sgmv_plan import (
    SgmvPlan,
    expand_constexprs,
    expand_plans,
    row_align,
    shrink_constexprs,
    shrink_plans,
)

__all__ = ["AttentionVariant", "LoraVariant", "ModuleGeometry", "Variant", "attention_variants",
           "lora_variants", "serving_variants", "variant"]


class Variant(NamedTuple):
    """One compiled binary: kernel name, compile-time arguments, argument specialisation."""

    kernel: str
    constexprs: tuple[tuple[str, Any], ...]
    specialization: tuple[bool, ...] = ()


def variant(kernel: str, constexprs: Mapping[str, Any],
            specialization: tuple[bool, ...] = ()) -> Variant:
    return Variant(kernel, tuple(sorted(constexprs.items())), specialization)


@dataclass(frozen=True)
class ModuleGeometry:
    """Where one LoRA module's input and output rows sit in the model's tensors.

    ``x`` is a contiguous ``[T, d_in]`` tensor; ``y`` is columns ``y_start .. y_start + d_out``
    of a contiguous ``[T, y_stride]`` tensor (the fused projection's output).
    """

    d_in: int
    d_out: int
    y_stride: int
    y_start: int


@dataclass(frozen=True)
class LoraVariant:
    """A LoRA launch that compiles ``key``: ``op`` (shrink or expand) of ``module``."""

    op: str
    module: str
    plan: SgmvPlan
    key: Variant


@dataclass(frozen=True)
class AttentionVariant:
    """An attention launch that compiles ``key``: ``kind`` (decode, merge, prefill)."""

    kind: str
    plan: AttentionPlan
    key: Variant


def shrink_specialization(geometry: ModuleGeometry) -> tuple[bool, ...]:
    """What Triton specialises of a shrink launch's model-dependent arguments: ``d_in`` and
    ``x``'s row stride (both ``d_in``: x is contiguous)."""
    return (geometry.d_in % 16 == 0,)


def expand_specialization(geometry: ModuleGeometry, element_size: int) -> tuple[bool, ...]:
    """``d_out``, ``y``'s row stride and ``y``'s start alignment (16 bytes) of an expand."""
    return (geometry.d_out % 16 == 0, geometry.y_stride % 16 == 0,
            geometry.y_start * element_size % 16 == 0)


def lora_variants(modules: Mapping[str, ModuleGeometry], page_elems: int, max_rank: int,
                  dtype: torch.dtype, pool_start: int = 0) -> list[LoraVariant]:
    """Every LoRA variant of a worker serving ranks ``1 .. max_rank`` on these modules, one
    launch per distinct binary (the first module that reaches it).

    Args:
        modules: module name -> its geometry (``LORA_MODULES`` the model has).
        page_elems: elements of a page (also the pool's page stride).
        max_rank: the largest rank served.
        dtype: the pool's dtype.
        pool_start: the pool's first element's address, in elements (only its residue modulo
            ``layout.ALIGN`` matters; 0 for a fresh allocation).
    """
    element_size = torch.empty(0, dtype=dtype).element_size()
    seen: dict[Variant, LoraVariant] = {}
    for module, geo in modules.items():
        for plan in shrink_plans(geo.d_in, page_elems, max_rank):
            name, meta = shrink_constexprs(plan, dtype, row_align(geo.d_in, page_elems,
                                                                  page_elems, pool_start))
            key = variant(name, meta, shrink_specialization(geo))
            seen.setdefault(key, LoraVariant("shrink", module, plan, key))
        for plan in expand_plans(geo.d_out, page_elems, max_rank):
            name, meta = expand_constexprs(plan, dtype, row_align(geo.d_out, page_elems,
                                                                  page_elems, pool_start))
            key = variant(name, meta, expand_specialization(geo, element_size))
            seen.setdefault(key, LoraVariant("expand", module, plan, key))
    return list(seen.values())


def attention_variants(num_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
                       dtype: torch.dtype, max_model_len: int) -> list[AttentionVariant]:
    """Every attention variant (decode with and without key splits, merge, prefill)."""
    seen: dict[Variant, AttentionVariant] = {}
    for plan in attention_plans(head_dim, dtype, max_model_len):
        kinds = attention_constexprs(plan, num_heads, num_kv_heads, head_dim, page_size, dtype)
        for kind, (name, meta) in kinds.items():
            if kind == "merge" and plan.num_splits == 1:
                continue
            key = variant(name, meta)
            seen.setdefault(key, AttentionVariant(kind, plan, key))
    return list(seen.values())


def serving_variants(modules: Mapping[str, ModuleGeometry] | None, num_heads: int,
                     num_kv_heads: int, head_dim: int, page_size: int, dtype: torch.dtype,
                     max_model_len: int, max_rank: int, pool_start: int = 0
                     ) -> frozenset[Variant]:
    """The whole set for one worker: attention, ``write_kv`` and, with ``modules`` (adapters
    served), LoRA up to ``max_rank``."""
    page_elems = 2 * page_size * num_kv_heads * head_dim
    keys = {v.key for v in attention_variants(num_heads, num_kv_heads, head_dim, page_size,
                                              dtype, max_model_len)}
    keys.add(variant("_write_kv_kernel", write_kv_constexprs(num_kv_heads, head_dim, page_size)))
    if modules is not None:
        keys.update(v.key for v in lora_variants(modules, page_elems, max_rank, dtype,
                                                 pool_start))
    return frozenset(keys)
