"""The driver's step message: an int64 tensor that decodes to what was encoded, and a
malformed one refused (never a pickle: nothing but integers crosses between ranks)."""

from __future__ import annotations

import pytest
import torch

from loraplex.server.engine.model_runner import StepTokens
from loraplex.server.engine.parallel.protocol import (
    FillSpec,
    SegmentSpec,
    StepMessage,
    decode,
    encode,
)


def message() -> StepMessage:
    tokens = StepTokens([5, 6, 7, 8, 9], [0, 1, 2, 10, 11], [[3, 4, 9], [1]], [3, 2], [3, 12])
    segments = [SegmentSpec(0, 3, 64, ("q_proj", "k_proj", "v_proj", "o_proj"), 4.0 / 3.0,
                            tuple(range(20, 40))),
                SegmentSpec(3, 5, 1, ("down_proj",), 2.0, (7,))]
    return StepMessage(tokens, segments, [FillSpec(1000, (20, 21)), FillSpec(7, (7,))])


def test_round_trip_is_exact():
    msg = message()
    data = encode(msg)
    assert data.dtype == torch.int64 and data.dim() == 1
    assert decode(data) == msg  # the scale's float64 bits too
    empty = StepMessage(StepTokens([1], [0], [[0]], [1], [1]), [], [])
    assert decode(encode(empty)) == empty


def test_malformed_messages_are_refused():
    data = encode(message())
    with pytest.raises(ValueError, match="truncated"):
        decode(data[:-1])
    with pytest.raises(ValueError, match="trailing"):
        decode(torch.cat([data, torch.tensor([0])]))
