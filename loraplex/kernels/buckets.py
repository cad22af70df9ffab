"""The buckets that every batch-dependent compile-time constant of the Triton kernels comes from.

Triton compiles one binary per distinct set of ``tl.constexpr`` values (and per specialisation
of the other integer arguments: ``== 1`` and ``% 16 == 0``). A constant that followed the batch
exactly (the batch's largest rank, its number of segments, a split count) would compile new
binaries in the middle of serving, each taking a second or more of a step. So:

* constants that depend only on the model and the config (head sizes, page size, dtype, the
  weights' row alignment) stay as they are: one value per worker;
* constants that depend on the batch come from the small fixed sets below, as pure functions
  of the batch's sizes;
* batch-dependent sizes that are plain arguments (segment and rank counts, page-table width,
  split counts) are declared ``do_not_specialize`` on the kernels, so their value never picks
  a binary.

``loraplex/kernels/variants.py`` enumerates the product for one worker's config, and the engine's
warm-up compiles every member of it before the worker reports ready.

Every compile-time argument and where its value comes from (B: batch, from a bucket here;
C: model and config only):

=====================  ==================================================================
shrink / expand        ``BLOCK_R`` B ``rank_block(max rank of the batch)``;
(bgmv, sgmv)           ``BLOCK_M`` and the path B ``tile_shape(T, S)``;
                       ``BLOCK_K`` / ``BLOCK_N`` B ``column_block`` of a fixed ladder of
                       wants (``sgmv_plan``); ``SPLIT`` B ``split_k > 1`` (the count runs);
                       ``num_warps`` B, a function of the three tiles; ``BLOCK_S`` fixed
                       ``SEGMENT_BLOCK``; ``ROW_ALIGN`` C (``d``, page size, pool start);
                       ``DOT_PRECISION`` C (dtype)
decode attention       ``SPLIT`` B ``num_splits > 1`` (the count runs); ``GROUP``,
                       ``HEAD_DIM``, ``NUM_KV_HEADS``, ``PAGE_SIZE``, ``BLOCK_G``,
                       ``BLOCK_D``, ``BLOCK_N``, ``DOT_PRECISION``, ``num_warps`` C
merge of splits        ``HEAD_DIM``, ``BLOCK_D`` C; ``BLOCK_SPLITS`` fixed (the split cap)
prefill attention      ``BLOCK_M`` and the decode kernel's C arguments, all C
write_kv               ``HEAD_DIM``, ``NUM_KV_HEADS``, ``PAGE_SIZE``, ``BLOCK_H``,
                       ``BLOCK_D``, ``num_warps`` C
=====================  ==================================================================
"""

from __future__ import annotations

__all__ = ["MAX_ATTENTION_SPLITS", "MAX_SPLIT_K", "RANK_BLOCKS", "SEGMENT_BLOCK", "TILE_SHAPES",
           "column_block", "floor_pow2", "next_pow2", "rank_block", "rank_blocks", "tile_shape"]

# Rank tile of the LoRA kernels (register tile; >= 16 for tl.dot on the GPU, <= 64 so that
# larger ranks loop over tiles rather than grow registers): one per power of two of max rank.
RANK_BLOCKS = (16, 32, 64)
# (path, block_m) of a LoRA launch: bgmv (one program per token) or sgmv tiles of block_m rows.
TILE_SHAPES = (("bgmv", 1), ("sgmv", 16), ("sgmv", 32), ("sgmv", 64))
# Segment ends a LoRA program scans per step to find its segment. One value for every batch:
# lanes past the batch's segment count are masked (they load nothing), and batches with more
# segments take more steps of the same loop.
SEGMENT_BLOCK = 128
# Caps of the split counts; the counts themselves are runtime arguments.
MAX_SPLIT_K = 64
MAX_ATTENTION_SPLITS = 32


def next_pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for ``n <= 1``)."""
    return 1 << max(n - 1, 0).bit_length()


def floor_pow2(n: int) -> int:
    """The largest power of two <= ``n`` (1 for ``n <= 1``)."""
    return 1 << (max(n, 1).bit_length() - 1)


def rank_block(max_rank: int) -> int:
    """The rank tile for a batch whose largest rank is ``max_rank``: a member of RANK_BLOCKS."""
    return min(max(RANK_BLOCKS[0], next_pow2(max_rank)), RANK_BLOCKS[-1])


def rank_blocks(max_rank: int) -> tuple[int, ...]:
    """Every rank tile a worker serving ranks ``1 .. max_rank`` can pick."""
    return tuple(b for b in RANK_BLOCKS if b <= rank_block(max_rank))


def tile_shape(num_tokens: int, num_segments: int) -> tuple[str, int]:
    """(path, block_m) for this many tokens per segment on average: a member of TILE_SHAPES."""
    per_segment = num_tokens / max(num_segments, 1)
    if per_segment < 4:  # mostly single-token segments: a 16-row dot tile would be mostly empty
        return TILE_SHAPES[0]
    return TILE_SHAPES[1] if per_segment < 32 else TILE_SHAPES[2] if per_segment < 64 \
        else TILE_SHAPES[3]


def column_block(want: int, d: int, page_elems: int) -> int:
    """Columns per step of a LoRA launch: a power of two in ``[16, page_elems]`` (so a step
    spans at most two pages), at most ``want`` and no wider than ``d`` needs. ``want`` is a
    power of two from a fixed ladder (see ``sgmv_plan``), so the result depends on the batch
    only through that ladder."""
    return max(16, min(want, next_pow2(d), floor_pow2(page_elems)))
