"""The UTF-8 filter of constrained outputs agrees with Python's strict decoder on every byte
string: a prefix it allows is a prefix of well-formed UTF-8, and nothing else."""

from __future__ import annotations

import random

import torch

from loraplex.server.engine.sampler import unpack_bitmask
from loraplex.server.engine.utf8_filter import INVALID, START, Utf8Filter, pack_bitmask, run

# Every proper prefix of a code point's encoding (surrogates are not code points of UTF-8).
PARTIAL = {chr(cp).encode()[:i] for cp in range(0x80, 0x110000) if not 0xD800 <= cp <= 0xDFFF
           for i in range(1, len(chr(cp).encode()))}


def python_allows(data: bytes) -> bool:
    """Whether ``data`` is a prefix of well-formed UTF-8: whole characters (Python's strict
    decoder) followed by at most the start of one more."""
    for cut in range(min(3, len(data)) + 1):
        head, tail = data[:len(data) - cut], data[len(data) - cut:]
        try:
            head.decode("utf-8")
        except UnicodeDecodeError:
            continue
        if not tail or tail in PARTIAL:
            return True
    return False


def test_the_decoder_agrees_with_python() -> None:
    rng = random.Random(0)
    cases = [b"\xe0\x8b\x8b", b"\xed\xa0\x80", b"\xc0\x80", b"\xf4\x90\x80\x80", b"\xf5",
             b"\xe0\xa0\x80", b"\xed\x9f\xbf", b"\xf0\x90\x80\x80", b"\xe2\x82", b"\x93"]
    cases += [bytes(rng.randrange(256) for _ in range(rng.randint(1, 6)))
              for _ in range(20000)]
    cases += [rng.choice(["é", "€", "𝄞", "a", "中"]).encode()[:rng.randint(1, 4)]
              for _ in range(2000)]
    for data in cases:
        assert (run(START, data) != INVALID) == python_allows(data), data


def test_masks_follow_the_state() -> None:
    vocab = [bytes([b]) for b in range(256)] + [b"\x8b\x8b", b"\xa0\x80a", b"", b"<eos>",
                                                b"<s>"]
    utf8 = Utf8Filter(vocab, stop_ids=[259], special_ids=[259, 260])
    allowed = unpack_bitmask(utf8.masks, len(vocab))  # [states, V]
    state = utf8.advance(START, 0xE0)  # after E0 only A0..BF may follow
    ok = set(torch.nonzero(allowed[state]).flatten().tolist())
    assert ok == set(range(0xA0, 0xC0)) | {257, 259}
    assert not allowed[START, 256] and allowed[state, 257]
    assert not allowed[:, 260].any() and not allowed[:, 258].any()  # special, empty: never
    assert utf8.advance(utf8.advance(state, 0xA0), 0x80) == START
    assert utf8.advance(state, 259) == state  # special tokens leave the decoder alone


def test_pack_bitmask_is_the_samplers_layout() -> None:
    allowed = torch.rand(5, 133, generator=torch.Generator().manual_seed(1)) > 0.5
    assert torch.equal(unpack_bitmask(pack_bitmask(allowed), 133), allowed)
