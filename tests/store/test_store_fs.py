"""The disk backend: several processes at once, crashes, and damaged files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import safetensors

from loraplex.adapter_store.blob import METADATA_KEY
from loraplex.adapter_store.errors import AdapterNotFound, AdapterStoreError
from loraplex.adapter_store.format import load_adapter
from loraplex.adapter_store.fs_store import STALE_TMP_S, FsAdapterStore

WRITER = """
import json, sys, time
from pathlib import Path
from loraplex.adapter_store.format import load_adapter
from loraplex.adapter_store.fs_store import FsAdapterStore
from loraplex.server.engine.models.config import ModelConfig

root, adapter_dir, model_dir, go, count = sys.argv[1:6]
base = ModelConfig.from_pretrained(model_dir)
adapter = load_adapter(adapter_dir, base)
store = FsAdapterStore(root, base)
Path(go + "." + Path(adapter_dir).name).touch()
while not Path(go).exists():
    time.sleep(0.002)
print(json.dumps([store.put("default", "hot", adapter).version for _ in range(int(count))]))
"""


def test_processes_uploading_one_name_get_distinct_versions(tmp_path, make_adapter, model_dir,
                                                           base_config):
    root, go, procs, count = tmp_path / "store", tmp_path / "go", 4, 3
    dirs = [make_adapter(f"w{i}", seed=i) for i in range(procs)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    writers = [subprocess.Popen([sys.executable, "-c", WRITER, str(root), str(d), str(model_dir),
                                 str(go), str(count)], stdout=subprocess.PIPE, env=env)
               for d in dirs]
    deadline = time.monotonic() + 60
    while not all(Path(f"{go}.{d.name}").exists() for d in dirs):
        assert time.monotonic() < deadline and all(w.poll() is None for w in writers)
        time.sleep(0.01)
    go.touch()  # all writers start together
    got = {}
    for d, w in zip(dirs, writers):
        out, _ = w.communicate(timeout=60)
        assert w.returncode == 0
        got[d.name] = json.loads(out)
    versions = sorted(v for vs in got.values() for v in vs)
    assert versions == list(range(1, procs * count + 1))
    store = FsAdapterStore(root, base_config)
    records = {r.version: r.digest for r in store.versions("default", "hot")}
    for d in dirs:
        adapter = load_adapter(d, base_config)
        assert {records[v] for v in got[d.name]} == {adapter.digest}
        assert store.fetch(adapter.digest) == adapter
    assert list((root / "tmp").iterdir()) == []


def _blob(root: Path, digest: str) -> Path:
    return root / "blobs" / digest[:2] / f"{digest}.safetensors"


def test_blob_on_disk_is_plain_safetensors(tmp_path, make_adapter, base_config):
    store = FsAdapterStore(tmp_path / "s", base_config)
    adapter = load_adapter(make_adapter(), base_config)
    store.put("default", "x", adapter)
    with safetensors.safe_open(str(_blob(store.root, adapter.digest)), "pt") as f:
        assert json.loads(f.metadata()[METADATA_KEY])["r"] == 4
        assert len(list(f.keys())) == 2 * 2 * base_config.num_layers


@pytest.mark.parametrize("damage", ["flip-data", "flip-header", "truncate", "extend"])
def test_damaged_blob_is_detected(damage, tmp_path, make_adapter, base_config):
    store = FsAdapterStore(tmp_path / "s", base_config)
    adapter = load_adapter(make_adapter(), base_config)
    store.put("default", "x", adapter)
    path = _blob(store.root, adapter.digest)
    data = bytearray(path.read_bytes())
    if damage == "flip-data":
        data[-100] ^= 0x01
    elif damage == "flip-header":
        data[20] ^= 0x20
    elif damage == "truncate":
        del data[-4:]
    else:
        data += b"\0" * 4
    path.write_bytes(bytes(data))
    with pytest.raises(AdapterStoreError, match=adapter.digest):
        store.fetch(adapter.digest)


def test_missing_but_referenced_blob_is_an_error(tmp_path, make_adapter, base_config):
    store = FsAdapterStore(tmp_path / "s", base_config)
    adapter = load_adapter(make_adapter(), base_config)
    store.put("default", "x", adapter)
    _blob(store.root, adapter.digest).unlink()
    with pytest.raises(AdapterStoreError, match="missing"):
        store.fetch(adapter.digest)


def test_crash_before_the_record_leaves_nothing_visible(tmp_path, make_adapter, base_config,
                                                       monkeypatch):
    store = FsAdapterStore(tmp_path / "s", base_config)
    first = load_adapter(make_adapter("a", seed=1), base_config)
    second = load_adapter(make_adapter("b", seed=2), base_config)
    store.put("default", "x", first)

    def crash(self, path, data):
        raise OSError("simulated crash")
    monkeypatch.setattr(FsAdapterStore, "_write_atomic", crash)
    with pytest.raises(AdapterStoreError):
        store.put("default", "x", second)
    with pytest.raises(AdapterStoreError):
        store.put("default", "y", second)
    monkeypatch.undo()
    assert [(r.name, r.version, r.digest) for r in store.list("default")] == [
        ("x", 1, first.digest)]
    assert store.resolve("default", "x").digest == first.digest
    with pytest.raises(AdapterNotFound):
        store.resolve("default", "y")
    assert store.put("default", "x", second).version == 2


def test_stale_uploads_are_swept(tmp_path):
    root = tmp_path / "s"
    FsAdapterStore(root)
    old, new = root / "tmp" / "blob-old.tmp", root / "tmp" / "blob-new.tmp"
    old.write_bytes(b"x")
    new.write_bytes(b"x")
    os.utime(old, (time.time() - STALE_TMP_S - 10,) * 2)
    FsAdapterStore(root)
    assert not old.exists() and new.exists()


def test_unwritable_root_is_a_store_error(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(AdapterStoreError):
        FsAdapterStore(tmp_path / "file" / "store")
