"""GGUF checkpoints (``--model PATH.gguf`` and the built-in ``smollm2``) -> a Hugging Face
folder, converted once into the cache directory and reused by every later start. The file's
``general.architecture`` must be ``llama`` (Llama, and Mistral as llama.cpp writes it) or
``qwen2``.

The dequantization is transformers' own (``from_pretrained(..., gguf_file=...)``, which also
undoes llama.cpp's q/k row permutation); this module only writes what it loaded as a plain
folder: ``model.safetensors`` (float32), ``config.json``, the tokenizer files with the chat
template, and ``generation_config.json``. Nothing is pickled, and the engine then loads the
folder like any other.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from loraplex.server import env

logger = logging.getLogger(__name__)

# Bump when the folder layout changes, so cached conversions are rebuilt.
CONVERSION_VERSION = 1
# ``general.architecture`` values whose dequantized weights fit models/llama.py and that
# transformers can read (llama.cpp writes Mistral models as "llama").
SUPPORTED_ARCHITECTURES = ("llama", "qwen2")
# Generic PretrainedConfig fields (and this machine's path) that to_dict() adds and a saved
# config.json does not need.
_CONFIG_NOISE = ("quantization_config", "_model_name_or_path", "_name_or_path",
                 "transformers_version", "id2label", "label2id", "problem_type",
                 "chunk_size_feed_forward", "output_hidden_states", "output_attentions",
                 "return_dict", "is_encoder_decoder")
_DONE = "model.safetensors"


def gguf_architecture(gguf_file: str | Path) -> str:
    """``general.architecture`` of a GGUF file, read from its header (memory-mapped).

    Raises:
        ValueError: the file is missing or is not a GGUF file.
    """
    import gguf

    path = Path(gguf_file)
    if not path.is_file():
        raise ValueError(f"--model {path}: no such GGUF file")
    try:
        reader = gguf.GGUFReader(str(path))
        field = reader.fields["general.architecture"]
    except (KeyError, ValueError, OSError, IndexError) as exc:
        raise ValueError(f"--model {path}: not a readable GGUF file ({exc})") from exc
    return str(field.contents())


def gguf_model_path(gguf_file: str | Path) -> Path:
    """The Hugging Face folder converted from ``gguf_file``, built on first use.

    The folder is keyed by the file's resolved path, size and modification time (and the
    conversion version), so a replaced file is converted again and an unchanged one never is.
    It is written to a temporary directory and renamed into place, so a crash or a second
    process never leaves a half-written folder behind.

    Raises:
        ValueError: the file is missing, not GGUF, or of an architecture the engine cannot run.
    """
    src = Path(gguf_file).resolve()
    path = _cache_path(src)
    if (path / _DONE).exists():
        return path
    arch = _supported_architecture(src)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".gguf-", dir=path.parent))
    try:
        # Shown at the default log level: the first start pauses here (about 20 s for SmolLM2).
        logger.warning("first use of %s: converting it (%s) once into %s", src.name, arch, path)
        convert_gguf(src, tmp)
        try:
            os.rename(tmp, path)
        except OSError:  # another process converted it first
            if not (path / _DONE).exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def gguf_config(gguf_file: str | Path) -> dict:
    """The model's Hugging Face ``config.json`` as a dict, without converting the weights:
    the converted folder's when it exists, else parsed from the GGUF header (metadata and
    tensor names only: seconds, and little memory). What a gateway needs to check uploads.

    Raises:
        ValueError: as ``gguf_model_path``.
    """
    src = Path(gguf_file).resolve()
    path = _cache_path(src)
    if (path / _DONE).exists():
        with open(path / "config.json", encoding="utf-8") as f:
            return dict(json.load(f))
    _supported_architecture(src)
    from transformers import AutoConfig

    return _clean_config(AutoConfig.from_pretrained(str(src.parent), gguf_file=src.name)
                         .to_dict())


def convert_gguf(src: Path, out: Path) -> None:
    """Dequantize ``src`` with transformers and write a Hugging Face folder into ``out``.

    A model loaded from GGUF refuses ``save_pretrained``, so the tensors are written here (the
    tied ``lm_head`` is left out: the loader reuses the embedding).
    """
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    model = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name,
                                                 dtype=torch.float32)
    config = _clean_config(model.config.to_dict())
    config["architectures"] = [type(model).__name__]
    config["torch_dtype"] = "float32"
    tied = bool(config.get("tie_word_embeddings"))
    tensors = {name: t.detach().contiguous() for name, t in model.state_dict().items()
               if "rotary_emb" not in name and not (tied and name == "lm_head.weight")}
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / _DONE), metadata={"format": "pt"})
    with open(out / "config.json", "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    model.generation_config.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    _portable_tokenizer_config(out, tokenizer.chat_template,
                               config.get("max_position_embeddings"))
    with open(out / "gguf_source.json", "w", encoding="utf-8") as f:
        json.dump({"gguf_file": str(src), "size": src.stat().st_size,
                   "conversion_version": CONVERSION_VERSION}, f, indent=2)


def _supported_architecture(src: Path) -> str:
    arch = gguf_architecture(src)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"--model {src}: GGUF architecture {arch!r} is not one of "
                         f"{list(SUPPORTED_ARCHITECTURES)}")
    return arch


def _clean_config(config: dict) -> dict:
    return {k: v for k, v in config.items() if k not in _CONFIG_NOISE}


def _portable_tokenizer_config(out: Path, template: str | None, max_len: int | None) -> None:
    # transformers 5 writes its own class name, this machine's loading flags and no length
    # limit; the folder should read the same under transformers 4 and elsewhere. It also
    # writes the template to chat_template.jinja only: older readers (and tools that look only
    # at tokenizer_config.json) find it in the config as well.
    config_file = out / "tokenizer_config.json"
    config = json.loads(config_file.read_text(encoding="utf-8"))
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    for key in ("is_local", "local_files_only", "backend"):
        config.pop(key, None)
    if max_len:
        config["model_max_length"] = int(max_len)
    if template:
        config.setdefault("chat_template", template)
    config_file.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def _cache_path(src: Path) -> Path:
    st = src.stat() if src.exists() else None
    ident = f"{CONVERSION_VERSION}\0{src}\0{st.st_size if st else -1}\0" \
            f"{st.st_mtime_ns if st else -1}"
    key = hashlib.sha256(ident.encode()).hexdigest()[:16]
    return env.cache_dir() / "gguf" / f"{src.stem}-{key}"
