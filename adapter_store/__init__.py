"""Validated, versioned, content-addressed LoRA adapters on disk or Redis (design.md §3).

``format.load_adapter`` turns a PEFT adapter directory into a ``CanonicalAdapter`` named by
its digest; ``store.open_store`` opens an ``AdapterStore`` (``fs:PATH`` or ``redis://``) that
maps ``tenant / name @ version`` to digests and serves workers by digest.
"""
