"""The generated code matches the protos, and docs/service.md lists every server flag."""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import pytest

from tests.e2e.harness import REPO

PROTO_ROOT = REPO / "proto"
GENERATED = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def test_generated_code_is_not_stale(tmp_path: Path) -> None:
    from grpc_tools import protoc

    shutil.copytree(PROTO_ROOT, tmp_path / "proto",
                    ignore=shutil.ignore_patterns(*(f"*{s}" for s in GENERATED), "__pycache__"))
    root = tmp_path / "proto"
    protos = sorted(str(p) for p in root.rglob("*.proto"))
    assert protos, "no .proto files"
    rc = protoc.main(["protoc", f"-I{root}", f"--python_out={root}", f"--pyi_out={root}",
                      f"--grpc_python_out={root}", *protos])
    assert rc == 0
    for proto in protos:
        stem = Path(proto).relative_to(root).with_suffix("")
        for suffix in GENERATED:
            fresh = (root / f"{stem}{suffix}").read_text()
            committed = PROTO_ROOT / f"{stem}{suffix}"
            assert committed.exists(), f"{committed} is missing: regenerate (docs/service.md)"
            assert committed.read_text() == fresh, (
                f"{committed.relative_to(REPO)} is stale: run python -m grpc_tools.protoc -I "
                "proto --python_out=proto --pyi_out=proto --grpc_python_out=proto "
                "proto/loraplex/v1/*.proto")


def _subparser(name: str) -> argparse.ArgumentParser:
    from loraplex.server.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


@pytest.mark.parametrize("command", ["serve", "gateway", "worker"])
def test_every_flag_and_variable_is_in_the_docs(command: str) -> None:
    doc = (REPO / "docs" / "service.md").read_text()
    missing = []
    for action in _subparser(command)._actions:
        if not action.option_strings or action.dest == "help":
            continue
        flag = action.option_strings[0]
        var = f"LORAPLEX_{action.dest.upper()}"
        if f"`{flag}`" not in doc or f"`{var}`" not in doc:
            missing.append(f"{flag} / {var}")
    assert not missing, f"docs/service.md lacks {command}: {missing}"
