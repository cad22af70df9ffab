"""A PEFT LoRA adapter directory -> a validated, canonical adapter named by its content.

Identity (design.md §3): an adapter's ``digest`` is

    sha256( u64le(len(header)) || header || A_0,m0 || B_0,m0 || A_0,m1 || ... )

where ``header`` is compact, key-sorted JSON of the format version, ``r``, ``lora_alpha``, the
effective scale, ``use_rslora``, the target modules (``LORA_MODULES`` order), the dtype and the
base model's dimensions, followed by every tensor's raw little-endian bytes in canonical order
(layer, then module in ``LORA_MODULES`` order, then ``A`` before ``B``), in the dtype it was
uploaded in. Anything that changes outputs changes the digest; file layout, tensor order in the
file, and bookkeeping keys of the config do not.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import NoReturn

import torch

from loraplex.adapter_store.adapter_files import WEIGHTS_FILE, read_adapter_files
from loraplex.adapter_store.errors import AdapterValidationError
from loraplex.adapter_store.peft_config import CONFIG_FILE, parse_adapter_config
from loraplex.adapter_store.safetensors_header import MAX_HEADER_BYTES, load_safetensors
from loraplex.server.engine.models.config import LORA_MODULES, ModelConfig

__all__ = [
    "FORMAT_VERSION", "AdapterValidationError", "CanonicalAdapter", "build_adapter",
    "canonical_header", "compute_digest", "effective_scale", "load_adapter", "peft_key",
]

FORMAT_VERSION = 1
DEFAULT_MAX_RANK = 64
DEFAULT_MAX_BYTES = 2 << 30  # 2 GiB: rank 64 on all seven modules of a 70B model fits
DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16",
}
MODULE_GROUPS: dict[str, str] = {
    "q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
    "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp",
}
_PEFT_KEY = re.compile(r"base_model\.model\.model\.layers\.(0|[1-9][0-9]{0,5})\."
                       r"([A-Za-z0-9_]+)\.([A-Za-z0-9_]+)\.lora_(A|B)\.weight")
_PEFT_KEY_FORM = "base_model.model.model.layers.<i>.<self_attn|mlp>.<module>.lora_<A|B>.weight"

Weights = Mapping[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True, eq=False)
class CanonicalAdapter:
    """A validated LoRA adapter, named by its digest. Treat the tensors as read-only.

    Attributes:
        digest: hex sha256 (64 chars) of the canonical header and tensors.
        rank: ``r``.
        lora_alpha: as configured.
        use_rslora: whether the scale is ``alpha / sqrt(r)``.
        scale: the effective scaling, ``alpha / r`` or ``alpha / sqrt(r)``.
        target_modules: subset of ``LORA_MODULES``, in that order.
        dtype: float32, float16 or bfloat16, as uploaded.
        num_layers: the base model's layer count (every layer holds every target).
        weights: ``(layer, module) -> (A [r, d_in], B [d_out, r])``, PEFT shapes, contiguous
            CPU tensors, in canonical order.
        base_dims: sorted items of the base model's ``dims_key()``.
    """

    digest: str
    rank: int
    lora_alpha: float
    use_rslora: bool
    scale: float
    target_modules: tuple[str, ...]
    dtype: torch.dtype
    num_layers: int
    weights: Weights = field(repr=False)
    base_dims: tuple[tuple[str, int], ...] = ()

    @property
    def nbytes(self) -> int:
        """Bytes of all tensors."""
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())

    def header(self) -> bytes:
        """The canonical header this adapter's digest starts with."""
        return canonical_header(rank=self.rank, lora_alpha=self.lora_alpha,
                                use_rslora=self.use_rslora, target_modules=self.target_modules,
                                dtype=self.dtype, base_dims=dict(self.base_dims))

    def tensors(self) -> Iterator[torch.Tensor]:
        """Every tensor in canonical order: layer, module, ``A`` then ``B``."""
        for layer in range(self.num_layers):
            for module in self.target_modules:
                a, b = self.weights[(layer, module)]
                yield a
                yield b

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CanonicalAdapter):
            return NotImplemented
        return self.digest == other.digest

    def __hash__(self) -> int:
        return hash(self.digest)


def effective_scale(lora_alpha: float, rank: int, use_rslora: bool) -> float:
    """PEFT's scaling, computed with the same float operations PEFT uses."""
    return lora_alpha / math.sqrt(rank) if use_rslora else lora_alpha / rank


