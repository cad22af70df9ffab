"""The malicious corpus: every case is refused, names its file and field, and has no effect.

Each case mutates a valid adapter directory. ``load_adapter`` must raise
``AdapterValidationError`` whose message names the file and the field; a push through the
CLI must exit 1 with one line on stderr, leave the fs and Redis stores exactly as they were,
and never create the sentinel file that unpickling the pickle payloads would create.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib
import pickle
import pickletools
import struct
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
import redis
import safetensors.torch
import torch

from loraplex.adapter_store import cli
from loraplex.adapter_store.adapter_files import write_upload
from loraplex.adapter_store.errors import AdapterValidationError
from loraplex.adapter_store.format import load_adapter

W, C = "adapter_model.safetensors", "adapter_config.json"
Q_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
Q_B = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"


class _Touch:
    """Unpickling this creates ``path``: the proof that something was unpickled."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (pathlib.Path.touch, (pathlib.Path(self.path),))


def pickle_payload(sentinel: Path) -> bytes:
    data = pickle.dumps({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight":
                         _Touch(sentinel)}, protocol=4)
    # Check the payload's opcodes, without running them: it would call Path.touch(sentinel).
    listing = " ".join(str(arg) for _, arg, _ in pickletools.genops(data))
    assert "Path.touch" in listing and sentinel.name in listing
    return data


def _cfg(d: Path, **changes: object) -> None:
    cfg = json.loads((d / C).read_text())
    cfg.update(changes)
    (d / C).write_text(json.dumps(cfg))


