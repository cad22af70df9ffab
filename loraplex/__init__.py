"""loraplex: multi-tenant LoRA adapter serving.

The kernels live here, in ``loraplex/kernels/`` (a top-level ``kernels`` folder would shadow
the PyPI package ``kernels`` that transformers imports, wherever the checkout is on
``sys.path``). The rest of the code lives in the top-level folders ``server/``,
``adapter_store/`` and ``loadtest/``; they install as ``loraplex.server``, ... (see the
``package-dir`` table in pyproject.toml).
"""

__version__ = "0.1.0"
