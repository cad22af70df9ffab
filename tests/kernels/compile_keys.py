"""Which binaries Triton would compile: each launch's compile key, recorded around the ``run``
of every kernel of ``loraplex/kernels/`` (natively and under the interpreter, which compiles
nothing).

The key is what Triton's ``JITFunction.run`` looks its cache up with: the kernel, its
compile-time arguments (``num_warps`` included) and, for every other argument, its type and
specialisation (``== 1``, ``% 16 == 0``, pointer alignment) unless the kernel declares it
``do_not_specialize``.
"""

from __future__ import annotations

import inspect
from typing import Any

import pytest
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend

from loraplex.kernels.variants import Variant, variant

# what JITFunction.run adds to a launch's keyword arguments before its hooks see them
_RUN_OPTIONS = {"debug", "instrumentation_mode", "fpsan_homomorphic_casts"}


def all_kernels() -> list[Any]:
    from loraplex.kernels import paged_attention, sgmv

    return [*sgmv._KERNELS.values(), *paged_attention._KERNELS.values(),
            paged_attention._write_kv_kernel]


def _not_specialized(kernel: Any) -> set[str]:
    names = getattr(kernel, "do_not_specialize", None)
    if names is None:  # the interpreter keeps the decorator's arguments
        names = kernel.kwargs.get("do_not_specialize")
    params = list(inspect.signature(kernel.fn).parameters)
    return {params[n] if isinstance(n, int) else n for n in names or ()}


def compile_key(kernel: Any, args: tuple, kwargs: dict[str, Any]) -> Variant:
    """The compile key of ``kernel[grid](*args, **kwargs)``."""
    params = list(inspect.signature(kernel.fn).parameters.values())
    skip = _not_specialized(kernel)
    constexprs: dict[str, Any] = {k: v for k, v in kwargs.items()
                                  if k not in _RUN_OPTIONS and v is not None}
    spec: list[Any] = []
    for param, arg in zip(params, args):
        if "constexpr" in str(param.annotation):
            constexprs[param.name] = arg
            continue
        spec.append(native_specialize_impl(BaseBackend, arg, False, param.name not in skip,
                                           True))
    return Variant(kernel.__name__, tuple(sorted(constexprs.items())), tuple(spec))


def record_compile_keys(monkeypatch: pytest.MonkeyPatch) -> list[Variant]:
    """Record the compile key of every kernel launch from now on (in launch order)."""
    keys: list[Variant] = []
    for kernel in all_kernels():
        # wraps run itself: the interpreter hands pre-run hooks host copies and drops num_warps
        def run(*args: Any, _run: Any = kernel.run, _kernel: Any = kernel, **kwargs: Any) -> Any:
            launch = {k: v for k, v in kwargs.items() if k not in ("grid", "warmup")}
            keys.append(compile_key(_kernel, args, launch))
            return _run(*args, **kwargs)

        monkeypatch.setattr(kernel, "run", run)
    return keys


def constexpr_part(keys: list[Variant] | frozenset[Variant]) -> set[Variant]:
    """The keys without their argument specialisation (what ``loraplex/kernels/variants.py`` names
    by kernel and compile-time arguments)."""
    return {variant(k.kernel, dict(k.constexprs)) for k in keys}
