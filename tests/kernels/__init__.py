"""Kernel tests. In a checkout that is not installed (the GPU machines get a bare copy of the
tree), map ``loraplex.kernels`` onto ``kernels/`` as pyproject's package-dir table does."""

import importlib.util
from pathlib import Path

if importlib.util.find_spec("loraplex") is not None:
    import loraplex

    if importlib.util.find_spec("loraplex.kernels") is None:
        loraplex.__path__.append(str(Path(__file__).resolve().parents[2]))
