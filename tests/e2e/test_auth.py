"""API key parsing and checks (no gRPC)."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from loraplex.server.api import ServiceError
from loraplex.server.auth import KEYLESS, Identity, KeyRing, api_key_from_metadata, hash_key


def bearer(key: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {key}")]


def test_key_file_entries_roles_and_bad_lines(tmp_path: Path,
                                              caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "keys"
    path.write_text(f"# comment\n{hash_key('a' * 32)}  acme\n"
                    f"sha256:{hash_key('o' * 32)} ops admin  # trailing comment\n"
                    f"{hash_key('x' * 32)} Bad_Tenant\n"
                    f"nothex acme\n{hash_key('y' * 32)} acme superuser\n")
    ring = KeyRing(path=str(path))
    assert ring.num_keys == 2
    assert ring.authenticate(bearer("a" * 32)) == Identity("acme")
    assert ring.authenticate([("x-api-key", "o" * 32)]) == Identity("ops", admin=True)
    assert sum("skipped" in r.message for r in caplog.records) == 3
    for key in ("x" * 32, "y" * 32, "z" * 32, "a" * 5000):
        with pytest.raises(ServiceError) as info:
            ring.authenticate(bearer(key))
        assert info.value.code == grpc.StatusCode.UNAUTHENTICATED


def test_inline_entries_and_keyless_mode(tmp_path: Path) -> None:
    ring = KeyRing(text=f"{hash_key('k1')} one;{hash_key('k2')} two admin")
    assert ring.authenticate(bearer("k2")) == Identity("two", admin=True)
    assert not ring.keyless
    assert KeyRing().authenticate(None) is KEYLESS
    missing = KeyRing(path=str(tmp_path / "absent"))
    assert not missing.keyless  # a configured file that is gone lets nobody in
    with pytest.raises(ServiceError):
        missing.authenticate(bearer("k1"))


def test_revocation_and_sighup_reload(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text(f"{hash_key('k1')} one\n{hash_key('k2')} two\n")
    ring = KeyRing(path=str(path))
    assert ring.authenticate(bearer("k2")).tenant == "two"
    path.write_text(f"{hash_key('k1')} one\n")
    with pytest.raises(ServiceError):
        ring.authenticate(bearer("k2"))
    ring.reload()  # what SIGHUP does
    assert ring.authenticate(bearer("k1")).tenant == "one"


def test_tenant_for_admins_only() -> None:
    assert Identity("acme").tenant_for("") == "acme"
    assert Identity("acme").tenant_for("acme") == "acme"
    assert Identity("ops", admin=True).tenant_for("acme") == "acme"
    with pytest.raises(ServiceError) as info:
        Identity("acme").tenant_for("globex")
    assert info.value.code == grpc.StatusCode.PERMISSION_DENIED


def test_metadata_forms() -> None:
    assert api_key_from_metadata([("authorization", "bearer  k ")]) == "k"
    assert api_key_from_metadata([("authorization", "Basic k")]) == ""
    assert api_key_from_metadata([("x-api-key", "k2")]) == "k2"
    assert api_key_from_metadata(None) == ""


def test_quota_overrides_in_key_entries(tmp_path: Path,
                                        caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "keys"
    path.write_text(f"{hash_key('a1')} acme max_concurrency=4 tokens_per_minute=1000\n"
                    f"{hash_key('a2')} acme max_concurrency=2\n"  # disagrees: the strictest
                    f"{hash_key('o1')} ops admin max_concurrency=0\n"
                    f"{hash_key('o2')} ops max_concurrency=3\n"  # 3 is stricter than 0 (none)
                    f"{hash_key('b')} beta burst=3\n"
                    f"{hash_key('c')} gamma max_concurrency=-1\n"
                    f"{hash_key('d')} delta max_concurrency=5 admin\n")
    ring = KeyRing(path=str(path))
    assert ring.num_keys == 4
    assert sum("skipped" in r.message for r in caplog.records) == 3
    assert ring.tenant_limits("acme") == {"max_concurrency": 2, "tokens_per_minute": 1000}
    assert ring.tenant_limits("ops") == {"max_concurrency": 3}
    assert ring.authenticate(bearer("o1")) == Identity("ops", admin=True)
    assert ring.tenant_limits("nobody") == {}
    path.write_text(f"{hash_key('a1')} acme\n")  # quotas change with the file
    assert ring.authenticate(bearer("a1")).tenant == "acme"
    assert ring.tenant_limits("acme") == {}
    inline = KeyRing(text=f"{hash_key('k')} one tokens_per_minute=50")
    assert inline.tenant_limits("one") == {"tokens_per_minute": 50}
