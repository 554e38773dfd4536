"""The feature-head acceptance bench's counting (edge_client.bench.feature_acceptance)."""

from __future__ import annotations

import numpy as np
import pytest

from edge_client.bench.feature_acceptance import accept_at, accept_sparse, replay

PATH = [5, 6, 7, 8, 9, 10, 11]


def test_perfect_drafts_commit_k_plus_one_tokens_a_round():
    c = replay(lambda t, n: PATH[t:t + n], PATH, k=2)
    # 7 tokens: rounds of 3, 3, then 1 (no drafts judged past the end)
    assert (c.rounds, c.tokens, c.accepted, c.judged) == (3, 7, 5, 5)
    assert c.summary()["greedy_alpha"] == 1.0


def test_a_round_judges_up_to_its_first_rejection():
    # Drafts right once, then wrong: each round accepts 1 and judges 2.
    c = replay(lambda t, n: [PATH[t], -1][:n], PATH, k=3)
    assert c.rounds == 4 and c.tokens == 7
    assert c.accepted == 3 + 1 and c.judged == 2 * 3 + 1  # the last round: 1 draft, right


def test_a_start_counts_only_the_later_rounds():
    c = replay(lambda t, n: [-1] * n, PATH, k=4, start=1)
    assert c.rounds == 6 and c.tokens == 6 and c.accepted == 0 and c.judged == 6


def test_acceptance_at_temperature_is_one_minus_tv():
    p = np.array([2.0, 1.0, 0.0])
    assert accept_at(p, p, 0.7) == pytest.approx(1.0)
    q = np.array([0.0, 1.0, 2.0])
    sp = np.exp(p / 0.7) / np.exp(p / 0.7).sum()
    sq = np.exp(q / 0.7) / np.exp(q / 0.7).sum()
    assert accept_at(p, q, 0.7) == pytest.approx(1 - 0.5 * np.abs(sp - sq).sum())
    assert accept_sparse(p, (np.array([1, 2]), sq[1:] / sq[1:].sum()), 0.7) == pytest.approx(
        min(sp[1], sq[1] / sq[1:].sum()) + min(sp[2], sq[2] / sq[1:].sum()))


def test_the_bench_runs_both_drafts_on_the_realistic_set(tiny_llama_pair, tmp_path):
    """End to end on the tiny pair with an untrained head: both drafts replay the same paths
    (same committed tokens), the head pays one draft-free first round per prompt, and the
    report holds every figure per category."""
    import json

    from feature_heads import export_untrained_head

    from edge_client.bench.eval_set import CATEGORIES
    from edge_client.bench.feature_acceptance import main

    head = export_untrained_head(tiny_llama_pair.target_dir, tmp_path / "head")
    out = tmp_path / "fa.json"
    assert main(["--head", str(head), "--draft-dir", str(tiny_llama_pair.draft_dir),
                 "--target", str(tiny_llama_pair.target_dir), "--per-category", "1",
                 "--max-new-tokens", "6", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report["by_category"]) == set(CATEGORIES)
    ind, feat = report["overall"]["independent"], report["overall"]["feature_head"]
    assert ind["tokens"] == feat["tokens"] > 0
    assert feat["rounds"] >= len(CATEGORIES) + 1  # at least the first rounds, and one more
    for s in (ind, feat):
        assert 0 <= s["greedy_alpha"] <= 1 and 0 < s["accept_t0.7"] <= 1
        assert s["forwards_per_token"] == round(s["rounds"] / s["tokens"], 4)
    assert report["step_ms"]["feature_head"] > 0 and report["bytes_on_disk"]["feature_head"] > 0


@pytest.mark.parametrize("layers", [(), (0, 1)], ids=["final-feature", "fused-layers"])
def test_the_bench_adds_a_context_head_on_the_same_paths(tiny_llama_pair, tmp_path, layers):
    import json

    from feature_heads import export_untrained_head, save_untrained_context_run

    from edge_client.bench.feature_acceptance import main

    head = export_untrained_head(tiny_llama_pair.target_dir, tmp_path / "head")
    run = save_untrained_context_run(tiny_llama_pair.target_dir, tmp_path / "ctx",
                                     feature_layers=layers)
    out = tmp_path / "fa.json"
    assert main(["--head", str(head), "--context-run", str(run), "--draft-dir",
                 str(tiny_llama_pair.draft_dir), "--target", str(tiny_llama_pair.target_dir),
                 "--per-category", "1", "--max-new-tokens", "6", "--context-past", "16",
                 "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    ind, ctx = report["overall"]["independent"], report["overall"]["context_head"]
    assert ctx["tokens"] == ind["tokens"] > 0
    assert ctx["rounds"] >= len(report["by_category"]) + 1  # a draft-free first round each
    assert 0 <= ctx["greedy_alpha"] <= 1 and 0 < ctx["accept_t0.7"] <= 1
    assert all("context_head" in c for c in report["by_category"].values())
    assert report["step_ms"]["context_head"] > 0 and report["step_ms"]["feature_head_past0"] > 0
