"""glibc's allocator kept from handing a step's freed buffers back to the kernel (CPU engine).

A step on the CPU allocates its activations afresh, several of them megabytes (a 2048-token
prefill's gate/up output is 25 MB in float32). glibc serves a request above its mmap threshold
(128 KiB at start, raised as mmapped chunks are freed, at most 32 MiB) with fresh pages, and
returns the top of its heap to the kernel once more than its trim threshold lies free there:
either way the next step's buffers fault their pages in again, zeroed one 4 KiB page at a time.
Measured on SmolLM2-135M in float32 (one Zen 5 core, `lora_bench.py`): 44 thousand minor
faults a run of 32 requests in the steady state (the worse storms after adapter copies-in came
from block copies, now views: ``ResidentAdapter.host_region``). With the mmap threshold fixed
at its maximum and the trim threshold at 1 GiB a steady run faults a handful of pages, and ran
2.8% faster with adapters, 1.6% without (medians of six interleaved runs). The cost: the
process keeps up to 1 GiB of freed heap mapped for reuse.

``LORAPLEX_MALLOC_TUNE=0`` leaves the allocator as it is; so do allocators other than glibc's.
"""

from __future__ import annotations

import ctypes
import functools

from loraplex.server import env

__all__ = ["keep_freed_memory"]

# <malloc.h>
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's largest (DEFAULT_MMAP_THRESHOLD_MAX on 64-bit)
TRIM_THRESHOLD = 1 << 30


@functools.cache
def keep_freed_memory() -> bool:
    """Fix glibc's mmap and trim thresholds for this process; whether they were set."""
    if not env.malloc_tune():
        return False
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # noqa: B018 - glibc, not musl or another allocator
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
