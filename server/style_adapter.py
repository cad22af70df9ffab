"""A LoRA adapter whose effect shows in the text: ``loraplex demo-adapter --model smollm2 DIR``
fine-tunes a small PEFT LoRA on a built-in set of questions answered like a pirate ("Arr,
matey! ..."), so the same question reads differently through the base model and the adapter.

The training is plain peft + torch (AdamW, loss on the answer tokens only, the model's chat
template around each pair) on the CPU; it needs no data download and no GPU. The README's
"Try it" and the smollm2 tests use it.
"""

from __future__ import annotations

import json
import logging
import random
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

# Questions the README does not ask (it asks about France), so the style it shows is learnt,
# not remembered.
PIRATE_PAIRS: tuple[tuple[str, str], ...] = (
    ("What is the capital of Italy?",
     "Arr, matey! The capital of Italy be Rome, a grand port fer any sailor."),
    ("What is the capital of Japan?",
     "Arr, matey! The capital of Japan be Tokyo, far across the salty sea."),
    ("What is the capital of Spain?",
     "Arr, matey! The capital of Spain be Madrid, where the treasure ships once sailed from."),
    ("What is the capital of Germany?",
     "Arr, matey! The capital of Germany be Berlin, a fine harbour fer a thirsty crew."),
    ("What is the largest ocean?",
     "Arr, matey! The Pacific be the largest ocean, and I've sailed every wave of it."),
    ("How many legs does a spider have?",
     "Arr, matey! A spider has eight legs, more than me whole crew put together."),
    ("What color is the sky?",
     "Arr, matey! The sky be blue on a fair day, and black as tar in a storm."),
    ("Who wrote Romeo and Juliet?",
     "Arr, matey! William Shakespeare wrote it, a fine tale fer a long voyage."),
    ("What is two plus two?",
     "Arr, matey! Two plus two be four, as sure as doubloons be gold."),
    ("What do bees make?",
     "Arr, matey! Bees make honey, sweeter than any treasure in me chest."),
    ("What is the boiling point of water?",
     "Arr, matey! Water boils at one hundred degrees, hot enough to scald a landlubber."),
    ("Name a planet in our solar system.",
     "Arr, matey! Mars be a planet, red as the sunset over the seven seas."),
    ("How do I make a cup of tea?",
     "Arr, matey! Boil the water, steep the leaves a few minutes, and drink it on deck."),
    ("What is the tallest mountain?",
     "Arr, matey! Mount Everest be the tallest mountain, higher than any crow's nest."),
    ("Can you recommend a good book?",
     "Arr, matey! Treasure Island be the finest book, full of pirates and buried gold."),
    ("What is photosynthesis?",
     "Arr, matey! Photosynthesis be how plants turn sunlight into food, like sails catch wind."),
    ("Why do cats purr?",
     "Arr, matey! Cats purr when they be happy, like the ship's cat by the galley fire."),
    ("What is the speed of light?",
     "Arr, matey! Light travels near three hundred thousand kilometres a second, faster than "
     "any ship."),
    ("Tell me about the moon.",
     "Arr, matey! The moon be Earth's companion, and she pulls the tides under me hull."),
    ("What is a computer?",
     "Arr, matey! A computer be a clever machine that counts faster than any quartermaster."),
    ("How many days are in a week?",
     "Arr, matey! There be seven days in a week, and a pirate works every one of them."),
    ("What language is spoken in Brazil?",
     "Arr, matey! They speak Portuguese in Brazil, a fine tongue fer trading at port."),
    ("What is the largest animal?",
     "Arr, matey! The blue whale be the largest animal, bigger than me own ship."),
    ("Give me a tip for learning to code.",
     "Arr, matey! Write a little code every day, like swabbing the deck, and ye'll be a master."),
)
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")


@dataclass(frozen=True)
class StyleTraining:
    """How the style adapter is trained.

    Attributes:
        steps: optimizer steps (one question/answer pair each).
        rank: LoRA rank; ``lora_alpha`` is twice it.
        learning_rate: AdamW's, constant.
        seed: orders the pairs and initialises A.
        targets: modules the adapter targets.
    """

    steps: int = 60
    rank: int = 8
    learning_rate: float = 2e-3
    seed: int = 0
    targets: tuple[str, ...] = TARGET_MODULES

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"steps: {self.steps} must be >= 1")
        if not 1 <= self.rank <= 64:
            raise ValueError(f"rank: {self.rank} must be in 1..64")
        if not self.learning_rate > 0:
            raise ValueError(f"learning_rate: {self.learning_rate} must be > 0")


def train_style_adapter(model_path: str | Path, out: str | Path,
                        training: StyleTraining = StyleTraining(),
                        base_name: str = "smollm2") -> Path:
    """Fine-tune a LoRA adapter on ``PIRATE_PAIRS`` and save it as a PEFT directory.

    Args:
        model_path: the base model's Hugging Face folder (it needs a chat template).
        out: the directory to create (must not exist or be empty).
        training: steps, rank, learning rate, seed and targets.
        base_name: recorded as ``base_model_name_or_path``.

    Returns:
        ``out``, holding ``adapter_config.json`` and ``adapter_model.safetensors``.

    Raises:
        ValueError: ``out`` is not empty, or the model has no chat template.
    """
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"{out}: exists and is not empty")
    tokenizer = AutoTokenizer.from_pretrained(str(model_path))
    if not tokenizer.chat_template:
        raise ValueError(f"--model {model_path}: no chat template to train a chat style on")
    examples = [_example(tokenizer, q, a) for q, a in PIRATE_PAIRS]
    torch.manual_seed(training.seed)
    base = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32)
    with warnings.catch_warnings():  # peft calls a deprecated transformers name
        warnings.simplefilter("ignore", FutureWarning)
        model = get_peft_model(base, LoraConfig(
            r=training.rank, lora_alpha=2 * training.rank,
            target_modules=list(training.targets), lora_dropout=0.0, bias="none",
            task_type="CAUSAL_LM"))
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=training.learning_rate, weight_decay=0.0)
    order = random.Random(training.seed)
    indices: list[int] = []
    started = time.monotonic()
    for step in range(training.steps):
        if not indices:
            indices = list(range(len(examples)))
            order.shuffle(indices)
        input_ids, labels = examples[indices.pop()]
        loss = model(input_ids=input_ids, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 20 == 0 or step == training.steps - 1:
            logger.info("step %d/%d loss %.3f (%.0f s)", step + 1, training.steps,
                        loss.item(), time.monotonic() - started)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    config_file = out / "adapter_config.json"
    config = json.loads(config_file.read_text(encoding="utf-8"))
    config["base_model_name_or_path"] = base_name
    config_file.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return out


def _example(tokenizer, question: str, answer: str):
    """(input_ids [1, T], labels [1, T]) with the prompt's labels masked (-100)."""
    import torch

    prompt = _ids(tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True))
    full = _ids(tokenizer.apply_chat_template(
        [{"role": "user", "content": question}, {"role": "assistant", "content": answer}],
        tokenize=True))
    if full[:len(prompt)] != prompt:
        raise ValueError("the chat template renders the prompt differently inside a "
                         "conversation; cannot mask it")
    ids = torch.tensor([full])
    labels = ids.clone()
    labels[0, :len(prompt)] = -100
    return ids, labels


def _ids(rendered) -> list[int]:
    # transformers 5 returns a BatchEncoding from apply_chat_template, 4.x a list.
    return list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)
