"""Tiny random models built inside the tests (nothing is downloaded)."""

from __future__ import annotations

import random
import time
from pathlib import Path

import torch

from loraplex.server.engine.models.demo import (
    llama_hf_config,
    write_byte_tokenizer,
    write_random_llama,
)

ARCH = {
    "llama": ("LlamaForCausalLM", "llama"),
    "mistral": ("MistralForCausalLM", "mistral"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
}


def tiny_hf_config(arch: str = "llama", **overrides) -> dict:
    cls, model_type = ARCH[arch]
    cfg = llama_hf_config(vocab_size=300, hidden_size=64, intermediate_size=160,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=16, max_position_embeddings=256)
    cfg.update(architectures=[cls], model_type=model_type)
    if arch == "qwen2":
        cfg.update(use_sliding_window=False, sliding_window=None)
    if arch == "mistral":
        cfg.update(sliding_window=None)
    cfg.update(overrides)
    return cfg


def make_model(path: Path, arch: str = "llama", seed: int = 0, std: float = 0.1,
               **overrides) -> Path:
    """Write a tiny random HF model (weights, config, byte tokenizer) into ``path``."""
    cfg = tiny_hf_config(arch, **overrides)
    if arch == "qwen2":
        cfg.setdefault("attention_bias", True)
    write_random_llama(path, cfg, seed=seed, std=std)
    write_byte_tokenizer(path)
    return path


def random_prompts(num: int, seed: int, low: int = 3, high: int = 40,
                   vocab: int = 256) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(low, high))] for _ in range(num)]


def hf_greedy(model_dir: Path, prompts: list[list[int]], max_new_tokens: int | list[int],
              min_margin: float = 1e-4, dtype: torch.dtype = torch.float32) -> list[list[int]]:
    """transformers' greedy tokens for each prompt alone (no padding), asserting that every
    chosen token beats the runner-up by ``min_margin`` so that the comparison is meaningful."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype)
    model.eval()
    lengths = max_new_tokens if isinstance(max_new_tokens, list) else [max_new_tokens] * len(
        prompts)
    outputs = []
    with torch.no_grad():
        for prompt, n in zip(prompts, lengths):
            ids = torch.tensor([prompt])
            # eos_token_id=-1, not min_new_tokens: the engine's ignore_eos may pick EOS like
            # any token, while min_new_tokens would mask it out of the reference.
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                 eos_token_id=-1, do_sample=False, output_scores=True,
                                 return_dict_in_generate=True, pad_token_id=258)
            for score in out.scores:
                top2 = score[0].float().topk(2).values
                margin = float(top2[0] - top2[1])
                if margin < min_margin:
                    raise AssertionError(f"near-tied logits (margin {margin:.2e}): pick another "
                                         "seed for a meaningful comparison")
            outputs.append(out.sequences[0, len(prompt):].tolist())
    return outputs


# -- adapters -----------------------------------------------------------------------------------

ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

# (name, rank, alpha, use_rslora, target modules): ranks {1, 4, 8, 16, 64}, several target sets
ADAPTER_SPECS = [
    ("a-r1-qv", 1, 2.0, False, ["q_proj", "v_proj"]),
    ("b-r4-all", 4, 8.0, False, ALL_MODULES),
    ("c-r8-qv", 8, 16.0, True, ["q_proj", "v_proj"]),
    ("d-r16-all", 16, 8.0, False, ALL_MODULES),
    ("e-r64-attn", 64, 32.0, True, ["q_proj", "k_proj", "v_proj", "o_proj"]),
    ("f-r8-mlp", 8, 4.0, False, ["gate_proj", "up_proj", "down_proj"]),
    ("g-r16-kod", 16, 16.0, False, ["k_proj", "o_proj", "down_proj"]),
    ("h-r4-all", 4, 1.0, True, ALL_MODULES),
]


def make_peft_adapters(model_dir: Path, out_dir: Path, specs=ADAPTER_SPECS, seed: int = 0,
                       std: float = 0.05) -> dict[str, Path]:
    """Save one PEFT LoRA adapter per spec (random nonzero A and B) under ``out_dir/name``."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    paths = {}
    for i, (name, rank, alpha, rslora, targets) in enumerate(specs):
        base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        cfg = LoraConfig(r=rank, lora_alpha=alpha, use_rslora=rslora, target_modules=targets,
                         lora_dropout=0.0, init_lora_weights=False, task_type="CAUSAL_LM")
        model = get_peft_model(base, cfg)
        gen = torch.Generator().manual_seed(seed * 1000 + i)
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if "lora_" in pname:
                    p.copy_(torch.randn(p.shape, generator=gen) * std)
        model.save_pretrained(str(out_dir / name))
        paths[name] = out_dir / name
    return paths


