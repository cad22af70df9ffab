"""CPU threads: one OpenMP team per process, on the thread that steps the engine.

torch's CPU ops and the native kernels (``loraplex/kernels/csrc``, built with ``-fopenmp`` against
the same runtime) run their parallel loops on OpenMP. GNU OpenMP, the runtime of torch's Linux
wheels, gives every thread that opens a parallel region a team of its own, and the team's
threads live as long as that thread does. Once a process holds more OpenMP threads than it has
CPUs, the runtime stops spinning between regions and at barriers (at most 1,000 spins, where it
spins about 300,000 otherwise, whatever ``OMP_WAIT_POLICY`` says) and sleeps on a futex, so
every parallel region pays wake-ups at its start and its barrier. Measured on the 2-core VM
(docs/benchmarks.md, "Two threads"): a 10 us region took 15 us with one team and 90 us with a
second team alive elsewhere; a float32 GEMM of 32 rows ran no faster on two threads than on one.
A team appears wherever a helper thread runs one large torch op: an adapter load, a grammar
compile, a store upload on asyncio's executor, or the model load itself.

So:

* ``confine()`` at the start of every helper thread that may touch torch
  (``confined_executor`` for a pool of them): its ops run on that one thread and never open a
  team (it costs them nothing that matters: they are not the
  step).
* ``run_on_own_thread(fn)`` for work off the stepping thread that should use every core (the
  server's model load): a thread made for it and ended with it, taking its team along.
* ``use(num_threads)``: the engine sets its own count on whichever thread steps it
  (``Engine.step``), so a thread that started before or after the engine was built steps it
  with the count it was built with.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

__all__ = ["confine", "confined_executor", "run_on_own_thread", "use"]

T = TypeVar("T")


@functools.cache
def _setters() -> tuple[Callable[[int], object], ...]:
    # This thread's count in the OpenMP runtime and in MKL, without torch.set_num_threads:
    # that also sets the count every thread started later inherits (torch's process-wide
    # default), which would hand a thread that builds an engine one thread.
    try:
        lib = ctypes.CDLL(torch._C.__file__)  # its dependencies: libtorch_cpu, the runtime
    except OSError:
        return ()
    found = []
    # MKL's C entry point (its lowercase name is the Fortran one, which takes a pointer)
    for name in ("omp_set_num_threads", "MKL_Set_Num_Threads_Local"):
        fn = getattr(lib, name, None)
        if fn is not None:
            fn.argtypes = [ctypes.c_int]
            found.append(fn)
    return tuple(found)


def confine() -> None:
    """Run this thread's torch and native CPU ops on this thread alone, from now on."""
    torch.get_num_threads()  # torch's per-thread first-use setup now, or it would undo this
    for setter in _setters():
        setter(1)


def confined_executor(max_workers: int | None, thread_name_prefix: str) -> ThreadPoolExecutor:
    """A thread pool whose threads ``confine()`` themselves as they start."""
    return ThreadPoolExecutor(max_workers, thread_name_prefix=thread_name_prefix,
                              initializer=confine)


def use(num_threads: int) -> None:
    """Give this thread ``num_threads`` for torch and native CPU ops (no-op when it has them)."""
    if torch.get_num_threads() != num_threads:
        torch.set_num_threads(num_threads)


def run_on_own_thread(fn: Callable[[], T]) -> T:
    """``fn()`` on a thread started for it and ended before this returns: the OpenMP team its
    parallel ops open ends with it. Returns what ``fn`` returns and raises what it raises."""
    result: list[T] = []
    error: list[BaseException] = []

    def target() -> None:
        try:
            result.append(fn())
        except BaseException as exc:  # re-raised on the caller's thread
            error.append(exc)

    thread = threading.Thread(target=target, name="loraplex-build")
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]
