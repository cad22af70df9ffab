"""The packed allowed-token bitmask: applied without unpacking, and read for one token."""

from __future__ import annotations

import torch

from loraplex.server.engine.sampler import apply_bitmask, unpack_bitmask
from loraplex.server.engine.structured import single_token
from loraplex.server.engine.utf8_filter import pack_bitmask as _packed


def test_apply_bitmask_equals_unpacked_mask_and_keeps_raw() -> None:
    gen = torch.Generator().manual_seed(0)
    vocab = 49152 + 7  # a last word only partly used
    allowed = torch.rand(5, vocab, generator=gen) < 0.3
    allowed[1] = False  # a row that allows nothing
    allowed[2, 123] = True
    raw = torch.randn(5, vocab, generator=gen)
    raw[3, ~allowed[3]] = float("nan")  # masked NaN is hidden, as masked_fill hides it
    before = raw.clone()
    expected = raw.masked_fill(~unpack_bitmask(_packed(allowed), vocab), float("-inf"))
    got = apply_bitmask(raw, raw, _packed(allowed))
    assert torch.equal(got, expected)
    # logprobs read the raw logits afterwards (NaN compares equal to NaN here)
    torch.testing.assert_close(raw, before, rtol=0, atol=0, equal_nan=True)


def test_single_token_matches_the_unpacked_row() -> None:
    vocab = 100  # four words, the last one only 4 tokens wide
    for tokens in ([], [0], [31], [32], [99], [5, 70], [99, 100], [100], [100, 127, 3]):
        allowed = torch.zeros(1, 128, dtype=torch.bool)
        allowed[0, tokens] = True
        row = _packed(allowed)[0]
        unpacked = torch.nonzero(unpack_bitmask(row[None], vocab)[0]).flatten()
        expected = int(unpacked[0]) if unpacked.numel() == 1 else None
        assert single_token(row, vocab) == expected, tokens
