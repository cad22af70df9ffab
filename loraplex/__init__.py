"""loraplex: multi-tenant LoRA adapter serving.

The code lives in the top-level folders ``server/``, ``kernels/``, ``adapter_store/`` and
``loadtest/``; they install as ``loraplex.server``, ``loraplex.kernels``, ... (see the
``package-dir`` table in pyproject.toml).
"""

__version__ = "0.1.0"
