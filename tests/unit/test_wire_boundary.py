"""The wire stops at the edge (design.md §3): in the packages, only ``server/wire/`` imports the
generated protobuf modules, so no protobuf object reaches the gateway's logic, the workers or
the engine."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("server", "loraplex", "adapter_store", "loadtest")
GENERATED = re.compile(r"^\s*(from|import)\s+(loraplex\.v1|grpc_health\.v1)\b.*", re.M)


def test_only_the_wire_package_imports_protobuf() -> None:
    offenders = []
    for package in PACKAGES:
        assert (ROOT / package).is_dir(), package
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT)
            if rel.parts[:2] == ("server", "wire"):
                continue
            offenders += [f"{rel}: {m.group(0).strip()}"
                          for m in GENERATED.finditer(path.read_text(encoding="utf-8"))]
    assert offenders == []
    wire = {p.name for p in (ROOT / "server" / "wire").glob("*.py")}
    assert {"messages.py", "services.py", "stubs.py"} <= wire
