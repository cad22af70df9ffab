"""Request validation, abort, stop conditions and streaming text."""

from __future__ import annotations

import pytest

from loraplex.server.config import EngineConfig, SchedulerConfig
from loraplex.server.engine.engine import Engine
from loraplex.server.engine.llm import LLM
from loraplex.server.engine.request import Request, SamplingParams
from loraplex.server.engine.tokenizer import Detokenizer
from tests.helpers import assert_pages_idle, random_prompts


@pytest.fixture()
def engine(tiny_llama):
    return Engine(EngineConfig(model=str(tiny_llama), num_pages=64,
                               scheduler=SchedulerConfig(page_size=4)))


@pytest.mark.parametrize("kwargs,field", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": -1.0}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_k": -2}, "top_k"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"seed": -1}, "seed"),
    ({"stop": ("",)}, "stop"),
    ({"stop_token_ids": (-3,)}, "stop_token_ids"),
    ({"logprobs": 50}, "logprobs"),
])
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        SamplingParams(**kwargs)


def test_bad_prompts_are_refused_and_the_engine_keeps_serving(engine):
    engine.add_request("good", [1, 2, 3], SamplingParams(max_tokens=5, ignore_eos=True))
    with pytest.raises(ValueError, match="^prompt: must not be empty"):
        engine.add_request("empty", [], SamplingParams())
    with pytest.raises(ValueError, match="^prompt: must not be empty"):
        engine.add_request("empty-text", "", SamplingParams())
    with pytest.raises(ValueError, match="^prompt: .*exceed the context of 256"):
        engine.add_request("long", [1] * 250, SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match="^prompt: token ids"):
        engine.add_request("vocab", [1, 100000], SamplingParams())
    with pytest.raises(ValueError, match="^request_id: 'good' is already in use"):
        engine.add_request("good", [1], SamplingParams())
    tokens = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens.extend(out.new_token_ids)
            if out.finished:
                assert out.finish_reason == "length"
    assert len(tokens) == 5


def test_abort_frees_pages_within_one_step(engine):
    for i in range(3):
        engine.add_request(f"r{i}", random_prompts(1, seed=i, low=20, high=20)[0],
                           SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    used = engine.pager.num_pages - engine.pager.num_free
    assert used > 0
    engine.abort("r1")
    outs = engine.step()
    aborted = [o for o in outs if o.request_id == "r1"]
    assert aborted and aborted[0].finished and aborted[0].finish_reason == "abort"
    assert engine.stats().num_running == 2
    engine.abort("r0")
    engine.abort("r2")
    engine.step()
    assert not engine.has_unfinished()
    assert_pages_idle(engine)


def test_stop_token_ids_and_eos(engine):
    llm = LLM(engine=engine)
    prompt = random_prompts(1, seed=4)[0]
    free = llm.generate([prompt], SamplingParams(max_tokens=10, ignore_eos=True))[0]
    stop_at = free.token_ids[3]
    stopped = llm.generate([prompt], SamplingParams(max_tokens=10, ignore_eos=True,
                                                    stop_token_ids=(stop_at,)))[0]
    first = free.token_ids.index(stop_at)
    assert stopped.token_ids == free.token_ids[: first + 1]
    assert stopped.finish_reason == "stop"
    engine.eos_token_ids = frozenset({stop_at})
    eos = llm.generate([prompt], SamplingParams(max_tokens=10))[0]
    assert eos.token_ids == free.token_ids[: first + 1] and eos.finish_reason == "stop"


def test_stop_strings_across_tokens_are_removed_and_never_streamed(engine):
    llm = LLM(engine=engine)
    prompt = random_prompts(1, seed=6)[0]
    full = llm.generate([prompt], SamplingParams(max_tokens=24, ignore_eos=True))[0]
    text = full.text
    # a stop string spanning several characters in the middle of the text
    candidates = [i for i in range(2, len(text) - 3) if text[i:i + 3].isprintable()
                  and text.find(text[i:i + 3]) == i]
    assert candidates, f"no usable stop string in {text!r}"
    at = candidates[0]
    stop = text[at:at + 3]
    engine.add_request("s", prompt, SamplingParams(max_tokens=24, ignore_eos=True, stop=(stop,)))
    pieces, reason = [], None
    while engine.has_unfinished():
        for out in engine.step():
            pieces.append(out.new_text)
            reason = out.finish_reason if out.finished else reason
    assert "".join(pieces) == text[:at]
    assert reason == "stop"
    assert all(stop not in "".join(pieces[:k]) for k in range(len(pieces) + 1))


def test_streamed_text_equals_full_decode(engine):
    llm = LLM(engine=engine)
    out = llm.generate(random_prompts(1, seed=9), SamplingParams(max_tokens=16,
                                                                 ignore_eos=True))[0]
    assert out.text == engine.tokenizer.decode(out.token_ids)


def test_multibyte_characters_are_never_split(engine):
    # Byte tokens: "é" and "✓" arrive over several tokens; no delta may hold half of one.
    text = "héllo wörld ✓ done"
    ids = engine.tokenizer.encode(text)[1:]  # without <s>
    req = Request("d", [1], SamplingParams(max_tokens=len(ids), ignore_eos=True))
    detok = Detokenizer(engine.tokenizer, req)
    deltas = [detok.add(t, finished=i == len(ids) - 1)[0] for i, t in enumerate(ids)]
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)
    assert deltas[ids.index(0xC3)] == ""  # the first byte of "é" alone emits nothing
