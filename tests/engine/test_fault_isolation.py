"""A request's numerical or postprocessing failure fails that request alone; the batch and the
engine go on (issue 13, finding 1)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from loraplex.adapter_store.format import load_adapter, peft_key
from loraplex.server.config import EngineConfig, SchedulerConfig
from loraplex.server.engine.engine import SAMPLING_FAILED, Engine
from loraplex.server.engine.models.config import ModelConfig
from loraplex.server.engine.request import SamplingParams
from tests.engine.test_lora_parity import LoadedSource
from tests.helpers import assert_pages_idle, random_prompts


def write_huge_adapter(path: Path, model_dir: Path, value: float = 3e38, rank: int = 4,
                       targets: tuple[str, ...] = ("q_proj", "v_proj")) -> Path:
    """A PEFT adapter whose weights are all +-``value``: finite in float32 (the store accepts
    it), inf in float16, and overflowing in float32 activations."""
    base = ModelConfig.from_pretrained(model_dir)
    shapes = base.module_shapes()
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for layer in range(base.num_layers):
        for module in targets:
            d_in, d_out = shapes[module]
            for half, shape in (("A", (rank, d_in)), ("B", (d_out, rank))):
                signs = torch.randint(0, 2, shape, generator=gen).float() * 2 - 1
                tensors[peft_key(layer, module, half)] = signs * value
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": rank,
              "target_modules": list(targets), "lora_dropout": 0.0, "bias": "none"}
    (path / "adapter_config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def huge_adapter(tiny_llama, tmp_path_factory):
    path = write_huge_adapter(tmp_path_factory.mktemp("huge") / "huge", tiny_llama)
    return load_adapter(path, ModelConfig.from_pretrained(tiny_llama))


def make_engine(model_dir, adapters=(), dtype="float32"):
    return Engine(EngineConfig(model=str(model_dir), num_pages=64, dtype=dtype,
                               scheduler=SchedulerConfig(page_size=4)),
                  adapter_source=LoadedSource(list(adapters)))


def run(engine, requests):
    """requests: (id, prompt, params, digest); all added now. Returns id -> (tokens, last)."""
    for rid, prompt, params, digest in requests:
        engine.add_request(rid, prompt, params, adapter_digest=digest)
    tokens = {rid: [] for rid, *_ in requests}
    final = {}
    deadline = time.monotonic() + 60
    while engine.has_unfinished():
        assert time.monotonic() < deadline, "engine did not finish"
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
            if out.finished:
                final[out.request_id] = out
    return {rid: (tokens[rid], final[rid]) for rid in tokens}


def test_overflowing_adapter_fails_its_request_alone(tiny_llama, huge_adapter):
    prompts = random_prompts(4, seed=41, low=5, high=14)
    greedy = SamplingParams(max_tokens=8, ignore_eos=True)
    sampled = SamplingParams(max_tokens=8, temperature=1.0, seed=7, ignore_eos=True)
    reference = run(make_engine(tiny_llama), [
        ("ok", prompts[1], greedy, None), ("ok-sampled", prompts[2], sampled, None),
        ("later-1", prompts[3], greedy, None), ("later-2", prompts[0][:3], greedy, None)])
    engine = make_engine(tiny_llama, [huge_adapter])
    first = run(engine, [
        ("bad", prompts[0], SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True),
         huge_adapter.digest),
        ("ok", prompts[1], greedy, None), ("ok-sampled", prompts[2], sampled, None)])
    tokens, last = first["bad"]
    assert last.finish_reason == "error" and last.error == SAMPLING_FAILED
    assert tokens == []
    for rid in ("ok", "ok-sampled"):
        assert first[rid][1].error is None
        assert first[rid][0] == reference[rid][0]
    # The engine keeps serving: later requests (of different lengths, decoding together, on
    # pages the failed request held) get the same tokens as on a fresh engine.
    later = run(engine, [("later-1", prompts[3], greedy, None),
                         ("later-2", prompts[0][:3], greedy, None)])
    for rid in ("later-1", "later-2"):
        assert later[rid][1].error is None
        assert later[rid][0] == reference[rid][0]
    assert_pages_idle(engine)


def test_adapter_not_finite_in_the_serving_dtype_is_refused_at_load(tiny_llama, huge_adapter):
    engine = make_engine(tiny_llama, [huge_adapter], dtype="float16")
    out = run(engine, [("bad", [1, 2, 3], SamplingParams(max_tokens=4), huge_adapter.digest)])
    error = out["bad"][1].error
    assert out["bad"][1].finish_reason == "error"
    assert error.startswith("adapter ")
    assert "layers.0.q_proj.lora_A is not finite in float16" in error
    assert engine.stats().adapter_load_failures == 1


def test_failure_in_one_requests_postprocessing_fails_it_alone(tiny_llama):
    engine = make_engine(tiny_llama)
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    engine.add_request("bad", [1, 2, 3, 4], params)
    engine.add_request("good", [5, 6, 7], params)

    class BrokenDetokenizer:  # fault injection: this request's detokenizer raises
        def add(self, token_id, finished):
            raise RuntimeError("Already borrowed")

        def finish(self):
            return ""

    engine.outputs._detok["bad"] = BrokenDetokenizer()
    outputs = {}
    while engine.has_unfinished():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    bad, good = outputs["bad"][-1], outputs["good"]
    assert bad.finish_reason == "error"
    assert bad.error == "internal error in postprocessing: Already borrowed"
    assert good[-1].finish_reason == "length" and good[-1].error is None
    assert sum(len(o.new_token_ids) for o in good) == 5
    assert_pages_idle(engine)


def test_temperature_too_small_is_refused():
    with pytest.raises(ValueError, match=r"^temperature: must be 0 \(greedy\) or >= 0.01"):
        SamplingParams(temperature=1e-300)
    with pytest.raises(ValueError, match="^temperature:"):
        SamplingParams(temperature=0.009)
    assert SamplingParams(temperature=0.01).temperature == 0.01
