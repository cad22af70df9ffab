"""Per-step batch metadata handed to the kernels, built once per step by the model runner and
shared by every layer (so no layer recomputes indices or masks)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionMetadata:
    """How the step's flattened tokens map onto sequences and KV pages.

    The tokens of sequence ``s`` are rows ``query_start[s]:query_start[s+1]`` of the step's
    ``[T, ...]`` tensors; they sit at positions ``seq_lens[s] - q_len[s] ... seq_lens[s] - 1``
    and attend causally to every earlier position of their sequence.

    Attributes:
        page_table: ``[S, max_pages]`` int32, page ids of each sequence (padding entries 0).
        query_start: ``[S+1]`` int32, cumulative query lengths (``query_start[0] == 0``).
        seq_lens: ``[S]`` int32, KV length of each sequence once this step's tokens are written.
        slot_mapping: ``[T]`` int64, ``page * page_size + offset`` where each token's K/V goes.
        q_lens / seq_lens_host: the same lengths as host lists (no device sync to read them).
        max_query_len / max_seq_len: maxima of those lists.
    """

    page_table: torch.Tensor
    query_start: torch.Tensor
    seq_lens: torch.Tensor
    slot_mapping: torch.Tensor
    q_lens: tuple[int, ...]
    seq_lens_host: tuple[int, ...]
    max_query_len: int
    max_seq_len: int

    @property
    def num_seqs(self) -> int:
        return len(self.q_lens)

    @property
    def is_pure_decode(self) -> bool:
        return self.max_query_len == 1

    @classmethod
    def build(cls, page_tables: list[list[int]], q_lens: list[int], seq_lens: list[int],
              page_size: int, device: torch.device | str = "cpu") -> AttentionMetadata:
        """Build from host lists: each sequence's pages, query length and final KV length."""
        num_seqs = len(q_lens)
        if not (len(page_tables) == len(seq_lens) == num_seqs) or num_seqs == 0:
            raise ValueError("page_tables, q_lens and seq_lens must be non-empty and equal length")
        max_pages = max(len(p) for p in page_tables)
        table = torch.zeros(num_seqs, max(max_pages, 1), dtype=torch.int32)
        slots: list[int] = []
        for s, pages in enumerate(page_tables):
            if pages:
                table[s, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
            start = seq_lens[s] - q_lens[s]
            if start < 0 or -(-seq_lens[s] // page_size) > len(pages):
                raise ValueError(f"sequence {s}: {seq_lens[s]} tokens do not fit "
                                 f"{len(pages)} pages")
            for pos in range(start, seq_lens[s]):
                slots.append(pages[pos // page_size] * page_size + pos % page_size)
        query_start = [0]
        for n in q_lens:
            query_start.append(query_start[-1] + n)
        return cls(
            page_table=table.to(device),
            query_start=torch.tensor(query_start, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            q_lens=tuple(q_lens),
            seq_lens_host=tuple(seq_lens),
            max_query_len=max(q_lens),
            max_seq_len=max(seq_lens),
        )
