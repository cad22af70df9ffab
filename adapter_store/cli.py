"""`loraplex adapters ...`: push, ls, show, rm (the adapter store issue fills this in)."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``adapters`` command group to the ``loraplex`` parser."""
    parser = subparsers.add_parser("adapters", help="manage LoRA adapters in the store")
    parser.set_defaults(func=_not_yet)


def _not_yet(args: argparse.Namespace) -> int:
    raise NotImplementedError("loraplex adapters: the adapter store is not built yet")
