"""``make test`` provides redis-server (``scripts/ensure_redis.sh``): apt-get as root when it is
missing, otherwise one line saying what to install. Run with a PATH of stand-in ``id`` and
``apt-get`` scripts, so nothing is installed for real."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "ensure_redis.sh"
# A stand-in apt-get that logs its calls and "installs" an empty redis-server next to itself.
APT_GET = """#!/bin/sh
echo "$*" >> {bin}/apt.log
if [ "$1" = install ]; then
    printf '#!/bin/sh\\n' > {bin}/redis-server
    /bin/chmod +x {bin}/redis-server
fi
exit {rc}
"""


def _bin(tmp_path: Path, uid: int, apt_rc: int | None) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "id").write_text(f"#!/bin/sh\necho {uid}\n")
    if apt_rc is not None:
        (bin_dir / "apt-get").write_text(APT_GET.format(bin=bin_dir, rc=apt_rc))
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    return bin_dir


def _run(bin_dir: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["/bin/sh", str(SCRIPT)], capture_output=True, text=True,
                          env={"PATH": str(bin_dir)}, timeout=30)


def test_root_gets_redis_server_from_apt_get(tmp_path: Path) -> None:
    bin_dir = _bin(tmp_path, uid=0, apt_rc=0)
    proc = _run(bin_dir)
    assert proc.returncode == 0, proc.stderr
    assert (bin_dir / "apt.log").read_text().splitlines() == [
        "update -qq", "install -y -qq redis-server"]
    assert _run(bin_dir).returncode == 0  # now on PATH: nothing more to do
    assert (bin_dir / "apt.log").read_text().count("install") == 1


@pytest.mark.parametrize(("uid", "apt_rc", "says"), [
    (1000, 0, "redis-server is missing: install it (sudo apt-get install redis-server"),
    (0, None, "redis-server is missing: install it (sudo apt-get install redis-server"),
    (0, 100, "apt-get could not install redis-server"),
])
def test_otherwise_one_line_says_what_to_install(tmp_path: Path, uid: int, apt_rc: int | None,
                                                 says: str) -> None:
    proc = _run(_bin(tmp_path, uid, apt_rc))
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("make test: ") and says in last
    assert not (tmp_path / "bin" / "apt.log").exists() or uid == 0
