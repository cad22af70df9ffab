"""Valid adapters are accepted and canonicalised; the digest names exactly what changes outputs."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import shutil
from pathlib import Path

import pytest
import safetensors.torch
import torch

from loraplex.adapter_store.format import (
    CanonicalAdapter,
    build_adapter,
    load_adapter,
    peft_key,
)
from loraplex.server.engine.models.config import LORA_MODULES, ModelConfig

PEFT_CASES = {
    # name: (r, lora_alpha, target_modules, use_rslora, dtype)
    "r4-qv-fp32": (4, 8, ["q_proj", "v_proj"], False, torch.float32),
    "r8-all-rslora-bf16": (8, 16, "all-linear", True, torch.bfloat16),
    "r2-mlp-o-fp16": (2, 3.5, ["o_proj", "gate_proj", "up_proj", "down_proj"], False,
                      torch.float16),
}


@pytest.fixture(scope="session")
def peft_adapters(tmp_path_factory: pytest.TempPathFactory, base_config: ModelConfig, kit
                  ) -> dict[str, tuple[Path, dict[str, float]]]:
    """Adapters saved by real peft on a tiny random Llama: name -> (dir, module -> scaling)."""
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora import LoraLayer
    from transformers import LlamaConfig, LlamaForCausalLM

    hf = {k: v for k, v in kit.tiny_llama.items() if k not in ("architectures", "model_type")}
    hf["num_hidden_layers"] = base_config.num_layers
    out = {}
    for i, (name, (r, alpha, targets, rslora, dtype)) in enumerate(PEFT_CASES.items()):
        torch.manual_seed(i)
        model = LlamaForCausalLM(LlamaConfig(**hf))
        peft_model = get_peft_model(model, LoraConfig(
            r=r, lora_alpha=alpha, target_modules=targets, use_rslora=rslora,
            init_lora_weights=False, task_type="CAUSAL_LM"))
        peft_model.to(dtype)
        path = tmp_path_factory.mktemp(name)
        peft_model.save_pretrained(path)
        scalings = {n.rsplit(".", 1)[-1]: m.scaling["default"]
                    for n, m in peft_model.named_modules() if isinstance(m, LoraLayer)}
        out[name] = (path, scalings)
    return out


@pytest.mark.filterwarnings("ignore::FutureWarning")  # transformers, inside peft's save
@pytest.mark.parametrize("case", PEFT_CASES)
def test_real_peft_adapters_load_bit_exact(case, peft_adapters, base_config):
    path, scalings = peft_adapters[case]
    r, alpha, targets, rslora, dtype = PEFT_CASES[case]
    adapter = load_adapter(path, base_config)
    saved = safetensors.torch.load_file(str(path / "adapter_model.safetensors"))
    want_targets = LORA_MODULES if targets == "all-linear" else tuple(
        m for m in LORA_MODULES if m in targets)
    assert adapter.target_modules == want_targets
    assert (adapter.rank, adapter.lora_alpha, adapter.use_rslora) == (r, alpha, rslora)
    assert adapter.dtype == dtype
    assert len(adapter.digest) == 64 and int(adapter.digest, 16) >= 0
    for module in want_targets:
        assert adapter.scale == scalings[module]  # same float ops as PEFT: bit-equal
    assert len(adapter.weights) == base_config.num_layers * len(want_targets)
    for (layer, module), (a, b) in adapter.weights.items():
        for half, t in (("A", a), ("B", b)):
            want = saved[peft_key(layer, module, half)]
            assert t.dtype == want.dtype and torch.equal(t.view(torch.uint8),
                                                         want.view(torch.uint8))
    assert adapter.nbytes == sum(t.nbytes for t in saved.values())
    assert list(adapter.weights) == [(layer, m) for layer in range(base_config.num_layers)
                                     for m in want_targets]


def test_digest_is_the_documented_hash(make_adapter, base_config):
    adapter = load_adapter(make_adapter(rank=2, lora_alpha=4), base_config)
    header = json.dumps({
        "base_dims": base_config.dims_key(), "dtype": "float32", "format_version": 1,
        "lora_alpha": 4.0, "r": 2, "scale": 2.0, "target_modules": ["q_proj", "v_proj"],
        "use_rslora": False}, sort_keys=True, separators=(",", ":")).encode()
    h = hashlib.sha256(len(header).to_bytes(8, "little") + header)
    for t in adapter.tensors():
        h.update(t.numpy().tobytes())
    assert adapter.header() == header
    assert adapter.digest == h.hexdigest()


def test_digest_ignores_layout_and_bookkeeping(make_adapter, base_config, tmp_path, kit):
    first = load_adapter(make_adapter("a"), base_config)
    assert load_adapter(make_adapter("a2"), base_config).digest == first.digest
    # Same tensors in another file order and with other metadata, no README, other
    # bookkeeping keys and an integer-valued float alpha: same digest.
    tensors = kit.lora_tensors(base_config)
    reordered = dict(reversed(list(tensors.items())))
    other = tmp_path / "b"
    other.mkdir()
    safetensors.torch.save_file(reordered, str(other / "adapter_model.safetensors"),
                                metadata={"format": "pt", "note": "x"})
    (other / "adapter_config.json").write_text(json.dumps(kit.lora_config(
        lora_alpha=8.0, lora_dropout=0.1, base_model_name_or_path="meta-llama/x",
        astra_config=None, peft_version="0.22.0",  # a key PEFT 0.22 added (its init's)
        target_modules=["v_proj", "model.layers.0.self_attn.q_proj"])))
    assert load_adapter(other, base_config).digest == first.digest


@pytest.mark.parametrize("change", ["alpha", "rslora", "dtype", "bit", "targets", "dims"])
def test_digest_changes_with_anything_that_changes_outputs(change, make_adapter, base_config,
                                                           kit):
    base = load_adapter(make_adapter("base"), base_config)
    cfg = base_config
    if change == "alpha":
        other = load_adapter(make_adapter("x", lora_alpha=9), cfg)
    elif change == "rslora":
        other = load_adapter(make_adapter("x", use_rslora=True), cfg)
    elif change == "dtype":  # the same values, exactly representable in bf16, fp16 and fp32
        halves = {k: (a.to(torch.bfloat16).float(), b.to(torch.bfloat16).float())
                  for k, (a, b) in base.weights.items()}
        as_fp32 = build_adapter(halves, rank=4, lora_alpha=8, base_config=cfg)
        as_bf16 = build_adapter({k: (a.bfloat16(), b.bfloat16()) for k, (a, b) in
                                 halves.items()}, rank=4, lora_alpha=8, base_config=cfg)
        base, other = as_fp32, as_bf16
    elif change == "bit":
        weights = dict(base.weights)
        a, b = weights[(1, "v_proj")]
        b = b.clone()
        b.view(torch.int32)[0, 0] ^= 1  # one ulp
        weights[(1, "v_proj")] = (a, b)
        other = build_adapter(weights, rank=4, lora_alpha=8, base_config=cfg)
    elif change == "targets":
        only_q = {k: v for k, v in base.weights.items() if k[1] == "q_proj"}
        other = build_adapter(only_q, rank=4, lora_alpha=8, base_config=cfg)
    else:  # same module shapes, other head layout: 4 heads of 8 vs 2 heads of 16
        cfg2 = ModelConfig.from_hf_dict({**kit.tiny_llama, "num_attention_heads": 2,
                                         "num_key_value_heads": 1, "head_dim": 16})
        assert cfg2.module_shapes() == cfg.module_shapes()
        other = build_adapter(dict(base.weights), rank=4, lora_alpha=8, base_config=cfg2)
    assert other.digest != base.digest


def test_scale_and_rslora(make_adapter, base_config):
    plain = load_adapter(make_adapter("p", rank=4, lora_alpha=16), base_config)
    rs = load_adapter(make_adapter("r", rank=4, lora_alpha=16, use_rslora=True), base_config)
    assert plain.scale == 4.0 and rs.scale == 16 / math.sqrt(4)


def test_optional_config_keys_follow_peft_defaults(tmp_path, base_config, kit):
    # r and lora_alpha default to 8, target_modules may be absent or a regex string.
    tensors = kit.lora_tensors(base_config, rank=8)
    for i, cfg in enumerate([{"peft_type": "LORA"},
                             {"peft_type": "LORA", "target_modules": ".*(q|v)_proj"}]):
        adapter = load_adapter(kit.write_adapter(tmp_path / str(i), tensors, cfg), base_config)
        assert (adapter.rank, adapter.lora_alpha, adapter.scale) == (8, 8.0, 1.0)
        assert adapter.target_modules == ("q_proj", "v_proj")


def test_declared_sha256_accepted_when_right(make_adapter, base_config):
    path = make_adapter()
    declared = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in path.iterdir()}
    assert load_adapter(path, base_config, declared_sha256=declared).rank == 4


def test_build_adapter_matches_load_and_is_hashable(make_adapter, base_config):
    loaded = load_adapter(make_adapter(targets=LORA_MODULES, rank=3), base_config)
    built = build_adapter(dict(loaded.weights), rank=3, lora_alpha=8, base_config=base_config)
    assert built == loaded and hash(built) == hash(loaded) and built.digest == loaded.digest
    assert len({built, loaded}) == 1
    assert "weights" not in repr(built)
    with pytest.raises(dataclasses.FrozenInstanceError):
        built.rank = 5  # type: ignore[misc]
    assert isinstance(built, CanonicalAdapter)


def test_readme_is_optional(make_adapter, base_config):
    path = make_adapter()
    digest = load_adapter(path, base_config).digest
    (path / "README.md").unlink()
    assert load_adapter(path, base_config).digest == digest
    shutil.rmtree(path)
