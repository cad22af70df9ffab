"""API keys, tenant isolation and adapters through the gateway (one worker with LoRA)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from loraplex.server.api import FileHeader, ServiceError, UploadMetadata
from loraplex.server.cli import main as cli_main
from loraplex.server.engine.engine import Engine
from loraplex.server.engine.llm import LLM
from loraplex.server.engine.request import SamplingParams
from loraplex.server.wire.stubs import ClientStub
from tests.e2e.harness import Cluster, engine_config, write_keys

KEYS = {"acme-key-0123456789": ("acme", False), "globex-key-0123456789": ("globex", False),
        "ops-key-0123456789": ("ops", True)}
ACME, GLOBEX, OPS = KEYS


@pytest.fixture(scope="module")
def key_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_keys(tmp_path_factory.mktemp("keys") / "keys.txt", KEYS)


@pytest.fixture(scope="module")
def cluster(model_dir: Path, tmp_path_factory: pytest.TempPathFactory, key_file: Path):
    c = Cluster(model_dir, tmp_path_factory.mktemp("store"), keys=key_file)
    yield c
    c.close()


def status_of(fn: Callable[..., object], *args: object, **kwargs: object
              ) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(ServiceError) as info:
        fn(*args, **kwargs)
    return info.value.code, info.value.message


def test_missing_bad_and_revoked_keys(cluster: Cluster, key_file: Path) -> None:
    with cluster.client() as anonymous:
        code, message = status_of(anonymous.generate, "hi", max_tokens=2)
        assert code == grpc.StatusCode.UNAUTHENTICATED and "missing API key" in message
        assert anonymous.health() == "SERVING"  # probes need no key
    with cluster.client("not-a-key") as bad:
        assert status_of(bad.generate, "hi", max_tokens=2) == (
            grpc.StatusCode.UNAUTHENTICATED, "invalid API key")
        assert status_of(bad.list_adapters)[0] == grpc.StatusCode.UNAUTHENTICATED
    with cluster.client(GLOBEX) as globex:
        assert globex.generate("hi", max_tokens=2).usage.completion_tokens == 2
        write_keys(key_file, {k: v for k, v in KEYS.items() if k != GLOBEX})
        try:
            # Revoked without a restart: the file is re-read when it changes.
            assert status_of(globex.generate, "hi", max_tokens=2) == (
                grpc.StatusCode.UNAUTHENTICATED, "invalid API key")
            with cluster.client(ACME) as acme:
                assert acme.generate("hi", max_tokens=2).usage.completion_tokens == 2
        finally:
            write_keys(key_file, KEYS)
        assert globex.generate("hi", max_tokens=2).usage.completion_tokens == 2


def test_tenants_cannot_see_or_use_each_others_adapters(cluster: Cluster,
                                                        adapter_dirs: dict[str, Path]) -> None:
    with cluster.client(ACME) as acme, cluster.client(GLOBEX) as globex:
        record = acme.upload_adapter(adapter_dirs["alpha"], "private")
        assert (record.tenant, record.name, record.version) == ("acme", "private", 1)
        assert [v.name for v in acme.list_adapters()] == ["private"]
        assert acme.generate("hi", "private", max_tokens=4).usage.completion_tokens == 4

        def probes() -> list[tuple[grpc.StatusCode, str]]:
            return [status_of(globex.generate, "hi", "private", max_tokens=2),
                    status_of(globex.generate, "hi", "private@1", max_tokens=2),
                    status_of(globex.get_adapter, "private"),
                    status_of(globex.list_adapters, "private"),
                    status_of(globex.delete_adapter, "private@1")]

        while_it_exists = probes()
        assert all(code == grpc.StatusCode.NOT_FOUND for code, _ in while_it_exists)
        assert globex.list_adapters() == []
        acme.delete_adapter("private")
        assert probes() == while_it_exists  # indistinguishable from a missing adapter
        # The same content under the same name is globex's own adapter, version 1.
        mine = globex.upload_adapter(adapter_dirs["alpha"], "private")
        assert (mine.tenant, mine.version, mine.digest) == ("globex", 1, record.digest)
        globex.delete_adapter("private")


def test_admin_may_act_for_other_tenants(cluster: Cluster, adapter_dirs: dict[str, Path]
                                         ) -> None:
    with cluster.client(ACME) as acme, cluster.client(GLOBEX) as globex, \
            cluster.client(OPS) as ops:
        acme.upload_adapter(adapter_dirs["beta"], "shared")
        assert status_of(globex.list_adapters, tenant="acme")[0] == \
            grpc.StatusCode.PERMISSION_DENIED
        assert status_of(globex.upload_adapter, adapter_dirs["beta"], "x", tenant="acme")[0] \
            == grpc.StatusCode.PERMISSION_DENIED
        assert [v.name for v in ops.list_adapters(tenant="acme")] == ["shared"]
        pushed = ops.upload_adapter(adapter_dirs["gamma"], "from-ops", tenant="acme")
        assert pushed.tenant == "acme"
        assert {v.name for v in acme.list_adapters()} == {"shared", "from-ops"}
        ops.delete_adapter("from-ops", tenant="acme")
        acme.delete_adapter("shared")


def test_lora_generation_matches_the_offline_engine(cluster: Cluster, model_dir: Path,
                                                    adapter_dirs: dict[str, Path]) -> None:
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    prompts = ["LoRA one", "LoRA two"]
    with cluster.client(ACME) as acme:
        digests = {n: acme.upload_adapter(adapter_dirs[n], n).digest for n in ("alpha", "gamma")}
        served = {n: [acme.generate(p, n, params=params).token_ids for p in prompts]
                  for n in digests}
        base = [acme.generate(p, params=params).token_ids for p in prompts]
    offline = LLM(engine=Engine(engine_config(model_dir), adapter_source=cluster.store))
    for name, digest in digests.items():
        want = offline.generate(prompts, params, adapters=[digest] * len(prompts))
        assert served[name] == [w.token_ids for w in want], name
        assert served[name] != base  # the adapter changes the output
    assert offline.generate(prompts, params)[0].token_ids == base[0]


def test_upload_refusals_name_the_file(cluster: Cluster, adapter_dirs: dict[str, Path],
                                       tmp_path: Path) -> None:
    files = {p.name: p.read_bytes() for p in sorted(adapter_dirs["alpha"].iterdir())}

    def upload(parts: list) -> tuple[grpc.StatusCode, str]:
        with grpc.insecure_channel(cluster.address) as channel:
            stub = ClientStub(channel)
            return status_of(stub.upload, parts, [("authorization", f"Bearer {ACME}")], 30)

    def file_parts(name: str, data: bytes, sha: str | None = None, size: int | None = None
                   ) -> list:
        return [FileHeader(name, len(data) if size is None else size,
                           sha or hashlib.sha256(data).hexdigest()), data]

    good = [UploadMetadata("bad")]
    for name, data in files.items():
        good += file_parts(name, data)
    wrong_sha = [UploadMetadata("bad"), *file_parts("adapter_config.json",
                                                    files["adapter_config.json"], sha="0" * 64)]
    wrong_sha += file_parts("adapter_model.safetensors", files["adapter_model.safetensors"])
    code, message = upload(wrong_sha)
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert message.startswith("adapter_config.json: sha256")
    code, message = upload([UploadMetadata("bad"), *file_parts("pytorch_model.bin", b"x")])
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "pytorch_model.bin" in message
    code, message = upload([UploadMetadata("bad"),
                            *file_parts("adapter_config.json", b"{}", size=10)])
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "fewer" in message
    code, message = upload(good[1:])
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "metadata" in message
    config = json.loads(files["adapter_config.json"])
    config["r"] = 1000
    bad_rank = tmp_path / "bad-rank"
    bad_rank.mkdir()
    (bad_rank / "adapter_config.json").write_text(json.dumps(config))
    (bad_rank / "adapter_model.safetensors").write_bytes(files["adapter_model.safetensors"])
    with cluster.client(ACME) as acme:
        code, message = status_of(acme.upload_adapter, bad_rank, "bad")
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "adapter_config.json: r" in message
        assert status_of(acme.get_adapter, "bad")[0] == grpc.StatusCode.NOT_FOUND


def test_upload_via_rpc_and_cli_give_the_same_digest(cluster: Cluster, model_dir: Path,
                                                     adapter_dirs: dict[str, Path],
                                                     tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    adapter = adapter_dirs["beta"]
    with cluster.client(ACME) as acme:
        via_rpc = acme.upload_adapter(adapter, "same")
    assert cli_main(["adapters", "push", "--server", cluster.address, "--api-key", ACME,
                     "--name", "same", "--json", str(adapter)]) == 0
    via_cli_server = json.loads(capsys.readouterr().out)
    assert cli_main(["adapters", "push", "--store", f"fs:{tmp_path / 'local'}", "--model",
                     str(model_dir), "--name", "same", "--json", "--quiet", str(adapter)]) == 0
    via_cli_local = json.loads(capsys.readouterr().out)
    assert via_rpc.digest == via_cli_server["digest"] == via_cli_local["digest"]
    assert (via_cli_server["tenant"], via_cli_server["version"]) == ("acme", via_rpc.version + 1)
    with cluster.client(ACME) as acme:
        acme.delete_adapter("same")