def _tensors(d: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    tensors = safetensors.torch.load_file(str(d / W))
    edit(tensors)
    (d / W).unlink()
    safetensors.torch.save_file(tensors, str(d / W))


def _raw_weights(d: Path, header: dict[str, object], data: bytes = b"",
                 header_len: int | None = None) -> None:
    raw = json.dumps(header).encode()
    n = len(raw) if header_len is None else header_len
    (d / W).write_bytes(struct.pack("<Q", n) + raw + data)


def _set(key: str, value: torch.Tensor) -> Callable[[dict[str, torch.Tensor]], None]:
    return lambda t: t.__setitem__(key, value)


def _symlink_weights(d: Path, ctx: SimpleNamespace) -> None:
    outside = ctx.tmp / "elsewhere.safetensors"
    os.replace(d / W, outside)
    (d / W).symlink_to(outside)


def _nan(d: Path, ctx: SimpleNamespace) -> None:
    def edit(t):
        t[Q_B] = t[Q_B].clone()
        t[Q_B][3, 1] = float("nan")
    _tensors(d, edit)


def _bf16_with_nan(t: dict[str, torch.Tensor]) -> None:
    for k in t:
        t[k] = t[k].to(torch.bfloat16)
    t[Q_B][0, 0] = float("nan")


# name -> (mutate(dir, ctx) -> load kwargs or None, file in the error, field in the error)
CASES: dict[str, tuple[Callable[[Path, SimpleNamespace], object], str, str]] = {
    "pickle-bin": (lambda d, c: ((d / W).unlink(), (d / "adapter_model.bin").write_bytes(
        pickle_payload(c.sentinel))), "adapter_model.bin", "never loaded"),
    "pickle-bin-beside-safetensors": (lambda d, c: (d / "pytorch_model.bin").write_bytes(
        pickle_payload(c.sentinel)), "pytorch_model.bin", "never loaded"),
    "pickle-named-safetensors": (lambda d, c: (d / W).write_bytes(pickle_payload(c.sentinel)),
                                 W, "header"),
    "pt-file": (lambda d, c: (d / "adapter.pt").write_bytes(b"PK\x03\x04"), "adapter.pt",
                "never loaded"),
    "gguf-file": (lambda d, c: (d / "adapter.gguf").write_bytes(b"GGUF"), "adapter.gguf",
                  "never loaded"),
    "code-file": (lambda d, c: (d / "modeling_evil.py").write_text("import os"),
                  "modeling_evil.py", "code"),
    "tokenizer-file": (lambda d, c: (d / "tokenizer.json").write_text("{}"),
                       "tokenizer.json", "tokenizer"),
    "unexpected-file": (lambda d, c: (d / "notes.txt").write_text("hi"), "notes.txt",
                        "unexpected"),
    "subdirectory": (lambda d, c: (d / "extra").mkdir(), "extra", "unexpected"),
    "auto-map": (lambda d, c: _cfg(d, auto_map={"AutoModel": "evil.Model"}), C, "auto_map"),
    "symlink-weights": (_symlink_weights, W, "symlink"),
    "symlink-config": (lambda d, c: ((d / C).unlink(), (d / C).symlink_to("/etc/passwd")),
                       C, "symlink"),
    "fifo-readme": (lambda d, c: ((d / "README.md").unlink(), os.mkfifo(d / "README.md")),
                    "README.md", "regular file"),
    "traversal-declared-name": (lambda d, c: {"declared_sha256": {
        "../adapter_model.safetensors": "0" * 64}}, "../adapter_model.safetensors", "file name"),
    "absolute-declared-name": (lambda d, c: {"declared_sha256": {"/etc/passwd": "0" * 64}},
                               "/etc/passwd", "file name"),
    "traversal-tensor-name": (lambda d, c: _tensors(d, _set(
        "base_model.model.model.layers.0/../../etc.lora_A.weight", torch.zeros(4, 32))),
        W, "tensor"),
    "declared-sha256-mismatch": (lambda d, c: {"declared_sha256": {
        p.name: ("f" * 64 if p.name == W else hashlib.sha256(p.read_bytes()).hexdigest())
        for p in d.iterdir()}}, W, "sha256"),
    "undeclared-file": (lambda d, c: {"declared_sha256": {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in d.iterdir()
        if p.name != "README.md"}}, "README.md", "sha256"),
    "nan-weight": (_nan, W, "layers.0.self_attn.q_proj.lora_B"),
    "inf-weight": (lambda d, c: _tensors(d, _set(Q_A, torch.full((4, 32), float("inf")))),
                   W, "layers.0.self_attn.q_proj.lora_A"),
    "neg-inf-weight": (lambda d, c: _tensors(d, _set(Q_A, torch.full((4, 32), -float("inf")))),
                       W, "layers.0.self_attn.q_proj.lora_A"),
    "nan-in-bf16": (lambda d, c: _tensors(d, _bf16_with_nan), W,
                    "layers.0.self_attn.q_proj.lora_B"),
    "wrong-shape-a": (lambda d, c: _tensors(d, _set(Q_A, torch.zeros(4, 33))), W,
                      "layers.0.self_attn.q_proj.lora_A"),
    "wrong-shape-b": (lambda d, c: _tensors(d, _set(Q_B, torch.zeros(31, 4))), W,
                      "layers.0.self_attn.q_proj.lora_B"),
    "3d-tensor": (lambda d, c: _tensors(d, _set(Q_A, torch.zeros(4, 32, 1))), W, "2-D"),
    "rank-differs-from-r": (lambda d, c: _cfg(d, r=8), W, "differs from r=8"),
    "r-zero": (lambda d, c: _cfg(d, r=0), C, "r"),
    "r-over-max-rank": (lambda d, c: _cfg(d, r=65), C, "r"),
    "r-not-int": (lambda d, c: _cfg(d, r=4.0), C, "r"),
    "alpha-nan": (lambda d, c: (d / C).write_text((d / C).read_text().replace(
        '"lora_alpha": 8', '"lora_alpha": NaN')), C, "lora_alpha"),
    "alpha-negative": (lambda d, c: _cfg(d, lora_alpha=-1), C, "lora_alpha"),
    "alpha-string": (lambda d, c: _cfg(d, lora_alpha="16"), C, "lora_alpha"),
    "dora": (lambda d, c: (_cfg(d, use_dora=True), _tensors(d, _set(
        "base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector",
        torch.ones(32)))), C, "use_dora"),
    "dora-tensors-without-flag": (lambda d, c: _tensors(d, _set(
        "base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector",
        torch.ones(32))), W, "lora_magnitude_vector"),
    "modules-to-save": (lambda d, c: _cfg(d, modules_to_save=["lm_head"]), C,
                        "modules_to_save"),
    "semantic-keys": (lambda d, c: _cfg(d, rank_pattern={"q_proj": 2}, alpha_pattern={"v": 1},
                                        layers_to_transform=[0], layers_pattern="layers",
                                        lora_bias=True), C,
                      "alpha_pattern, layers_pattern, layers_to_transform, lora_bias, "
                      "rank_pattern"),
    "bias-all": (lambda d, c: _cfg(d, bias="all"), C, "bias"),
    "unknown-config-key": (lambda d, c: _cfg(d, shiny_new_feature=True), C,
                           "shiny_new_feature"),
    "not-lora": (lambda d, c: _cfg(d, peft_type="PREFIX_TUNING"), C, "peft_type"),
    "duplicate-config-key": (lambda d, c: (d / C).write_text('{"peft_type": "LORA", "r": 4, '
                                                             '"r": 64}'), C, "duplicate"),
    "config-not-json": (lambda d, c: (d / C).write_bytes(b"\xff\xfe r=4"), C, "JSON"),
    "missing-config": (lambda d, c: (d / C).unlink(), C, "missing"),
    "missing-weights": (lambda d, c: (d / W).unlink(), W, "missing"),
    "unknown-module": (lambda d, c: _tensors(d, _set(
        "base_model.model.model.layers.0.mlp.fc1.lora_A.weight", torch.zeros(4, 32))),
        W, "mlp.fc1"),
    "module-in-wrong-block": (lambda d, c: _tensors(d, _set(
        "base_model.model.model.layers.0.mlp.q_proj.lora_A.weight", torch.zeros(4, 32))),
        W, "mlp.q_proj"),
    "lm-head-tensors": (lambda d, c: _tensors(d, _set("base_model.model.lm_head.lora_A.weight",
                                                      torch.zeros(4, 32))), W, "lm_head"),
    "layer-out-of-range": (lambda d, c: _tensors(d, lambda t: t.update({
        k.replace("layers.1.", "layers.7."): v.clone() for k, v in list(t.items())})), W,
        "layer 7"),
    "leading-zero-layer": (lambda d, c: _tensors(d, _set(Q_A.replace("layers.0", "layers.00"),
                                                         torch.zeros(4, 32))), W, "tensor"),
    "target-unknown-module": (lambda d, c: _cfg(d, target_modules=["q_proj", "embed_tokens"]),
                              C, "target_modules"),
    "targets-disagree": (lambda d, c: _cfg(d, target_modules=["q_proj", "v_proj", "k_proj"]),
                         C, "target_modules"),
    "missing-b-half": (lambda d, c: _tensors(d, lambda t: t.pop(Q_B)), W,
                       "layers.0.self_attn.q_proj.lora_B"),
    "missing-layer": (lambda d, c: _tensors(d, lambda t: [t.pop(k) for k in list(t)
                                                         if ".layers.1.self_attn.v" in k]),
                      W, "layers.1.self_attn.v_proj"),
    "no-tensors": (lambda d, c: _raw_weights(d, {"__metadata__": {"format": "pt"}}), W,
                   "tensors"),
    "float64-tensor": (lambda d, c: _tensors(d, _set(Q_A, torch.zeros(4, 32, dtype=torch.float64))),
                       W, "dtype"),
    "int-tensor": (lambda d, c: _tensors(d, _set(Q_A, torch.zeros(4, 32, dtype=torch.int64))),
                   W, "dtype"),
    "mixed-dtypes": (lambda d, c: _tensors(d, _set(Q_A, torch.zeros(4, 32, dtype=torch.float16))),
                     W, "differs"),
    "huge-header-length": (lambda d, c: _raw_weights(d, {}, header_len=1 << 62), W, "header"),
    "header-longer-than-file": (lambda d, c: _raw_weights(d, {}, header_len=1 << 20), W,
                                "header"),
    "huge-shape-claim": (lambda d, c: _raw_weights(d, {Q_A: {
        "dtype": "F32", "shape": [1 << 40, 1 << 40], "data_offsets": [0, 16]}}, b"\0" * 16),
        W, "shape"),
    "offsets-outside-file": (lambda d, c: _raw_weights(d, {Q_A: {
        "dtype": "F32", "shape": [4, 32], "data_offsets": [0, 512]}}, b"\0" * 16), W,
        "data_offsets"),
    "total-over-cap": (lambda d, c: {"max_bytes": 1000}, W, "size"),
    "truncated-weights": (lambda d, c: (d / W).write_bytes((d / W).read_bytes()[:-10]), W, ""),
}


@pytest.fixture
def ctx(tmp_path: Path) -> SimpleNamespace:
    return SimpleNamespace(tmp=tmp_path, sentinel=tmp_path / "SENTINEL-unpickled")


def _malicious_dir(case: str, make_adapter, ctx) -> tuple[Path, dict]:
    path = make_adapter("evil", rank=4)
    kwargs = CASES[case][0](path, ctx)
    return path, kwargs if isinstance(kwargs, dict) else {}


@pytest.mark.parametrize("case", CASES)
def test_refused_naming_file_and_field(case, make_adapter, base_config, ctx):
    path, kwargs = _malicious_dir(case, make_adapter, ctx)
    with pytest.raises(AdapterValidationError) as err:
        load_adapter(path, base_config, **kwargs)
    _, file, field = CASES[case]
    msg = str(err.value)
    assert msg.startswith(file) or f"{file!r}"[1:-1] in msg, msg
    assert field in msg, msg
    assert "\n" not in msg
    assert not ctx.sentinel.exists()


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else b"<dir>")
            for p in sorted(root.rglob("*"))}


