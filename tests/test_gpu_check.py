"""deploy/gpu-check.sh runs end to end on the CPU (--cpu-smoke): the same code as on a GPU,
a tiny random model, a few tokens; its JSON holds every figure and the identity verdicts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_cpu_smoke_writes_the_report(tmp_path):
    out = tmp_path / "check.json"
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(["bash", str(ROOT / "deploy" / "gpu-check.sh"), "--cpu-smoke",
                           "--out", str(out)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["passed"] is True
    # Greedy identity against transformers' own forward, for both CPU attention kernels.
    assert report["identity"]["float32"] == {
        "loop": {"identical": "2/2", "diverged": []},
        "padded": {"identical": "2/2", "diverged": []}}
    single = report["single_client"]
    assert single["baseline_tokens_per_s"] > 0
    assert all(single[f"spec_k4_alpha{a}"]["same_tokens"] for a in (0.6, 0.8))
    assert [c["clients"] for c in report["capacity"]] == [1, 2]
    assert all(c["same_tokens"] and c["ratio"] > 0 for c in report["capacity"])