def peft_greedy(model_dir: Path, adapter_paths: dict[str, Path], prompts: list[list[int]],
                adapter_names: list[str | None], max_new_tokens: list[int],
                min_margin: float = 1e-4) -> list[list[int]]:
    """peft's greedy tokens per request (alone, no padding), margin-checked like hf_greedy."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    names = list(adapter_paths)
    model = PeftModel.from_pretrained(base, str(adapter_paths[names[0]]), adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(str(adapter_paths[name]), adapter_name=name)
    model.eval()
    outputs = []
    with torch.no_grad():
        for prompt, adapter, n in zip(prompts, adapter_names, max_new_tokens):
            ids = torch.tensor([prompt])
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                 max_new_tokens=n, eos_token_id=-1, do_sample=False,
                                 output_scores=True, return_dict_in_generate=True,
                                 pad_token_id=258, adapter_names=[adapter or "__base__"])
            for score in out.scores:
                top2 = score[0].float().topk(2).values
                if float(top2[0] - top2[1]) < min_margin:
                    raise AssertionError("near-tied logits: pick another seed")
            outputs.append(out.sequences[0, len(prompt):].tolist())
    return outputs


def assert_pages_idle(engine) -> None:
    """No request holds a page: no KV, no pinned entry (cached prefixes and adapters may stay
    resident, but every one of their pages is evictable)."""
    s = engine.pager.stats()
    assert s.num_kv == 0, s
    assert s.num_free + s.num_evictable == s.num_pages, s


def warm_host_tier(engine, digests, timeout: float = 60.0) -> None:
    """Load every adapter of ``digests`` into the engine's host tier and wait until all are
    there. Loads run on loader threads, so without this the step at which an adapter becomes
    ready (and with it, in a tight pool, whether a run preempts) depends on the machine's
    speed; warmed, the schedule that follows is the same on every machine."""
    wanted = {d for d in digests if d is not None}
    for digest in wanted:
        engine.adapters.prefetch(digest)
    deadline = time.monotonic() + timeout
    while any(engine.adapters.host_pages(d) is None for d in wanted):
        failed = engine.adapters.take_failures()
        assert not failed, failed
        assert time.monotonic() < deadline, f"adapters not in the host tier after {timeout} s"
        time.sleep(0.005)


# -- GGUF files ---------------------------------------------------------------------------------

def write_tiny_gguf(path: Path, arch: str = "llama", seed: int = 0, num_layers: int = 2,
                    hidden: int = 64, num_heads: int = 4, num_kv_heads: int = 2,
                    intermediate: int = 128) -> Path:
    """A tiny random float32 GGUF file (``llama`` or ``qwen2``, q/k/v biases for qwen2) with a
    byte-level BPE tokenizer and a chat template, written with the ``gguf`` package as
    llama.cpp lays it out."""
    import gguf
    import numpy as np
    from tokenizers.pre_tokenizers import ByteLevel

    rng = np.random.default_rng(seed)
    tokens = sorted(ByteLevel.alphabet()) + ["Ġt", "<s>", "</s>", "<pad>"]
    vocab = len(tokens)
    kv = num_kv_heads * hidden // num_heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny")
    w.add_block_count(num_layers)
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(intermediate)
    w.add_head_count(num_heads)
    w.add_head_count_kv(num_kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(0)  # all float32
    if arch == "llama":
        w.add_rope_dimension_count(hidden // num_heads)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([1] * (vocab - 3) + [3, 3, 3])  # normal, then control tokens
    w.add_token_merges(["Ġ t"])
    w.add_bos_token_id(vocab - 3)
    w.add_eos_token_id(vocab - 2)
    w.add_pad_token_id(vocab - 1)
    w.add_add_bos_token(False)
    w.add_chat_template("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>"
                        "{% endfor %}{% if add_generation_prompt %}<s>assistant: {% endif %}")

    def tensor(name: str, *shape: int, base: float = 0.0) -> None:
        w.add_tensor(name, (base + rng.standard_normal(shape) * 0.1).astype(np.float32))

    tensor("token_embd.weight", vocab, hidden)
    for i in range(num_layers):
        p = f"blk.{i}."
        tensor(p + "attn_norm.weight", hidden, base=1.0)
        tensor(p + "attn_q.weight", hidden, hidden)
        tensor(p + "attn_k.weight", kv, hidden)
        tensor(p + "attn_v.weight", kv, hidden)
        tensor(p + "attn_output.weight", hidden, hidden)
        if arch == "qwen2":
            tensor(p + "attn_q.bias", hidden)
            tensor(p + "attn_k.bias", kv)
            tensor(p + "attn_v.bias", kv)
        tensor(p + "ffn_norm.weight", hidden, base=1.0)
        tensor(p + "ffn_gate.weight", intermediate, hidden)
        tensor(p + "ffn_up.weight", intermediate, hidden)
        tensor(p + "ffn_down.weight", hidden, intermediate)
    tensor("output_norm.weight", hidden, base=1.0)
    tensor("output.weight", vocab, hidden)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
