"""``loraplex adapters push | ls | show | rm`` through ``register`` on a test parser."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest

from loraplex.adapter_store import cli


@pytest.fixture
def run(capsys):
    parser = argparse.ArgumentParser(prog="loraplex")
    cli.register(parser.add_subparsers())

    def run_(*argv: str) -> tuple[int, str, str]:
        args = parser.parse_args(["adapters", *argv])
        code = args.func(args)
        out, err = capsys.readouterr()
        return code, out, err
    return run_


@pytest.fixture(params=["fs", "redis"])
def spec(request, tmp_path):
    if request.param == "fs":
        return f"fs:{tmp_path / 'store'}"
    return request.getfixturevalue("redis_url")


def test_push_ls_show_rm(run, spec, make_adapter, model_dir):
    path = make_adapter(rank=8, targets=("q_proj", "down_proj"))
    common = ["--store", spec, "--tenant", "acme"]
    code, out, err = run("push", str(path), "--name", "support-bot", "--model", str(model_dir),
                         "--uploader", "ci", "--quiet", *common)
    assert code == 0, err
    assert out.startswith("pushed acme/support-bot@1 sha256:") and "rank 8" in out
    code, out, _ = run("push", str(path), "--name", "support-bot", "--model", str(model_dir),
                       "--json", "--quiet", *common)
    pushed = json.loads(out)
    assert code == 0 and pushed["version"] == 2 and pushed["tenant"] == "acme"

    code, out, _ = run("ls", *common)
    lines = out.splitlines()
    assert code == 0 and lines[0].split()[:3] == ["NAME", "VERSION", "RANK"]
    assert [line.split()[:3] for line in lines[1:]] == [["support-bot", "1", "8"],
                                                       ["support-bot", "2", "8"]]
    code, out, _ = run("ls", "--json", *common)
    assert [r["version"] for r in json.loads(out)] == [1, 2]

    code, out, _ = run("show", "support-bot@1", *common)
    assert code == 0 and "support-bot@1" in out and "uploader:       ci" in out
    assert "versions:       1, 2" in out and "q_proj, down_proj" in out
    code, out, _ = run("show", "support-bot", "--json", *common)
    shown = json.loads(out)
    assert shown["version"] == 2 and shown["digest"] == pushed["digest"]

    code, out, _ = run("rm", "support-bot@1", *common)
    assert code == 0 and out.startswith("deleted acme/support-bot@1 ")
    code, out, _ = run("rm", "support-bot", *common)
    assert code == 0 and out.count("deleted") == 1
    code, out, _ = run("ls", *common)
    assert out.strip() == "no adapters for tenant 'acme'"


def test_refusals_exit_1_with_one_line(run, spec, make_adapter, model_dir, tmp_path):
    good = str(make_adapter())
    model = ["--model", str(model_dir), "--store", spec, "--quiet"]
    cases = [
        ("push", good, "--name", "Bad/Name", *model),
        ("push", str(tmp_path / "nope"), "--name", "x", *model),
        ("push", good, "--name", "x", "--model", str(tmp_path), "--store", spec),
        ("push", good, "--name", "x", "--max-rank", "2", *model),
        ("push", good, "--name", "x", "--tenant", "../t", *model),
        ("show", "missing", "--store", spec),
        ("show", "x@0", "--store", spec),
        ("rm", "missing@3", "--store", spec),
        ("ls", "--store", "s3://bucket"),
    ]
    for argv in cases:
        code, out, err = run(*argv)
        assert code == 1 and out == "", argv
        assert err.count("\n") == 1 and err.startswith(f"loraplex adapters {argv[0]}: "), err
    code, out, _ = run("ls", "--store", spec)
    assert out.startswith("no adapters")


def test_other_tenants_adapter_looks_absent(run, spec, make_adapter, model_dir):
    run("push", str(make_adapter()), "--name", "x", "--model", str(model_dir), "--store", spec,
        "--quiet", "--tenant", "a")
    _, _, other = run("show", "x", "--store", spec, "--tenant", "b")
    _, _, absent = run("show", "y", "--store", spec, "--tenant", "b")
    assert other.replace("'x'", "'y'") == absent


def test_default_store_and_tenant_come_from_the_environment(run, make_adapter, model_dir,
                                                             tmp_path, monkeypatch):
    monkeypatch.delenv("LORAPLEX_STORE", raising=False)
    monkeypatch.setenv("LORAPLEX_DATA_DIR", str(tmp_path / "data"))
    assert cli.default_store() == f"fs:{tmp_path / 'data' / 'store'}"
    code, out, _ = run("push", str(make_adapter()), "--name", "x", "--model", str(model_dir),
                       "--quiet")
    assert code == 0 and out.startswith("pushed default/x@1")
    assert (tmp_path / "data" / "store" / "tenants" / "default" / "x" / "1.json").is_file()
    monkeypatch.setenv("LORAPLEX_STORE", f"fs:{tmp_path / 'other'}")
    assert run("ls")[1].startswith("no adapters")


def test_usage_errors_exit_2(run):
    with pytest.raises(SystemExit) as err:
        run("push", "somewhere")  # --name is required
    assert err.value.code == 2
    assert run()[0] == 2  # `loraplex adapters` alone prints help


def test_module_entry_point_runs_in_a_real_process(tmp_path, make_adapter, model_dir):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LORAPLEX_STORE": f"fs:{tmp_path / 's'}"}
    cmd = [sys.executable, "-m", "loraplex.adapter_store.cli", "adapters"]
    pushed = subprocess.run([*cmd, "push", str(make_adapter()), "--name", "x", "--model",
                             str(model_dir)], capture_output=True, text=True, env=env)
    assert pushed.returncode == 0, pushed.stderr
    refused = subprocess.run([*cmd, "show", "x@9"], capture_output=True, text=True, env=env)
    assert refused.returncode == 1
    assert refused.stderr == "loraplex adapters show: adapter 'x@9' not found\n"


def test_push_against_the_demo_model_by_default(run, tmp_path, kit):
    demo = cli.base_model_config("demo")
    path = kit.write_adapter(tmp_path / "for-demo", kit.lora_tensors(demo, rank=4),
                             kit.lora_config())
    spec = f"fs:{tmp_path / 'store'}"
    code, out, err = run("push", str(path), "--name", "demo-lora", "--store", spec, "--quiet")
    assert code == 0 and out.startswith("pushed default/demo-lora@1"), err
    tiny = kit.write_adapter(tmp_path / "for-tiny", kit.lora_tensors(cli.ModelConfig.from_hf_dict(
        kit.tiny_llama)), kit.lora_config())
    code, _, err = run("push", str(tiny), "--name", "wrong-base", "--store", spec, "--quiet")
    assert code == 1 and "does not fit the base model" in err
