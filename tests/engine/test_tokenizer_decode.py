"""``Tokenizer.decode`` (the detokenizer's call, twice a token of every request) calls the fast
tokenizer's Rust decode directly where that is exactly what transformers' ``decode`` would do,
and transformers' ``decode`` where the tokenizer cleans up tokenization spaces."""

from __future__ import annotations

import json
import random
import shutil

import pytest
from transformers import AutoTokenizer

from loraplex.server.engine.tokenizer import Tokenizer


def _id_lists(tok, count: int = 400) -> list[list[int]]:
    rng = random.Random(0)
    vocab = len(tok)
    special = list(tok.all_special_ids)
    lists = [[rng.randrange(vocab) for _ in range(rng.randrange(0, 9))] for _ in range(count)]
    lists += [[*ids[:2], rng.choice(special), *ids[2:]] for ids in lists[:50] if special]
    return lists


@pytest.mark.parametrize("clean_up", [False, True])
def test_decode_is_transformers_decode(tiny_llama, tmp_path, clean_up):
    model = tmp_path / "model"
    shutil.copytree(tiny_llama, model)
    config_path = model / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.exists() else {}
    config["clean_up_tokenization_spaces"] = clean_up
    config_path.write_text(json.dumps(config))
    ours = Tokenizer(model)
    hf = AutoTokenizer.from_pretrained(str(model))
    assert hf.clean_up_tokenization_spaces is clean_up
    # the direct call only where transformers would add nothing to it
    assert ours._backend_decode is (not clean_up)
    for ids in _id_lists(hf):
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True), ids
