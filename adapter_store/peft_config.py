"""``adapter_config.json``: PEFT's LoraConfig, read as JSON against an allowlist of keys.

Every key PEFT writes falls in one of three groups:

* used: ``peft_type`` (must be ``LORA``), ``r``, ``lora_alpha``, ``use_rslora``,
  ``target_modules``;
* ignored: bookkeeping and training-time settings that do not change what a loaded adapter
  computes (dropout, initialisation, versions, ...);
* semantic: settings that change the computation (DoRA, per-layer ranks, biases, extra
  trainable modules, ...). We do not implement them, so each is accepted only at its neutral
  value and the error lists every one that is not.

Any other key is refused: an allowlist, not a blocklist, so a new PEFT feature cannot slip
through as "probably harmless".
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any, NoReturn

from loraplex.adapter_store.errors import AdapterValidationError
from loraplex.server.engine.models.config import LORA_MODULES

CONFIG_FILE = "adapter_config.json"
MAX_CONFIG_BYTES = 1 << 20

# PEFT's LoraConfig defaults, used when a key is absent (PEFT would use them too).
_DEFAULT_R = 8
_DEFAULT_ALPHA = 8

# (``astra_config``, peft 0.22, is an initialisation's settings, as ``corda_config`` and
# ``eva_config`` are: the saved A and B are what a loaded adapter computes with)
_IGNORED = frozenset({
    "astra_config", "auto_mapping", "base_model_name_or_path", "corda_config",
    "ensure_weight_tying", "eva_config", "inference_mode", "init_lora_weights", "loftq_config",
    "lora_dropout", "lora_ga_config", "megatron_core", "peft_version", "qalora_group_size",
    "revision", "task_type",
})

# key -> the values that mean "feature off".
_SEMANTIC_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "alora_invocation_tokens": (None, []),
    "alpha_pattern": (None, {}),
    "arrow_config": (None,),
    "bias": ("none",),
    "exclude_modules": (None, []),
    "fan_in_fan_out": (False,),
    "kasa_config": (None,),
    "layer_replication": (None, []),
    "layers_pattern": (None, [], ""),
    "layers_to_transform": (None, []),
    "lora_bias": (False,),
    "megatron_config": (None,),
    "modules_to_save": (None, []),
    "monteclora_config": (None,),
    "rank_pattern": (None, {}),
    "target_parameters": (None, []),
    "trainable_token_indices": (None, [], {}),
    "use_bdlora": (None, False),
    "use_dora": (False,),
    "use_qalora": (False,),
    "velora_config": (None,),
}
_USED = frozenset({"peft_type", "r", "lora_alpha", "use_rslora", "target_modules"})
_MODULE_ENTRY = re.compile(r"(?:[A-Za-z0-9_]+\.)*([A-Za-z0-9_]+)")


@dataclass(frozen=True)
class LoraSettings:
    """What ``adapter_config.json`` says about the computation.

    Attributes:
        rank: ``r``.
        lora_alpha: as a float.
        use_rslora: scale by ``alpha / sqrt(r)`` instead of ``alpha / r``.
        target_modules: the listed targets in ``LORA_MODULES`` order, or ``None`` when the
            config gives a regular expression or nothing (the tensors then define the targets).
    """

    rank: int
    lora_alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...] | None


def parse_adapter_config(data: bytes, *, max_rank: int) -> LoraSettings:
    """Parse and check ``adapter_config.json``.

    Args:
        data: the file's bytes (at most ``MAX_CONFIG_BYTES``).
        max_rank: the largest ``r`` accepted.

    Returns:
        The settings that determine the adapter's computation.

    Raises:
        AdapterValidationError: naming ``adapter_config.json`` and the offending field(s).
    """
    cfg = _parse_json(data)
    if "auto_map" in cfg:
        _fail("auto_map", "remote code is not allowed")
    unknown = sorted(k for k in cfg if k not in _USED and k not in _IGNORED
                     and k not in _SEMANTIC_NEUTRAL)
    if unknown:
        _fail(", ".join(unknown), "unknown keys (not in the LoraConfig allowlist)")
    if cfg.get("peft_type") != "LORA":
        _fail("peft_type", f"must be 'LORA', got {cfg.get('peft_type')!r}")
    semantic = [f"{k}={json.dumps(cfg[k])[:60]}" for k in sorted(_SEMANTIC_NEUTRAL)
                if k in cfg and not _is_neutral(cfg[k], _SEMANTIC_NEUTRAL[k])]
    if semantic:
        _fail(", ".join(k.split("=")[0] for k in semantic),
              f"settings that change the computation are not supported: {'; '.join(semantic)}")

    r = cfg.get("r", _DEFAULT_R)
    if not _is_int(r) or not 1 <= r <= max_rank:
        _fail("r", f"must be an integer in [1, {max_rank}], got {r!r}")
    alpha = cfg.get("lora_alpha", _DEFAULT_ALPHA)
    if not _is_number(alpha) or not math.isfinite(alpha) or alpha <= 0:
        _fail("lora_alpha", f"must be a finite positive number, got {alpha!r}")
    use_rslora = cfg.get("use_rslora", False)
    if not isinstance(use_rslora, bool):
        _fail("use_rslora", f"must be true or false, got {use_rslora!r}")
    return LoraSettings(rank=r, lora_alpha=float(alpha), use_rslora=use_rslora,
                        target_modules=_target_modules(cfg.get("target_modules")))


def _target_modules(value: Any) -> tuple[str, ...] | None:
    if value is None:
        return None
    if isinstance(value, str):
        # "all-linear" is every linear layer but the output head: all seven for this family.
        # Any other string is a regular expression; we never evaluate user regexes (ReDoS):
        # the tensors define the targets and each must still be a known module.
        return LORA_MODULES if value == "all-linear" else None
    if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
        _fail("target_modules", f"must be a non-empty list of module names, got {value!r:.80}")
    found = set()
    for entry in value:
        m = _MODULE_ENTRY.fullmatch(entry)
        if m is None or m.group(1) not in LORA_MODULES:
            _fail("target_modules", f"{entry!r:.80} matches no module of the base model "
                  f"(known: {', '.join(LORA_MODULES)})")
        found.add(m.group(1))
    return tuple(mod for mod in LORA_MODULES if mod in found)


def _parse_json(data: bytes) -> dict[str, Any]:
    if len(data) > MAX_CONFIG_BYTES:
        _fail("", f"{len(data)} bytes, over the {MAX_CONFIG_BYTES}-byte limit")
    try:
        cfg = json.loads(data.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        _fail("", f"not valid UTF-8 JSON ({str(e)[:80]})")
    except _DuplicateKey as e:
        _fail(str(e), "duplicate key")
    if not isinstance(cfg, dict):
        _fail("", "must be a JSON object")
    return cfg


class _DuplicateKey(Exception):
    pass


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # Two parsers reading one file must see one config: a repeated key could mean either.
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise _DuplicateKey(k)
        out[k] = v
    return out


def _is_neutral(value: Any, neutral: tuple[Any, ...]) -> bool:
    # Compare JSON types too: 0 is not false.
    return any(type(value) is type(n) and value == n for n in neutral)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _fail(field: str, reason: str) -> NoReturn:
    raise AdapterValidationError(CONFIG_FILE, field, reason)
