"""The adapter store's exceptions, one per way a caller must react.

* :class:`AdapterValidationError` (a ``ValueError``): the upload is refused; the message names
  the file and the field. The gateway maps it to ``INVALID_ARGUMENT``.
* :class:`AdapterNotFound` (a ``LookupError``): no such name, version or digest. Another
  tenant's adapter raises it with the very same message as an absent one (``NOT_FOUND``).
* :class:`AdapterStoreError` (a ``RuntimeError``): the store is unavailable or holds corrupt
  data (a missing or damaged chunk, a digest that does not verify). Never a wrong adapter.
"""

from __future__ import annotations


class AdapterValidationError(ValueError):
    """An adapter upload is refused: ``"<file>: <field>: <reason>"``."""

    def __init__(self, file: str, field: str, reason: str) -> None:
        self.file = file
        self.field = field
        self.reason = reason
        super().__init__(f"{file}: {field}: {reason}" if field else f"{file}: {reason}")


class AdapterNotFound(LookupError):
    """No such adapter for this tenant (or no blob with this digest)."""


class AdapterStoreError(RuntimeError):
    """The store cannot answer: unavailable, or its data is corrupt."""
