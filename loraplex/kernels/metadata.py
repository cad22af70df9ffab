"""Per-step batch metadata handed to the kernels, built once per step by the model runner and
shared by every layer (so no layer recomputes indices or masks)."""

from __future__ import annotations

from dataclasses import dataclass, field

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
        derived: per-step cache of what kernels compute from the fields above.
    """

    page_table: torch.Tensor
    query_start: torch.Tensor
    seq_lens: torch.Tensor
    slot_mapping: torch.Tensor
    q_lens: tuple[int, ...]
    seq_lens_host: tuple[int, ...]
    max_query_len: int
    max_seq_len: int
    # Index tensors a kernel derives from this metadata at its first layer and reuses in the
    # others, keyed by that kernel (a cache, not part of the metadata's value).
    derived: dict = field(default_factory=dict, repr=False, compare=False)

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
        max_pages = max(max(len(p) for p in page_tables), 1)
        for s, pages in enumerate(page_tables):
            if seq_lens[s] < q_lens[s] or -(-seq_lens[s] // page_size) > len(pages):
                raise ValueError(f"sequence {s}: {seq_lens[s]} tokens do not fit "
                                 f"{len(pages)} pages")
        # One host tensor per field and the slot mapping in a few vector ops, rather than a
        # Python loop over every token of the step (thousands in a prefill chunk).
        table = torch.tensor([p + [0] * (max_pages - len(p)) for p in page_tables],
                             dtype=torch.int64)  # [S, max_pages]
        q_lens_t = torch.tensor(q_lens, dtype=torch.int64)
        seq_lens_t = torch.tensor(seq_lens, dtype=torch.int64)
        query_start = torch.zeros(num_seqs + 1, dtype=torch.int64)
        torch.cumsum(q_lens_t, 0, out=query_start[1:])
        seq_of_token = torch.repeat_interleave(torch.arange(num_seqs), q_lens_t)  # [T]
        pos = (torch.arange(int(query_start[-1])) - query_start[seq_of_token]
               + (seq_lens_t - q_lens_t)[seq_of_token])  # [T]
        slots = table[seq_of_token, pos // page_size] * page_size + pos % page_size
        return cls(
            page_table=table.to(device=device, dtype=torch.int32),
            query_start=query_start.to(device=device, dtype=torch.int32),
            seq_lens=seq_lens_t.to(device=device, dtype=torch.int32),
            slot_mapping=slots.to(device),
            q_lens=tuple(q_lens),
            seq_lens_host=tuple(seq_lens),
            max_query_len=max(q_lens),
            max_seq_len=max(seq_lens),
        )
