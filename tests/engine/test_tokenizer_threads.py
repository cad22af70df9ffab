"""Text prompts encoded on many threads while the engine thread decodes (issue 13, finding 7):
each thread has its own tokenizer, so a fast tokenizer never raises "Already borrowed"."""

from __future__ import annotations

import shutil
import threading
import time

from tokenizers import Tokenizer as RustTokenizer

from loraplex.server.config import EngineConfig, SchedulerConfig
from loraplex.server.engine.engine import Engine
from loraplex.server.engine.request import SamplingParams
from loraplex.server.engine.tokenizer import Tokenizer


def test_concurrent_text_requests_while_the_engine_decodes(tiny_llama, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_llama, model)
    # Truncation and padding saved in tokenizer.json: transformers turns them off on the
    # first call of each instance, a mutation of the Rust object that races with any other
    # thread's use of the same instance.
    rust = RustTokenizer.from_file(str(model / "tokenizer.json"))
    rust.enable_truncation(max_length=512)
    rust.enable_padding(pad_id=258, pad_token="<pad>")
    rust.save(str(model / "tokenizer.json"))
    engine = Engine(EngineConfig(model=str(model), num_pages=256,
                                 scheduler=SchedulerConfig(page_size=4)))
    reference = Tokenizer(model)
    texts = [f"request {i}: " + "the quick brown fox " * (1 + i % 5) for i in range(48)]
    expected = {f"t{i}": reference.encode(t) for i, t in enumerate(texts)}

    finished: dict[str, object] = {}
    errors: list[str] = []
    stop = threading.Event()

    def engine_thread() -> None:
        try:
            while not stop.is_set():
                for out in engine.step():
                    if out.finished:
                        finished[out.request_id] = out
                if not engine.has_unfinished():
                    time.sleep(0.001)
        except Exception as exc:  # the engine must never die of a tokenizer race
            errors.append(f"engine: {exc!r}")

    def client(offset: int) -> None:
        for i in range(offset, len(texts), 8):
            try:
                req = engine.add_request(f"t{i}", texts[i], SamplingParams(
                    max_tokens=6, temperature=1.0, seed=i, ignore_eos=True))
                if req.prompt_token_ids != expected[f"t{i}"]:
                    errors.append(f"t{i}: encoded {req.prompt_token_ids}")
            except Exception as exc:
                errors.append(f"t{i}: {exc!r}")

    runner = threading.Thread(target=engine_thread)
    runner.start()
    clients = [threading.Thread(target=client, args=(k,)) for k in range(8)]
    try:
        for c in clients:
            c.start()
        for c in clients:
            c.join(60)
        deadline = time.monotonic() + 60
        while len(finished) < len(texts) and not errors and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        stop.set()
        runner.join(10)
    assert errors == []
    assert len(finished) == len(texts)
    assert all(out.error is None and out.finish_reason == "length"
               for out in finished.values())
    assert all(out.new_text is not None for out in finished.values())

    # Each thread encodes and decodes with its own instance: the race above needs a mutation
    # to meet another thread's call, which one shared instance allows at any time (and which
    # transformers does on an instance's first call, so a stress run rarely catches it).
    seen: list[object] = []

    def other_thread() -> None:
        try:
            seen.append(engine.tokenizer.for_this_thread())
        except Exception as exc:
            seen.append(exc)

    t = threading.Thread(target=other_thread)
    t.start()
    t.join()
    assert not isinstance(seen[0], Exception), seen[0]
    assert seen[0] is not engine.tokenizer.for_this_thread()
