"""The penalties' per-request token tensors (``row_tokens.py``): the same positions as the
request's lists after appends, a taken-back output and forks; gone with the request; and the
engine's penalised, seeded tokens unchanged by preemption with them."""

from __future__ import annotations

import gc

from loraplex.server.config import EngineConfig, SchedulerConfig
from loraplex.server.engine import row_tokens
from loraplex.server.engine.engine import Engine
from loraplex.server.engine.llm import LLM
from loraplex.server.engine.request import Request, SamplingParams
from loraplex.server.engine.sampler import SamplingMetadata
from tests.helpers import random_prompts

VOCAB = 300
PENALISED = SamplingParams(max_tokens=200, temperature=1.0, repetition_penalty=1.3,
                           frequency_penalty=0.4, presence_penalty=0.2)


def _positions(meta: SamplingMetadata, field: str) -> list[set[int]]:
    positions = getattr(meta, field)
    assert positions is not None
    out: list[set[int]] = [set() for _ in range(meta.num_rows)]
    for row, token in zip(*(t.tolist() for t in positions)):
        out[row].add(token)
    return out


def _check(requests: list[Request]) -> None:
    meta = SamplingMetadata.from_requests(requests, VOCAB)
    assert _positions(meta, "seen_positions") == [set(r.all_token_ids) for r in requests]
    assert _positions(meta, "count_positions") == [set(r.output_token_ids) for r in requests]
    assert meta.count_positions is not None and meta.count_values is not None
    counts = {(row, token): count for row, token, count in zip(
        meta.count_positions[0].tolist(), meta.count_positions[1].tolist(),
        meta.count_values.tolist())}
    assert counts == {(i, t): float(r.output_token_ids.count(t))
                      for i, r in enumerate(requests) for t in set(r.output_token_ids)}


def test_positions_follow_the_lists_and_entries_go_with_the_request():
    gc.collect()
    baseline = row_tokens.num_cached()
    a = Request("a", [5, 6, 5, 7], PENALISED)
    b = Request("b", [9, 9], PENALISED)
    _check([a, b])
    assert row_tokens.num_cached() == baseline + 2
    a.output_token_ids += [1, 2, 1]
    _check([a, b])
    a.output_token_ids.append(8)
    b.output_token_ids.extend([9, 3])
    _check([a, b])
    # Outputs taken back and replaced (a rejected speculation), to the same length.
    del a.output_token_ids[1:]
    a.output_token_ids += [4, 4, 11]
    _check([b, a])
    # A fork: its own request object and outputs, on the same prompt list.
    child = Request("a/1", a.prompt_token_ids, PENALISED)
    child.output_token_ids = [40, 41]
    _check([a, child, b])
    del a, b, child
    gc.collect()
    assert row_tokens.num_cached() == baseline


def test_penalised_seeded_tokens_are_the_same_under_preemption(tiny_llama):
    prompts = random_prompts(6, seed=61, low=10, high=30)
    params = [SamplingParams(max_tokens=14, temperature=1.0, top_k=20, top_p=0.9, seed=70 + i,
                             repetition_penalty=1.5, frequency_penalty=0.5,
                             presence_penalty=0.5, ignore_eos=True) for i in range(6)]
    gc.collect()
    baseline = row_tokens.num_cached()

    def run(num_pages: int, **sched) -> tuple[list[list[int]], int]:
        engine = Engine(EngineConfig(model=str(tiny_llama), num_pages=num_pages,
                                     scheduler=SchedulerConfig(page_size=4, **sched)))
        tokens = [r.token_ids for r in LLM(engine=engine).generate(prompts, params)]
        return tokens, engine.stats().num_preemptions

    want, _ = run(256)
    got, preemptions = run(30, max_num_batched_tokens=48)
    assert preemptions > 0
    assert got == want
    gc.collect()
    assert row_tokens.num_cached() == baseline
