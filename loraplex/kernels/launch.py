"""What every Triton launcher in ``loraplex/kernels/`` shares: the checks it runs before a launch
(each raises ``ValueError``), the launch record that lets a test compile exactly what would run, and
the device facts that size grids.

No kernels live here, so importing this module does not depend on ``TRITON_INTERPRET``.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import torch
import triton

from loraplex.kernels.buckets import floor_pow2

__all__ = ["Launch", "check_dtype", "check_kernel_device", "check_same_device", "dot_precision",
           "floor_pow2", "num_sms"]


class Launch(NamedTuple):
    """One kernel launch as the launcher makes it: kernel, grid and compile-time arguments
    (``num_warps`` included). Lets a check compile exactly what would run."""

    kernel: Any
    grid: tuple[int, ...]
    constexprs: dict[str, Any]


def check_kernel_device(t: torch.Tensor) -> None:
    """Triton kernels run on CUDA, or anywhere under ``TRITON_INTERPRET=1``."""
    if t.device.type != "cuda" and not triton.knobs.runtime.interpret:
        raise ValueError(f"Triton kernels need a CUDA tensor (or TRITON_INTERPRET=1), "
                         f"got device {t.device}")


def check_same_device(*tensors: torch.Tensor) -> None:
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")


def check_dtype(name: str, t: torch.Tensor, allowed: tuple[torch.dtype, ...]) -> None:
    if t.dtype not in allowed:
        raise ValueError(f"{name}: expected dtype in {[str(d) for d in allowed]}, got {t.dtype}")


def dot_precision(dtype: torch.dtype) -> str:
    # float32 stays IEEE on the GPU (tl.dot would use tf32 by default): float32 parity needs it
    return "ieee" if dtype == torch.float32 else "tf32"


@functools.cache
def _sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Multiprocessors of ``device``; 4 off CUDA (the interpreter: keep grids small)."""
    return _sms(device) if device.type == "cuda" else 4