def peft_key(layer: int, module: str, half: str) -> str:
    """The PEFT state-dict key of ``A`` or ``B`` (``half``) of one module in one layer."""
    group = MODULE_GROUPS[module]
    return f"base_model.model.model.layers.{layer}.{group}.{module}.lora_{half}.weight"


def canonical_header(*, rank: int, lora_alpha: float, use_rslora: bool,
                     target_modules: tuple[str, ...], dtype: torch.dtype,
                     base_dims: Mapping[str, int]) -> bytes:
    """The header bytes that open an adapter's digest (compact, key-sorted JSON)."""
    doc = {
        "format_version": FORMAT_VERSION,
        "r": rank,
        "lora_alpha": float(lora_alpha),
        "scale": effective_scale(float(lora_alpha), rank, use_rslora),
        "use_rslora": use_rslora,
        "target_modules": list(target_modules),
        "dtype": DTYPE_NAMES[dtype],
        "base_dims": dict(base_dims),
    }
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A contiguous tensor's raw bytes, without a copy."""
    return t.reshape(-1).view(torch.uint8).numpy().data


def compute_digest(header: bytes, tensors: Iterator[torch.Tensor]) -> str:
    """``sha256(u64le(len(header)) || header || tensor bytes...)`` as hex."""
    h = hashlib.sha256(len(header).to_bytes(8, "little"))
    h.update(header)
    for t in tensors:
        h.update(tensor_bytes(t))
    return h.hexdigest()


def build_adapter(weights: Weights, *, rank: int, lora_alpha: float, base_config: ModelConfig,
                  use_rslora: bool = False, file: str = WEIGHTS_FILE) -> CanonicalAdapter:
    """Validate LoRA weights against a base model and name them by digest.

    Also the way to make adapters in memory (engine tests, generated benchmarks).

    Args:
        weights: ``(layer, module) -> (A [r, d_in], B [d_out, r])``; every target module must
            be present in every layer, all in one dtype.
        rank: ``r``; every ``A`` and ``B`` must have it.
        lora_alpha: finite, positive.
        base_config: the base model the adapter must fit.
        use_rslora: rank-stabilised scaling.
        file: the file name errors name.

    Returns:
        The canonical adapter (tensors made contiguous on CPU, dtype unchanged).

    Raises:
        AdapterValidationError: naming the file and the tensor's PEFT key.
    """
    if not math.isfinite(lora_alpha) or lora_alpha <= 0:
        _fail(CONFIG_FILE, "lora_alpha", f"must be a finite positive number, got {lora_alpha}")
    if not weights:
        _fail(file, "tensors", "no LoRA tensors (zero modules of the base model matched)")
    shapes = base_config.module_shapes()
    num_layers = base_config.num_layers
    dtype = next(iter(weights.values()))[0].dtype  # all tensors must share it
    for (layer, module), (a, b) in weights.items():
        if module not in shapes:
            _fail(file, f"module {module!r:.60}", "matches no module of the base model")
        if not 0 <= layer < num_layers:
            _fail(file, f"layer {layer}", f"does not exist (the base model has {num_layers})")
        d_in, d_out = shapes[module]
        for half, t, want in (("A", a, (rank, d_in)), ("B", b, (d_out, rank))):
            key = peft_key(layer, module, half)
            if t.dtype not in DTYPE_NAMES:
                _fail(file, key, f"dtype {t.dtype} is not float32, float16 or bfloat16")
            if t.dtype != dtype:
                _fail(file, key, f"dtype {t.dtype} differs from {dtype} (one dtype per adapter)")
            if t.dim() != 2:
                _fail(file, key, f"shape {list(t.shape)} is not 2-D")
            got_rank = t.shape[0] if half == "A" else t.shape[1]
            if got_rank != rank:
                _fail(file, key, f"rank {got_rank} differs from r={rank} in {CONFIG_FILE}")
            if tuple(t.shape) != want:
                _fail(file, key, f"shape {list(t.shape)} does not fit the base model "
                      f"(expected {list(want)})")
    present = {module for _, module in weights}
    targets = tuple(m for m in LORA_MODULES if m in present)
    for module in targets:
        for layer in range(num_layers):
            if (layer, module) not in weights:
                _fail(file, peft_key(layer, module, "A"), "missing: every target module needs "
                      "weights in every layer (layers_to_transform is not supported)")
    canonical = {}
    for layer in range(num_layers):
        for module in targets:
            a, b = weights[(layer, module)]
            for half, t in (("A", a), ("B", b)):
                # amax propagates NaN, abs folds -inf: one fast pass, no [r, d] bool mask.
                if not bool(torch.isfinite(t.abs().amax())):
                    _fail(file, peft_key(layer, module, half), "holds NaN or Inf values")
            canonical[(layer, module)] = (a.detach().cpu().contiguous(),
                                          b.detach().cpu().contiguous())
    base_dims = tuple(sorted(base_config.dims_key().items()))
    header = canonical_header(rank=rank, lora_alpha=lora_alpha, use_rslora=use_rslora,
                              target_modules=targets, dtype=dtype, base_dims=dict(base_dims))
    adapter = CanonicalAdapter(
        digest="", rank=rank, lora_alpha=float(lora_alpha), use_rslora=use_rslora,
        scale=effective_scale(float(lora_alpha), rank, use_rslora), target_modules=targets,
        dtype=dtype, num_layers=num_layers, weights=MappingProxyType(canonical),
        base_dims=base_dims)
    object.__setattr__(adapter, "digest", compute_digest(header, adapter.tensors()))
    return adapter


