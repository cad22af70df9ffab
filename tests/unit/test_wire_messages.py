"""The wire's new fields round-trip: tools and tool choice on requests, tool calls on chunks
and responses, a unary response's n sequences (sequence 0 also in its top-level fields;
a one-sequence response carries no ``sequences`` on the wire), and usage's speculation
counts."""

from __future__ import annotations

from loraplex.server.api import (
    Completion,
    GenerateChunk,
    GenerateRequest,
    SequenceOutput,
    Tool,
    ToolCall,
    ToolChoice,
    Usage,
)
from loraplex.server.params import SamplingParams, TokenLogprob
from loraplex.server.wire.messages import (
    chunk_from_pb,
    chunk_to_pb,
    completion_from_pb,
    completion_to_pb,
    generate_request_from_pb,
    generate_request_to_pb,
)
from loraplex.v1 import generation_pb2


def test_tools_round_trip() -> None:
    for choice in (None, ToolChoice(mode="required"), ToolChoice(function="f"),
                   ToolChoice(mode="auto")):
        request = GenerateRequest("hi", SamplingParams(max_tokens=3), request_id="r",
                                  tools=(Tool("f", "does f", '{"type": "object"}'), Tool("g")),
                                  tool_choice=choice)
        assert generate_request_from_pb(generate_request_to_pb(request)) == request
    chunk = GenerateChunk("r", [1, 2], "{}", finish_reason="tool_calls", index=2,
                          tool_calls=[ToolCall("call_1", "f", '{"a": 1}')])
    m = chunk_to_pb(chunk)
    assert m.finish_reason == generation_pb2.FINISH_REASON_TOOL_CALLS
    assert chunk_from_pb(m) == chunk


def test_sequences_round_trip() -> None:
    lp = [TokenLogprob(5, -0.5, ((5, -0.5),))]
    seqs = [SequenceOutput(0, [5], "a", lp, "stop"), SequenceOutput(1, [6, 7], "bc", [],
                                                                   "length")]
    done = Completion("r", [5], "a", lp, "stop", Usage(3, 3, 0), sequences=seqs)
    m = completion_to_pb(done)
    assert [s.index for s in m.sequences] == [0, 1] and list(m.token_ids) == [5]
    assert completion_from_pb(m) == done
    one = Completion("r", [5], "a", lp, "stop", Usage(3, 1, 0), sequences=seqs[:1])
    m = completion_to_pb(one)
    assert len(m.sequences) == 0  # nothing repeated on the wire
    assert completion_from_pb(m) == one  # the client rebuilds sequence 0


def test_gather_routes_chunks_by_sequence() -> None:
    done = Completion("r")
    for chunk in (GenerateChunk("r", [1], "a", index=0,
                                prompt_logprobs=[TokenLogprob(2, -1.0, ())]),
                  GenerateChunk("r", [2], "b", index=1),
                  GenerateChunk("r", [3], "c", index=1, finish_reason="length"),
                  GenerateChunk("r", [4], "d", index=0, finish_reason="stop",
                                usage=Usage(1, 4, 0))):
        done.gather(chunk)
    assert (done.token_ids, done.text, done.finish_reason) == ([1, 4], "ad", "stop")
    assert [(s.index, s.token_ids, s.finish_reason) for s in done.sequences] == [
        (0, [1, 4], "stop"), (1, [2, 3], "length")]
    assert done.usage == Usage(1, 4, 0) and len(done.prompt_logprobs) == 1


def test_usage_speculation_counts_round_trip() -> None:
    usage = Usage(10, 24, 4, draft_tokens=17, accepted_draft_tokens=12)
    chunk = GenerateChunk("r", [3], "c", finish_reason="length", usage=usage)
    m = chunk_to_pb(chunk)
    assert (m.usage.draft_tokens, m.usage.accepted_draft_tokens) == (17, 12)
    assert chunk_from_pb(m) == chunk
    done = Completion("r", [3], "c", usage=usage,
                      sequences=[SequenceOutput(0, [3], "c", [], "length")],
                      finish_reason="length")
    assert completion_from_pb(completion_to_pb(done)).usage == usage
    # A message from a sender without the fields (an older worker): no drafts.
    m.usage.ClearField("draft_tokens")
    m.usage.ClearField("accepted_draft_tokens")
    assert chunk_from_pb(m).usage == Usage(10, 24, 4)
