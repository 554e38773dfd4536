"""``edgespec-bench e2e`` on the tiny pair: every case reproduces the target, and case (b)
is skipped, not faked, when the draft has no PyTorch copy."""

from __future__ import annotations

import json


def run(tmp_path, pair, *extra: str) -> dict:
    from edge_client.bench.cli import main

    out = tmp_path / "bench.json"
    rc = main(["e2e", "--json", str(out), "--model", str(pair.target_dir), "--draft-dir",
               str(pair.draft_dir), "--prompts", "2", "--max-new-tokens", "6",
               "--draft-len", "3", "--rtt-ms", "10", *extra])
    assert rc == 0
    return json.loads(out.read_text())


def test_bench_cases_reproduce_the_target(tiny_llama_pair, tmp_path):
    report = run(tmp_path, tiny_llama_pair, "--draft-pt-dir", str(tiny_llama_pair.draft_pt_dir))
    cases = report["cases"]
    assert list(cases) == ["a_target_generate", "b_hf_assisted", "c_edgespec_loopback",
                           "d_edgespec_rtt10ms", "e_lookahead_loopback", "f_lookahead_rtt10ms"]
    for name, c in cases.items():
        assert c["new_tokens"] > 0 and c["tokens_per_s"] > 0
        if name != "a_target_generate":
            assert c["outputs_identical_to_target"] == 2, name
    assert cases["c_edgespec_loopback"]["round_trips_per_token"] <= 1
    # One stream per prompt: 2 round trips in all.
    assert cases["e_lookahead_loopback"]["round_trips_per_token"] == \
        2 / cases["e_lookahead_loopback"]["new_tokens"]
    assert report["config"]["assistant_dir"] == str(tiny_llama_pair.draft_pt_dir)


def test_bench_skips_assisted_case_without_a_pytorch_draft(tiny_llama_pair, tmp_path,
                                                           monkeypatch):
    monkeypatch.setenv("EDGESPEC_CACHE", str(tmp_path / "empty-cache"))
    report = run(tmp_path, tiny_llama_pair)
    assert "b_hf_assisted" not in report["cases"]
    assert report["config"]["assistant_dir"] is None
    assert report["cases"]["c_edgespec_loopback"]["outputs_identical_to_target"] == 2


def test_draft_step_reports_the_drafters_cost_per_token(tiny_llama_pair, tmp_path):
    """edge_client.bench.draft_step on the tiny draft (5 rounds): the report has every
    figure, each a positive time."""
    from edge_client.bench.draft_step import main

    out = tmp_path / "step.json"
    assert main(["--draft-dir", str(tiny_llama_pair.draft_dir), "--context", "16",
                 "--rounds", "5", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["rounds"] == 5 and report["forward_ms"] > 0
    for name in ("greedy", "t0.7"):
        assert report[f"propose_ms_per_token_{name}"] > 0