def load_adapter(path: str | os.PathLike[str], base_config: ModelConfig, *,
                 max_rank: int = DEFAULT_MAX_RANK, max_bytes: int = DEFAULT_MAX_BYTES,
                 declared_sha256: Mapping[str, str] | None = None) -> CanonicalAdapter:
    """Read, validate and canonicalise a PEFT LoRA adapter directory.

    Nothing is unpickled and no code runs: weights are safetensors only, the config is JSON
    read against an allowlist (``peft_config.py``), and sizes are checked before allocation.

    Args:
        path: a directory with ``adapter_config.json`` and ``adapter_model.safetensors`` (and
            optionally ``README.md``).
        base_config: the base model the adapter must fit.
        max_rank: the largest ``r`` accepted.
        max_bytes: the largest total tensor size accepted.
        declared_sha256: the sha256 the client declared for each file it sent, if any.

    Returns:
        The canonical adapter; ``digest`` names it.

    Raises:
        AdapterValidationError: the upload is refused; the message names file and field.
    """
    files = read_adapter_files(path, max_weights_bytes=max_bytes + 8 + MAX_HEADER_BYTES,
                               declared_sha256=declared_sha256)
    settings = parse_adapter_config(files.config, max_rank=max_rank)
    tensors = load_safetensors(files.weights, file=WEIGHTS_FILE, max_bytes=max_bytes)
    del files
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        m = _PEFT_KEY.fullmatch(name)
        if m is None:
            _fail(WEIGHTS_FILE, f"tensor {name!r:.120}", f"not a LoRA weight of the form "
                  f"{_PEFT_KEY_FORM} (DoRA, biases and embeddings are not supported)")
        layer, group, module, half = int(m.group(1)), m.group(2), m.group(3), m.group(4)
        if MODULE_GROUPS.get(module) != group:
            _fail(WEIGHTS_FILE, f"tensor {name!r:.120}",
                  f"{group}.{module} matches no module of the base model")
        halves.setdefault((layer, module), {})[half] = t
    weights = {}
    for (layer, module), pair in halves.items():
        for half in ("A", "B"):
            if half not in pair:
                other = "B" if half == "A" else "A"
                _fail(WEIGHTS_FILE, peft_key(layer, module, half),
                      f"missing (lora_{other} is present)")
        weights[(layer, module)] = (pair["A"], pair["B"])
    present = tuple(m for m in LORA_MODULES if m in {mod for _, mod in weights})
    declared = settings.target_modules
    if declared is not None and weights and declared != present:
        _fail(CONFIG_FILE, "target_modules", f"lists {', '.join(declared)} but "
              f"{WEIGHTS_FILE} holds weights for {', '.join(present)}")
    return build_adapter(weights, rank=settings.rank, lora_alpha=settings.lora_alpha,
                         use_rslora=settings.use_rslora, base_config=base_config)


def _fail(file: str, field: str, reason: str) -> NoReturn:
    raise AdapterValidationError(file, field, reason)
