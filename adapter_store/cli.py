"""``loraplex adapters push | ls | show | rm``: manage a tenant's adapters in the store.

Every subcommand takes ``--store`` (``fs:PATH``, ``redis://...``, ``rediss://...``; default
``$LORAPLEX_STORE``, else ``fs:<data dir>/store`` with the data dir from ``server/env.py``:
``$LORAPLEX_DATA_DIR``, else ``~/.cache/loraplex/data``) and ``--tenant`` (default
``default``). Refusals exit with
status 1 and one line on stderr saying why; usage errors exit with 2.
"""

from __future__ import annotations

import argparse
import getpass
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

from loraplex.adapter_store.errors import (
    AdapterNotFound,
    AdapterStoreError,
    AdapterValidationError,
)
from loraplex.adapter_store.format import DEFAULT_MAX_BYTES, DEFAULT_MAX_RANK
from loraplex.adapter_store.store import DEFAULT_TENANT, AdapterVersion, open_store
from loraplex.server import env
from loraplex.server.commands import add_client_tls_args
from loraplex.server.engine.models.config import ModelConfig

_REFUSALS = (AdapterValidationError, AdapterNotFound, AdapterStoreError, ValueError, OSError,
             ImportError)


def default_store() -> str:
    """The store used without ``--store``: ``$LORAPLEX_STORE``, else ``fs:<data dir>/store``."""
    return env.get("store") or f"fs:{env.data_dir() / 'store'}"


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``adapters`` command group to the ``loraplex`` parser.

    Each subcommand sets ``func``, which takes the parsed namespace and returns the exit code.
    """
    parser = subparsers.add_parser(
        "adapters", help="manage LoRA adapters in the store",
        description="Validate, upload, list, show and delete LoRA adapters.")
    parser.set_defaults(func=lambda args: _usage(parser))
    sub = parser.add_subparsers(metavar="COMMAND")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--store", default=None,
                        help="fs:PATH, redis://[user:password@]host:port/db or rediss://... "
                             "(default: $LORAPLEX_STORE, else fs:$LORAPLEX_DATA_DIR/store, "
                             "the data dir defaulting to ~/.cache/loraplex/data)")
    common.add_argument("--tenant", default=DEFAULT_TENANT,
                        help="the tenant whose names to use (default: %(default)s)")
    common.add_argument("--json", action="store_true", help="print JSON")

    push = sub.add_parser("push", parents=[common], help="validate a PEFT adapter directory "
                          "and store it as the next version of NAME")
    push.add_argument("dir", help="adapter_config.json + adapter_model.safetensors")
    push.add_argument("--name", required=True, help="[a-z0-9][a-z0-9._-]{0,127}")
    push.add_argument("--model", default="demo",
                      help="the base model the adapter must fit: a directory with config.json, "
                           "a .gguf file, 'smollm2' or 'demo' (default)")
    push.add_argument("--max-rank", type=int, default=DEFAULT_MAX_RANK)
    push.add_argument("--max-bytes", type=int, default=DEFAULT_MAX_BYTES)
    push.add_argument("--uploader", default=None, help="recorded with the version "
                      "(default: the current user)")
    push.add_argument("--quiet", action="store_true", help="no progress bar")
    push.add_argument("--server", default=None, metavar="HOST:PORT",
                      help="upload through a gateway's Upload RPC instead of to --store")
    push.add_argument("--api-key", default=None, help="with --server (env LORAPLEX_API_KEY)")
    add_client_tls_args(push)
    push.set_defaults(func=_guarded("push", _push))

    ls = sub.add_parser("ls", parents=[common], help="list the tenant's adapters")
    ls.set_defaults(func=_guarded("ls", _ls))

    show = sub.add_parser("show", parents=[common], help="show NAME (latest) or NAME@VERSION")
    show.add_argument("ref", metavar="NAME[@VERSION]")
    show.set_defaults(func=_guarded("show", _show))

    rm = sub.add_parser("rm", parents=[common], help="delete NAME@VERSION, or every version "
                        "of NAME")
    rm.add_argument("ref", metavar="NAME[@VERSION]")
    rm.set_defaults(func=_guarded("rm", _rm))


def base_model_config(model: str) -> ModelConfig:
    """``--model``: ``demo``, ``smollm2``, a ``.gguf`` file or a directory holding a Hugging
    Face ``config.json``."""
    if model == "demo":
        # Imported here: the demo model is optional for everything but this flag.
        from loraplex.server.engine.models.demo import demo_model_config

        return demo_model_config()
    from loraplex.server.engine.models.builtin import gguf_source

    source = gguf_source(model)
    if source is not None:
        from loraplex.server.engine.models.gguf import gguf_config

        # the GGUF header is enough: a gateway never needs the converted weights
        return ModelConfig.from_hf_dict(gguf_config(source))
    path = Path(model)
    if not (path / "config.json").is_file():
        raise ValueError(f"--model {model}: no config.json there (or use --model demo or "
                         f"--model smollm2)")
    return ModelConfig.from_pretrained(path)


def _push(args: argparse.Namespace) -> int:
    if args.server:
        from loraplex.server.commands import push_remote

        return push_remote(args)
    from tqdm import tqdm

    from loraplex.adapter_store.blob import blob_size
    from loraplex.adapter_store.format import load_adapter

    base = base_model_config(args.model)
    adapter = load_adapter(args.dir, base, max_rank=args.max_rank, max_bytes=args.max_bytes)
    uploader = args.uploader if args.uploader is not None else _current_user()
    with open_store(args.store or default_store(), base) as store, \
            tqdm(total=blob_size(adapter), unit="B", unit_scale=True, unit_divisor=1024,
                 desc=f"push {args.name}", disable=True if args.quiet else None,
                 file=sys.stderr, leave=False) as bar:
        record = store.put(args.tenant, args.name, adapter, uploader=uploader,
                           progress=bar.update)
    if args.json:
        print(json.dumps(_as_json(record)))
    else:
        print(f"pushed {record.tenant}/{record.ref} sha256:{record.digest} "
              f"(rank {record.rank}, {','.join(record.target_modules)}, {record.dtype}, "
              f"{_size(record.nbytes)})")
    return 0


def _ls(args: argparse.Namespace) -> int:
    with open_store(args.store or default_store()) as store:
        records = store.list(args.tenant)
    if args.json:
        print(json.dumps([_as_json(r) for r in records]))
        return 0
    if not records:
        print(f"no adapters for tenant {args.tenant!r}")
        return 0
    rows = [("NAME", "VERSION", "RANK", "DTYPE", "SIZE", "TARGETS", "CREATED", "DIGEST")]
    rows += [(r.name, str(r.version), str(r.rank), r.dtype, _size(r.nbytes),
              ",".join(r.target_modules), _time(r.created), r.digest[:12]) for r in records]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    return 0


def _show(args: argparse.Namespace) -> int:
    with open_store(args.store or default_store()) as store:
        record = store.resolve(args.tenant, args.ref)
        versions = [v.version for v in store.versions(args.tenant, record.name)]
    if args.json:
        print(json.dumps({**_as_json(record), "versions": versions}))
        return 0
    fields = [("name", record.ref), ("tenant", record.tenant), ("digest", record.digest),
              ("rank", record.rank), ("target_modules", ", ".join(record.target_modules)),
              ("dtype", record.dtype), ("size", _size(record.nbytes)),
              ("created", _time(record.created)), ("uploader", record.uploader),
              ("versions", ", ".join(map(str, versions)))]
    for key, value in fields:
        print(f"{key + ':':<16}{value}")
    return 0


def _rm(args: argparse.Namespace) -> int:
    with open_store(args.store or default_store()) as store:
        deleted = store.delete(args.tenant, args.ref)
    if args.json:
        print(json.dumps([_as_json(r) for r in deleted]))
    else:
        for record in deleted:
            print(f"deleted {record.tenant}/{record.ref} sha256:{record.digest}")
    return 0


def _guarded(command: str, fn: Callable[[argparse.Namespace], int]
             ) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        try:
            return fn(args)
        except _REFUSALS as e:
            reason = " ".join(str(e).split()) or type(e).__name__
            print(f"loraplex adapters {command}: {reason}", file=sys.stderr)
            return 1
    return run


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return 2


def _as_json(record: AdapterVersion) -> dict[str, object]:
    return {"tenant": record.tenant, "name": record.name, "version": record.version,
            **record.to_record()}


def _current_user() -> str:
    try:
        return getpass.getuser()
    except (OSError, KeyError):
        return "unknown"


def _size(nbytes: int) -> str:
    if nbytes < 1024:
        return f"{nbytes} B"
    size = float(nbytes)
    for unit in ("KiB", "MiB"):
        size /= 1024
        if size < 1024:
            return f"{size:.1f} {unit}"
    return f"{size / 1024:.1f} GiB"


def _time(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


def main(argv: list[str] | None = None) -> int:
    """Run ``adapters ...`` alone (``python -m loraplex.adapter_store.cli adapters ls``)."""
    parser = argparse.ArgumentParser(prog="loraplex")
    register(parser.add_subparsers(metavar="COMMAND", required=True))
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
