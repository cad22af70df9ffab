"""The Dockerfiles, read statically (CI builds no images): multi-stage, non-root, no build tools
in the final stage, the right bases, every package folder copied, and agreement with the chart
on the user, ports and the Triton cache."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.deploy.chart import container, find, render

ROOT = Path(__file__).resolve().parents[2]
BUILD_TOOLS = ("gcc", "g++", "clang", "build-essential", "make", "-dev", "cmake", "git")


def _stages(name: str) -> list[str]:
    """The Dockerfile's stages, comments and continuations folded."""
    text = (ROOT / "deploy" / name).read_text()
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    text = re.sub(r"\\\n", " ", "\n".join(lines))
    return re.split(r"(?m)^(?=FROM )", text)[1:]


@pytest.mark.parametrize("name", ["worker.Dockerfile", "gateway.Dockerfile"])
def test_multi_stage_non_root_without_build_tools(name: str) -> None:
    stages = _stages(name)
    assert len(stages) >= 2
    final = stages[-1]
    user = re.search(r"(?m)^USER (\S+)", final)
    assert user and user.group(1).split(":")[0] not in ("0", "root")
    installs = " ".join(re.findall(r"apt-get install ([^&\n]*)", final))
    assert not [t for t in BUILD_TOOLS if t in installs.split() or t in installs], installs
    assert "pip install" not in final  # everything is built in the first stage and copied
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-dir"]
    roots = {Path(p).parts[0] for p in packages.values()}
    copied = set(re.findall(r"(?m)^COPY (?!--)(\S+) ", stages[0]))
    assert roots <= copied, f"not copied into the build: {roots - copied}"


def test_worker_image_runs_on_cuda_and_gateway_without() -> None:
    worker, gateway = _stages("worker.Dockerfile"), _stages("gateway.Dockerfile")
    assert "-runtime-" in worker[-1].splitlines()[0] and "nvidia/cuda" in worker[-1]
    assert "-devel-" in worker[0].splitlines()[0]
    assert "python:" in gateway[-1].splitlines()[0] and "-slim" in gateway[-1].splitlines()[0]
    assert "whl/cpu" in gateway[0] and "pip uninstall -y triton" in gateway[0]
    assert "nvidia" not in "".join(gateway)


def test_images_agree_with_the_chart() -> None:
    manifests = render({})
    sts = find(manifests, "StatefulSet", "-worker")
    spec = sts["spec"]["template"]["spec"]
    uid = spec["securityContext"]["runAsUser"]
    for name, component, kind in (("worker.Dockerfile", "worker", sts),
                                  ("gateway.Dockerfile", "gateway",
                                   find(manifests, "Deployment", "-gateway"))):
        final = _stages(name)[-1]
        assert re.search(rf"(?m)^USER {uid}:{uid}$", final), name
        c = container(kind, component)
        exposed = {int(p) for p in re.findall(r"(?m)^EXPOSE (.*)$", final)[0].split()}
        assert {p["containerPort"] for p in c["ports"]} == exposed
    # The Triton cache the image compiled is the one the init container seeds from, and the
    # pods keep the TRITON_LIBCUDA_PATH it was compiled with (part of Triton's cache key).
    build, final = _stages("worker.Dockerfile")
    seed = next(c for c in spec["initContainers"] if c["name"] == "seed-triton-cache")
    source = seed["command"][-2].rstrip(".").rstrip("/")
    assert f"TRITON_CACHE_DIR={source}" in build and f"COPY --from=build {source}" in final
    libcuda = re.search(r"TRITON_LIBCUDA_PATH=(\S+)", build)
    assert libcuda and f"TRITON_LIBCUDA_PATH={libcuda.group(1)}" in final
    env = {v["name"]: v.get("value") for v in container(sts, "worker")["env"]}
    assert "TRITON_LIBCUDA_PATH" not in env  # the image's value stands


def test_dockerignore_keeps_what_the_build_copies() -> None:
    ignored = {line.strip().rstrip("/") for line in (ROOT / ".dockerignore").read_text()
               .splitlines() if line.strip() and not line.startswith("#")}
    copied = set()
    for name in ("worker.Dockerfile", "gateway.Dockerfile"):
        copied |= set(re.findall(r"(?m)^COPY (?!--)(.+) \S+$", _stages(name)[0]))
    files = {f for entry in copied for f in entry.split()}
    assert files and not files & ignored
    assert {".venv", ".git", "tests"} <= ignored
