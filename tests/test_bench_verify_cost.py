"""The verify-cost and layout benchmarks: their arithmetic, their prefilled caches, and one
run of each on the tiny target."""

from __future__ import annotations

import pytest
import torch

from cloud_verifier.bench import layout as bench_layout
from cloud_verifier.bench.verify_cost import (
    best_gain,
    break_even_alpha,
    doubling_bound,
    fit_costs,
    main,
    prefilled_kvs,
)
from cloud_verifier.draft_policy import expected_tokens


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("ratio", [1.0, 1.3, 2.0, 2.9])
def test_break_even_alpha_solves_expected_tokens_equal_cost(k, ratio):
    alpha = break_even_alpha(ratio, k)
    if ratio > k + 1:
        assert alpha is None
    else:
        assert expected_tokens(alpha, k) == pytest.approx(ratio, abs=1e-9)
    assert break_even_alpha(k + 1.5, k) is None  # not even full acceptance pays


def test_best_gain_picks_the_k_with_most_tokens_per_forward_time():
    # K=1 costs 1.2 steps, K=2 costs 3: at alpha 0.5, E(1) = 1.5 -> 1.25x, E(2) = 1.75 -> 0.58x.
    k, gain = best_gain([100.0, 120.0, 300.0], 0.5)
    assert k == 1 and gain == pytest.approx(1.5 / 1.2)
    # When every round costs more than it yields, plain decoding (K=0, 1x) wins.
    assert best_gain([100.0, 400.0, 900.0], 0.5) == (0, 1.0)


def test_doubling_bound_compares_ideal_spec_at_twice_the_load_with_the_baseline():
    # Baseline at 4 sessions: 100 ms a token. At 8 sessions, K = 1 costs 150 ms for
    # E(1) = 1.5 tokens at alpha 0.5 -> 100 ms a token (ratio 1.0); K = 2 costs 210 ms for
    # 1.75 -> 120. Plain decoding at 8 (130) is worse than K = 1.
    costs = {4: [100.0, 130.0, 180.0], 8: [130.0, 150.0, 210.0]}
    bound = doubling_bound(costs, 0.5)
    assert list(bound) == [4]  # 8 -> 16 was not measured
    assert bound[4][0] == 1 and bound[4][1] == pytest.approx(1.0)


def test_fit_recovers_fixed_session_and_token_costs():
    def ms(b, k):
        return 130 + 5 * b + 2 * b * (k + 1)

    # The lone 1-token forward is off the line (a faster kernel) and must not enter the fit.
    costs = {b: [ms(b, k) for k in range(5)] for b in (1, 2, 4, 8)}
    costs[1][0] = 70.0
    a, s, t = fit_costs(costs)
    assert (a, s, t) == pytest.approx((130, 5, 2))
    with pytest.raises(ValueError):
        fit_costs({1: [70.0, 80.0]})


def test_runs_on_the_tiny_target(tiny_llama_pair, capsys):
    assert main(["--model", str(tiny_llama_pair.target_dir), "--batches", "1", "2", "3",
                 "--max-k", "2", "--alphas", "0.5", "--repeats", "1"]) == 0
    out = capsys.readouterr().out.split("\n\n")
    rows = [line for line in out[0].splitlines() if line.startswith("| ")]
    assert [r.split("|")[1].strip() for r in rows[1:]] == ["1", "2", "3"]
    assert all(len(r.split("|")) == len(rows[0].split("|")) for r in rows)
    doubling = [line for line in out[1].splitlines() if line.startswith("| ")]
    assert [r.split("|")[1].strip() for r in doubling[1:]] == ["1 -> 2"]


def test_prefilled_caches_continue_like_the_whole_sequence(target):
    """What both benchmarks time is a real verify step: after prefill, a packed forward over
    3 new tokens per session gives the model's own logits for context + those tokens."""
    from cloud_verifier.packed_forward import Segment, packed_forward

    contexts = [[(7 * i + j) % target.vocab_size for j in range(n)]
                for i, n in enumerate((5, 12, 30))]
    kvs = prefilled_kvs(target, contexts, 3)
    assert [kv.length for kv in kvs] == [5, 12, 30]
    out = packed_forward(target.model, [Segment(kv, [1, 2, 3], 3) for kv in kvs])
    with torch.no_grad():
        for got, c in zip(out, contexts, strict=True):
            want = target.model(torch.tensor([c + [1, 2, 3]])).logits[0, -3:]
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_layout_bench_runs_on_the_tiny_target(tiny_llama_pair, capsys):
    assert bench_layout.main(["--model", str(tiny_llama_pair.target_dir), "--batches", "1",
                              "3", "--k", "2", "--repeats", "1"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert [r.split("|")[1].strip() for r in rows[1:]] == ["1", "3"]
    assert all(r.endswith("x |") for r in rows[1:])
