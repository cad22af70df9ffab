"""One step as the driver rank sends it to the others: a flat int64 tensor, never a pickle.

Everything in it is built by the engine (token ids it validated, positions, page ids, adapter
ranks and scales); nothing a client sent travels as anything but these integers.

Layout (each list prefixed by its length)::

    input_ids, positions, q_lens, seq_lens,
    num_requests x page table,
    num_segments x (first row, end row, rank, module bits, scale as float64 bits, pages),
    num_fills x (elements per layer, pages)

A fill names pages that receive an adapter shard: the driver scatters the shards right after
the message, in the order of the fills.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

import torch

from loraplex.server.engine.model_runner import StepTokens
from loraplex.server.engine.models.config import LORA_MODULES


class SegmentSpec(NamedTuple):
    """An adapter segment of the batch: rows ``[lo, hi)`` run adapter (rank, modules, scale)
    whose shard sits in ``pages`` of every rank's pool."""

    lo: int
    hi: int
    rank: int
    modules: tuple[str, ...]
    scale: float
    pages: tuple[int, ...]


class FillSpec(NamedTuple):
    """Pages that receive an adapter shard of ``num_elems`` elements per layer."""

    num_elems: int
    pages: tuple[int, ...]


class StepMessage(NamedTuple):
    tokens: StepTokens
    segments: list[SegmentSpec]
    fills: list[FillSpec]


def _module_bits(modules: tuple[str, ...]) -> int:
    return sum(1 << LORA_MODULES.index(m) for m in modules)


def _bits_modules(bits: int) -> tuple[str, ...]:
    return tuple(m for i, m in enumerate(LORA_MODULES) if bits >> i & 1)


def _float_bits(x: float) -> int:
    return int(struct.unpack("<q", struct.pack("<d", x))[0])


def _bits_float(n: int) -> float:
    return float(struct.unpack("<d", struct.pack("<q", n))[0])


def encode(msg: StepMessage) -> torch.Tensor:
    """``StepMessage`` -> int64 tensor ``[n]``."""
    out: list[int] = []

    def put(values: list[int] | tuple[int, ...]) -> None:
        out.append(len(values))
        out.extend(values)

    t = msg.tokens
    for values in (t.input_ids, t.positions, t.q_lens, t.seq_lens):
        put(values)
    out.append(len(t.page_tables))
    for table in t.page_tables:
        put(table)
    out.append(len(msg.segments))
    for s in msg.segments:
        out.extend((s.lo, s.hi, s.rank, _module_bits(s.modules), _float_bits(s.scale)))
        put(s.pages)
    out.append(len(msg.fills))
    for f in msg.fills:
        out.append(f.num_elems)
        put(f.pages)
    return torch.tensor(out, dtype=torch.int64)


def decode(data: torch.Tensor) -> StepMessage:
    """The inverse of ``encode``; raises ``ValueError`` on a malformed message."""
    values = data.tolist()
    pos = 0

    def take(n: int) -> list[int]:
        nonlocal pos
        if n < 0 or pos + n > len(values):
            raise ValueError("step message: truncated")
        chunk = values[pos:pos + n]
        pos += n
        return chunk

    def one() -> int:
        return take(1)[0]

    def seq() -> list[int]:
        return take(one())

    input_ids, positions, q_lens, seq_lens = seq(), seq(), seq(), seq()
    tables = [seq() for _ in range(one())]
    segments = []
    for _ in range(one()):
        lo, hi, rank, bits, scale = take(5)
        segments.append(SegmentSpec(lo, hi, rank, _bits_modules(bits), _bits_float(scale),
                                    tuple(seq())))
    fills = []
    for _ in range(one()):
        num_elems = one()
        fills.append(FillSpec(num_elems, tuple(seq())))
    if pos != len(values):
        raise ValueError("step message: trailing data")
    return StepMessage(StepTokens(input_ids, positions, tables, q_lens, seq_lens), segments,
                       fills)
