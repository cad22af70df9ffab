"""Chat messages over real gRPC: the worker renders them with the model's chat template,
streams the reply and stops at the template's end-of-turn token; the gateway bounds them; a
model without a template, or without a tokenizer at all, refuses what it cannot encode."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from safetensors.torch import load_file, save_file

from loraplex.server.api import ChatMessage, ChatMessages
from loraplex.server.client import ServiceError
from loraplex.server.engine.engine import Engine
from loraplex.server.engine.models.demo import IM_END, write_byte_tokenizer
from loraplex.server.engine.request import SamplingParams
from loraplex.server.engine.tokenizer import TOKENIZER_FILES
from loraplex.server.gateway_bounds import MAX_CHAT_MESSAGES
from tests.e2e.harness import Cluster, engine_config

QUESTION = [{"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "What is LoRA?"}]
CHAT = ChatMessages(tuple(ChatMessage(m["role"], m["content"]) for m in QUESTION))


def _offline(model: Path, params: SamplingParams,
             prompt: ChatMessages | list[int] = CHAT) -> list[int]:
    """Greedy tokens from an offline engine on ``model`` (the chat ``QUESTION`` by default)."""
    engine = Engine(engine_config(model))
    engine.add_request("ref", prompt, params)
    tokens: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens.extend(out.new_token_ids)
    return tokens


@pytest.fixture(scope="module")
def chat_model(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The e2e model, changed so that its greedy reply to ``QUESTION`` says ``<|im_end|>``
    after a few tokens: the output row of ``<|im_end|>`` becomes a scaled copy of that of a
    token it would otherwise pick a few steps in (random weights never end a turn by
    themselves)."""
    path = tmp_path_factory.mktemp("chat") / "model"
    shutil.copytree(model_dir, path)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    reply = _offline(path, params)
    original = load_file(str(path / "model.safetensors"))
    for target in dict.fromkeys(t for i, t in enumerate(reply) if i >= 2 and t not in reply[:i]):
        weights = {k: v.clone() for k, v in original.items()}
        weights["lm_head.weight"][IM_END] = 1.5 * weights["lm_head.weight"][target]
        save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
        changed = _offline(path, params)
        if IM_END in changed[2:] and IM_END not in changed[:2]:
            return path
    raise AssertionError(f"no token of {reply} makes the model end its turn")


def _cluster(model: Path, store: Path) -> Iterator[Cluster]:
    c = Cluster(model, store, gateway={"max_prompt_bytes": 4096})
    yield c
    c.close()


@pytest.fixture(scope="module")
def cluster(chat_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    yield from _cluster(chat_model, tmp_path_factory.mktemp("store"))


def test_chat_streams_the_reply_and_stops_at_end_of_turn(cluster: Cluster,
                                                         chat_model: Path) -> None:
    unbounded = _offline(chat_model, SamplingParams(max_tokens=24, ignore_eos=True))
    assert IM_END not in unbounded[:2] and IM_END in unbounded
    want = unbounded[:unbounded.index(IM_END) + 1]
    with cluster.client() as client:
        chunks = list(client.generate_stream(messages=QUESTION, max_tokens=24))
        tokens = [t for c in chunks for t in c.token_ids]
        assert tokens == want  # the reply, up to and including <|im_end|>
        assert len(chunks) >= 2 and chunks[-1].finish_reason == "stop"
        assert "<|im_end|>" not in "".join(c.text for c in chunks)
        # The prompt is the rendered template: system and user turns, then the assistant's.
        rendered = cluster.workers[0].engine.tokenizer
        assert rendered is not None
        prompt = rendered.apply_chat_template(CHAT.as_dicts())
        assert chunks[-1].usage is not None
        assert chunks[-1].usage.prompt_tokens == len(prompt)
        # ignore_eos also ignores the end of turn; the unary call gives the same reply.
        longer = client.generate(messages=QUESTION, max_tokens=24, ignore_eos=True)
        assert longer.token_ids == unbounded and longer.finish_reason == "length"
        assert client.generate(messages=[ChatMessage(**m) for m in QUESTION],
                               max_tokens=24).token_ids == want


@pytest.mark.parametrize(("messages", "field"), [
    ([{"role": "wizard", "content": "hi"}], "messages[0].role"),
    ([{"role": "user", "content": "hi"}, {"role": "", "content": "x"}], "messages[1].role"),
    ([{"role": "user", "content": "hi"}] * (MAX_CHAT_MESSAGES + 1), "messages: 513 messages"),
    ([{"role": "user", "content": "x" * 3000}, {"role": "user", "content": "y" * 2000}],
     "messages[1].content"),
    ([], "messages: must not be empty"),
])
def test_bad_messages_are_invalid_argument_naming_the_field(
        cluster: Cluster, messages: list[dict[str, str]], field: str) -> None:
    with cluster.client() as client, pytest.raises(ServiceError) as err:
        client.generate(messages=messages, max_tokens=2)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert field in err.value.message
    cluster.wait_idle()


@pytest.fixture(scope="module")
def plain_cluster(model_dir: Path, tmp_path_factory: pytest.TempPathFactory
                  ) -> Iterator[Cluster]:
    """The e2e model with a tokenizer but no chat template."""
    path = tmp_path_factory.mktemp("plain") / "model"
    shutil.copytree(model_dir, path)
    write_byte_tokenizer(path, chat_template=False)
    yield from _cluster(path, tmp_path_factory.mktemp("store"))


def test_a_model_without_a_chat_template_refuses_messages(plain_cluster: Cluster) -> None:
    with plain_cluster.client() as client:
        with pytest.raises(ServiceError) as err:
            client.generate(messages=QUESTION, max_tokens=2)
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "no chat template" in err.value.message
        assert len(client.generate("What is LoRA?", max_tokens=3).token_ids) == 3


@pytest.fixture(scope="module")
def bare_cluster(model_dir: Path, tmp_path_factory: pytest.TempPathFactory
                 ) -> Iterator[Cluster]:
    """The e2e model with no tokenizer files at all (weights and config.json only)."""
    path = tmp_path_factory.mktemp("bare") / "model"
    shutil.copytree(model_dir, path)
    for name in (*TOKENIZER_FILES, "tokenizer_config.json"):
        (path / name).unlink(missing_ok=True)
    yield from _cluster(path, tmp_path_factory.mktemp("store"))


def test_a_model_without_a_tokenizer_serves_token_ids_only(bare_cluster: Cluster,
                                                           model_dir: Path) -> None:
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    with bare_cluster.client() as client:
        out = client.generate([5, 17, 99, 3], params=params)
        assert out.token_ids == _offline(model_dir, params, [5, 17, 99, 3])
        assert len(out.token_ids) == 5 and out.text == ""
        for kwargs, field in (({"prompt": "Hello"}, "prompt"),
                              ({"messages": QUESTION}, "messages")):
            with pytest.raises(ServiceError) as err:
                client.generate(**kwargs, max_tokens=2)
            assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
            assert f"{field}: this model has no tokenizer" in err.value.message
