"""Well-formed UTF-8 for constrained outputs: per-token masks by the state of a UTF-8 decoder.

xgrammar 0.2.8 matches a character class one byte token at a time and admits byte sequences
that are not UTF-8 (overlong forms such as ``E0 8B 8B``, encoded surrogates ``ED A0 80``):
they decode to U+FFFD, so a string bounded by ``maxLength`` could come out longer than its
bound, and the text no longer says what the tokens say. With byte tokens in the vocabulary
(byte-level BPE has all 256), any model can sample them. The filter ANDs each constrained
row's bitmask with the tokens whose bytes keep the output well-formed from where its decoder
stands, and tracks that state as tokens are accepted.

The same masks keep special tokens out of constrained text: xgrammar reads an added special
token such as ``<s>`` as its three characters, which the detokenizer then drops. Only the stop
tokens (which a complete grammar allows) pass.

The decoder has eight states (RFC 3629's table): 0 between characters, and seven inside one,
which differ in how many continuation bytes are still due and the range of the next one.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

START = 0
INVALID = -1
# Inside a character: (next byte's low, high, state after it).
_INSIDE = {
    1: (0x80, 0xBF, START),  # one continuation byte due
    2: (0x80, 0xBF, 1),  # two due
    3: (0xA0, 0xBF, 1),  # after E0 (no overlong three-byte forms)
    4: (0x80, 0x9F, 1),  # after ED (no surrogates)
    5: (0x80, 0xBF, 2),  # three due
    6: (0x90, 0xBF, 2),  # after F0 (no overlong four-byte forms)
    7: (0x80, 0x8F, 2),  # after F4 (nothing past U+10FFFF)
}
NUM_STATES = 1 + len(_INSIDE)


def step(state: int, byte: int) -> int:
    """The decoder's state after ``byte`` (``INVALID``: not UTF-8)."""
    if state != START:
        low, high, after = _INSIDE[state]
        return after if low <= byte <= high else INVALID
    if byte < 0x80:
        return START
    if 0xC2 <= byte <= 0xDF:
        return 1
    if byte == 0xE0:
        return 3
    if byte == 0xED:
        return 4
    if 0xE1 <= byte <= 0xEF:
        return 2
    if byte == 0xF0:
        return 6
    if byte == 0xF4:
        return 7
    if 0xF1 <= byte <= 0xF3:
        return 5
    return INVALID


def run(state: int, data: bytes) -> int:
    for byte in data:
        state = step(state, byte)
        if state == INVALID:
            return INVALID
    return state


class Utf8Filter:
    """Masks and state transitions of a vocabulary.

    Args:
        token_bytes: ``[V]`` each token's bytes (xgrammar's ``decoded_vocab``, padded to the
            model's vocabulary with ``b""``).
        stop_ids: tokens that end generation; they leave the state alone and are allowed in
            every state (the grammar decides when).
        special_ids: tokens that are not text (``<s>``, turn markers, padding): never allowed.
    """

    def __init__(self, token_bytes: Sequence[bytes], stop_ids: Sequence[int],
                 special_ids: Sequence[int]) -> None:
        self.token_bytes = list(token_bytes)
        self.stop = frozenset(stop_ids)
        self.special = frozenset(special_ids) - self.stop
        vocab = len(self.token_bytes)
        allowed = torch.zeros(NUM_STATES, vocab, dtype=torch.bool)  # [states, V]
        for token, data in enumerate(self.token_bytes):
            if token in self.stop:
                allowed[:, token] = True
                continue
            if token in self.special or not data:
                continue
            allowed[START, token] = run(START, data) != INVALID
            if 0x80 <= data[0] <= 0xBF:  # only a continuation byte can go on a character
                for state in _INSIDE:
                    allowed[state, token] = run(state, data) != INVALID
        self.masks = pack_bitmask(allowed)  # [states, ceil(V / 32)] int32

    def advance(self, state: int, token: int) -> int:
        """The state after ``token`` (a token the mask allowed keeps it valid; anything else
        returns to ``START`` rather than poisoning the rest of the output)."""
        if token in self.stop or token in self.special or not 0 <= token < len(
                self.token_bytes):
            return state
        after = run(state, self.token_bytes[token])
        return START if after == INVALID else after


def pack_bitmask(allowed: torch.Tensor) -> torch.Tensor:
    """``[R, V]`` bool -> ``[R, ceil(V / 32)]`` int32, bit ``j`` of word ``w`` for token
    ``32 * w + j`` (the sampler's layout)."""
    rows, vocab = allowed.shape
    words = -(-vocab // 32)
    padded = torch.zeros(rows, words * 32, dtype=torch.int64)
    padded[:, :vocab] = allowed.to(torch.int64)
    weights = torch.ones(32, dtype=torch.int64) << torch.arange(32, dtype=torch.int64)
    packed = (padded.view(rows, words, 32) * weights).sum(-1)  # [R, W] in [0, 2^32)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