@pytest.mark.parametrize("case", ["pickle-bin", "pickle-named-safetensors", "traversal-tensor-name",
                                  "nan-weight", "wrong-shape-a", "dora", "huge-header-length",
                                  "rank-differs-from-r", "unknown-module", "semantic-keys",
                                  "symlink-weights"])
def test_cli_push_refused_leaves_stores_unchanged(case, make_adapter, model_dir, tmp_path, ctx,
                                                  redis_url, capsys):
    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers())
    fs_root = tmp_path / "store"
    good = make_adapter("good", seed=1)
    client = redis.Redis.from_url(redis_url)
    for spec in (f"fs:{fs_root}", redis_url):
        args = parser.parse_args(["adapters", "push", str(good), "--name", "good", "--store",
                                  spec, "--model", str(model_dir), "--quiet"])
        assert args.func(args) == 0
    capsys.readouterr()
    before_fs = _snapshot(fs_root)
    before_redis = sorted(client.keys("*"))
    path, kwargs = _malicious_dir(case, make_adapter, ctx)
    for spec in (f"fs:{fs_root}", redis_url):
        args = parser.parse_args(["adapters", "push", str(path), "--name", "evil", "--store",
                                  spec, "--model", str(model_dir), "--quiet"])
        assert args.func(args) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("loraplex adapters push: "), err
    assert _snapshot(fs_root) == before_fs
    assert sorted(client.keys("*")) == before_redis
    assert not ctx.sentinel.exists()
    client.close()


def test_write_upload_refuses_traversal_and_absolute_names(tmp_path):
    staging = tmp_path / "upload"
    staging.mkdir()
    for name in ("../adapter_config.json", "/tmp/adapter_config.json", "a/b", "..", ".",
                 "adapter_config.json\0", "", "evil.bin"):
        with pytest.raises(AdapterValidationError):
            write_upload(staging, {"adapter_config.json": b"{}", name: b"x"})
    assert list(staging.iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["upload"]
    write_upload(staging, {"adapter_config.json": b"{}", "README.md": b"hi"})
    assert sorted(p.name for p in staging.iterdir()) == ["README.md", "adapter_config.json"]
