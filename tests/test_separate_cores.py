"""The separate-cores benchmark on the tiny pair: verifier pinned to core 1, client to core 0,
every protocol measured on the same prompts, cloud-only as the reference."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")


def run_bench(tiny_llama_pair, out, *extra: str) -> dict:
    """The benchmark in its own process (it pins itself to core 0); its JSON report."""
    args = ["--model", str(tiny_llama_pair.target_dir), "--draft-dir",
            str(tiny_llama_pair.draft_dir), "--per-category", "1", *extra, "--json", str(out)]
    code = f"from edge_client.bench.separate_cores import main\nraise SystemExit(main({args!r}))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(out.read_text())


def test_it_reports_every_protocol_against_cloud_only(tiny_llama_pair, tmp_path):
    report = run_bench(tiny_llama_pair, tmp_path / "cores.json", "--max-new-tokens", "12")
    assert report["prompts"] == 8
    rates = report["tokens_per_s_median"]
    assert set(rates) == {"rounds", "lookahead", "rounds+combined", "lookahead+combined",
                          "cloud"} and min(rates.values()) > 0
    assert report["vs_cloud"]["cloud"] == pytest.approx(1.0)
    forwards = report["target_forwards_per_token_mean"]
    assert forwards["cloud"] == pytest.approx(1.0) and forwards["rounds"] <= 1.0
    assert forwards["rounds+combined"] <= 1.0


def test_with_a_feature_head_it_also_runs_the_head_in_both_drafting_protocols(
        tiny_llama_pair, tmp_path):
    """--feature-head adds rounds+feature and lookahead+feature; the head's downlink carries
    the features, so its bytes down per token exceed the independent draft's rounds."""
    from feature_heads import export_untrained_head

    head = export_untrained_head(tiny_llama_pair.target_dir, tmp_path / "head")
    report = run_bench(tiny_llama_pair, tmp_path / "cores.json", "--max-new-tokens", "8",
                       "--drafters", "model", "--feature-head", str(head))
    assert set(report["tokens_per_s_median"]) == {
        "rounds", "lookahead", "cloud", "rounds+feature", "lookahead+feature"}
    down = report["bytes_down_per_token_mean"]
    assert down["rounds+feature"] > down["rounds"]


def test_it_runs_every_draft_length_and_stop_confidence_given(tiny_llama_pair, tmp_path):
    report = run_bench(tiny_llama_pair, tmp_path / "cores.json", "--max-new-tokens", "6",
                       "--drafters", "combined", "--draft-len", "2", "4",
                       "--stop-confidence", "0", "0.5")
    assert set(report["tokens_per_s_median"]) == {
        f"{protocol}+combined/K={k}/stop={stop}" for protocol in ("rounds", "lookahead")
        for k in (2, 4) for stop in ("0", "0.5")} | {"cloud"}
    assert report["draft_len"] == [2, 4] and report["stop_confidence"] == [0.0, 0.5]


def test_several_drafts_take_turns_on_every_prompt(tiny_llama_pair, tmp_path):
    """Two --draft-dir copies of one draft: each gets its own runs, named @DIRNAME, on the same
    prompts; being the same draft, they need the same target forwards per token."""
    import shutil

    a, b = (shutil.copytree(tiny_llama_pair.draft_dir, tmp_path / name) for name in "ab")
    report = run_bench(tiny_llama_pair, tmp_path / "cores.json", "--max-new-tokens", "6",
                       "--drafters", "model", "--draft-dir", str(a), str(b))
    assert set(report["tokens_per_s_median"]) == {
        f"{protocol}@{name}" for protocol in ("rounds", "lookahead") for name in "ab"} | {"cloud"}
    forwards = report["target_forwards_per_token_mean"]
    assert forwards["rounds@a"] == pytest.approx(forwards["rounds@b"])
    assert report["vs_cloud_paired"]["cloud"] == pytest.approx(1.0)
    assert report["draft_dirs"] == [str(a), str(b)]
