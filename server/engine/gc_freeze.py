"""The objects alive once an engine is built, frozen out of Python's garbage collections.

A full (oldest-generation) collection walks every object the process holds: the model
loader's, the tokenizer's, torch's, the server's. One landed inside a step on SmolLM2 (one Zen 5
core) and took 212 ms of it. Frozen (``gc.freeze``), those objects are skipped by every later
collection; the engine's own short-lived objects are still collected. ``release`` hands them
back (an engine's ``close``), and so does the exit: the interpreter's last collection skips
frozen objects, and extensions then report them leaked (nanobind's Triton bindings do).
``LORAPLEX_GC_FREEZE=0`` leaves the collector as it is.
"""

from __future__ import annotations

import atexit
import gc

from loraplex.server import env

__all__ = ["freeze", "release"]


def freeze() -> bool:
    """Freeze every object alive now, unless ``LORAPLEX_GC_FREEZE=0``; whether it did."""
    if not env.gc_freeze():
        return False
    gc.freeze()
    atexit.unregister(gc.unfreeze)  # registered once, however many engines
    atexit.register(gc.unfreeze)
    return True


def release() -> None:
    """Make the frozen objects collectable again (the process may go on without the engine)."""
    gc.unfreeze()
