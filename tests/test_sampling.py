"""Tests for cloud_verifier.sampling (the target's p, torch) and edge_client.sampling (the
draft's q, numpy), which must shape a row of logits identically."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from cloud_verifier.sampling import SamplingParams, target_probs
from edge_client.sampling import sample, truncated_distribution

REPO_ROOT = Path(__file__).resolve().parents[1]

# ---------------------------------------------------------------------------------------------
# SamplingParams


def test_defaults_are_greedy_and_valid() -> None:
    params = SamplingParams()
    params.validate()
    assert params.is_greedy
    assert not SamplingParams(temperature=0.7).is_greedy


@pytest.mark.parametrize("fields, match", [
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": math.inf}, "temperature"),
    ({"temperature": math.nan}, "temperature"),
    ({"top_k": -1}, "top_k"),
    ({"top_k": 2.5}, "top_k"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_p": math.nan}, "top_p"),
    ({"seed": -1}, "seed"),
    ({"seed": 2**64}, "seed"),
])
def test_validate_rejects(fields, match) -> None:
    with pytest.raises(ValueError, match=match):
        SamplingParams(**fields).validate()


def test_validate_accepts_edges() -> None:
    SamplingParams(temperature=1e-6, top_k=1, top_p=1e-9, seed=2**64 - 1).validate()
    SamplingParams(temperature=1, top_p=1).validate()


# ---------------------------------------------------------------------------------------------
# target_probs


def _probs(logits, **fields) -> torch.Tensor:
    return target_probs(torch.tensor([logits], dtype=torch.float32), SamplingParams(**fields))[0]


def test_greedy_is_one_hot_of_argmax_lowest_id_on_ties() -> None:
    out = target_probs(torch.tensor([[0.0, 5.0, 5.0, 1.0], [3.0, -1.0, 2.0, 3.0]]),
                       SamplingParams())
    torch.testing.assert_close(out, torch.tensor([[0.0, 1, 0, 0], [1, 0, 0, 0]]))
    assert out.dtype == torch.float32


def test_temperature_scales_logits() -> None:
    logits = [1.0, 2.0, 0.5, -1.0]
    torch.testing.assert_close(_probs(logits, temperature=2.0),
                               torch.softmax(torch.tensor(logits) / 2, dim=0))
    torch.testing.assert_close(_probs(logits, temperature=1.0),
                               torch.softmax(torch.tensor(logits), dim=0))


def test_top_k_keeps_k_largest() -> None:
    logits = [1.0, 4.0, 3.0, 0.0, 2.0]
    out = _probs(logits, temperature=1.0, top_k=2)
    expected = torch.zeros(5)
    expected[[1, 2]] = torch.softmax(torch.tensor([4.0, 3.0]), dim=0)
    torch.testing.assert_close(out, expected)
    # k >= V keeps everything.
    torch.testing.assert_close(_probs(logits, temperature=1.0, top_k=9),
                               torch.softmax(torch.tensor(logits), dim=0))


def test_top_k_tie_keeps_lowest_ids() -> None:
    out = _probs([1.0, 2.0, 2.0, 2.0, 0.0], temperature=1.0, top_k=2)
    torch.testing.assert_close(out, torch.tensor([0.0, 0.5, 0.5, 0.0, 0.0]))


def test_top_p_keeps_the_token_that_crosses_the_threshold() -> None:
    probs = torch.tensor([0.05, 0.5, 0.25, 0.2])
    logits = probs.log().tolist()
    # 0.5 < 0.6, so the next token (0.25) is needed to reach 0.6 and is kept.
    out = _probs(logits, temperature=1.0, top_p=0.6)
    torch.testing.assert_close(out, torch.tensor([0.0, 2 / 3, 1 / 3, 0.0]))
    # The most probable token always survives.
    torch.testing.assert_close(_probs(logits, temperature=1.0, top_p=1e-6),
                               torch.tensor([0.0, 1.0, 0.0, 0.0]))
    torch.testing.assert_close(_probs(logits, temperature=1.0, top_p=0.9),
                               torch.tensor([0.0, 0.5, 0.25, 0.2]) / 0.95)


def test_top_p_applies_after_top_k_renormalisation() -> None:
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    # After top-k = 2: 4/7 and 3/7; 4/7 = 0.571 reaches top_p = 0.5 alone.
    out = _probs(probs.log().tolist(), temperature=1.0, top_k=2, top_p=0.5)
    torch.testing.assert_close(out, torch.tensor([1.0, 0, 0, 0]))
    # Without top-k, 0.4 < 0.5 needs the second token too.
    out = _probs(probs.log().tolist(), temperature=1.0, top_p=0.5)
    torch.testing.assert_close(out, torch.tensor([4 / 7, 3 / 7, 0, 0]))


def test_temperature_applies_before_top_p() -> None:
    probs = torch.tensor([0.6, 0.3, 0.1])
    # Colder: 0.6 ** 2 / (0.36 + 0.09 + 0.01) = 0.78 alone reaches 0.7.
    out = _probs(probs.log().tolist(), temperature=0.5, top_p=0.7)
    torch.testing.assert_close(out, torch.tensor([1.0, 0, 0]))


def test_infinite_and_huge_logits_are_safe() -> None:
    ninf = -math.inf
    for fields in ({"temperature": 1.0}, {"temperature": 0.01, "top_k": 2},
                   {"temperature": 3.0, "top_p": 0.9}, {}):
        out = _probs([ninf, 1.0, ninf, 0.5], **fields)
        assert not torch.isnan(out).any()
        assert out[0] == 0 and out[2] == 0
        assert out.sum().item() == pytest.approx(1.0)
        out = _probs([3e38, -3e38, 1e30, ninf], **fields)
        assert not torch.isnan(out).any() and out[0] == 1.0
        out = _probs([math.inf, 0.0, math.inf], **fields)
        assert not torch.isnan(out).any() and out[1] == 0
    out = _probs([1.0, 2.0], temperature=1e-30)
    torch.testing.assert_close(out, torch.tensor([0.0, 1.0]))


def test_half_precision_input_gives_float32() -> None:
    logits = torch.randn(3, 10).to(torch.bfloat16)
    out = target_probs(logits, SamplingParams(temperature=0.8, top_k=5))
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.sum(1), torch.ones(3))


def test_rows_without_a_finite_maximum_are_rejected() -> None:
    with pytest.raises(ValueError, match="finite"):
        _probs([-math.inf, -math.inf], temperature=1.0)
    with pytest.raises(ValueError, match="finite"):
        _probs([0.0, math.nan], temperature=1.0)
    with pytest.raises(ValueError, match=r"\[N, V\]"):
        target_probs(torch.zeros(4), SamplingParams(temperature=1.0))
    with pytest.raises(ValueError, match="top_p"):
        _probs([0.0, 1.0], temperature=1.0, top_p=0.0)


# ---------------------------------------------------------------------------------------------
# Edge: truncated_distribution must agree with target_probs

SETTINGS = [
    (1.0, 0, 1.0),
    (0.7, 0, 1.0),
    (1.3, 40, 1.0),
    (1.0, 0, 0.9),
    (0.6, 50, 0.8),
    (2.0, 3, 0.95),
    (1.0, 1, 1.0),
    (0.9, 2000, 0.5),
    (0.0, 0, 1.0),
    (0.0, 7, 0.3),
]


def _dense_from_edge(logits: np.ndarray, t: float, k: int, p: float,
                     max_support: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    ids, probs = truncated_distribution(logits, t, k, p, max_support)
    dense = np.zeros(logits.size, dtype=np.float32)
    dense[ids] = probs
    return ids, probs, dense


def _check_sparse(ids: np.ndarray, probs: np.ndarray) -> None:
    assert ids.dtype == np.int64 and probs.dtype == np.float32
    assert (probs > 0).all()
    assert np.all(np.diff(probs) <= 0), "not sorted by descending probability"
    assert abs(float(probs.sum(dtype=np.float32)) - 1) < 1e-6
    assert len(set(ids.tolist())) == ids.size


@pytest.mark.parametrize("t, k, p", SETTINGS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_edge_matches_target_probs(t: float, k: int, p: float, seed: int) -> None:
    rng = np.random.default_rng(seed)
    logits = (rng.normal(size=1000) * 3).astype(np.float32)
    logits[rng.integers(0, 1000, size=20)] = -np.inf
    ids, probs, dense = _dense_from_edge(logits, t, k, p)
    _check_sparse(ids, probs)
    reference = target_probs(torch.from_numpy(logits)[None], SamplingParams(t, k, p))[0].numpy()
    np.testing.assert_array_equal(np.flatnonzero(dense), np.flatnonzero(reference))
    np.testing.assert_allclose(dense, reference, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("t, k, p", SETTINGS)
def test_edge_matches_target_probs_with_ties(t: float, k: int, p: float) -> None:
    logits = np.random.default_rng(3).integers(-4, 4, size=300).astype(np.float32)
    _, _, dense = _dense_from_edge(logits, t, k, p)
    reference = target_probs(torch.from_numpy(logits)[None], SamplingParams(t, k, p))[0].numpy()
    np.testing.assert_array_equal(np.flatnonzero(dense), np.flatnonzero(reference))
    np.testing.assert_allclose(dense, reference, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("t, k, p", [(1.0, 0, 1.0), (0.8, 100, 0.95), (1.5, 10, 1.0),
                                     (1.0, 0, 0.5)])
@pytest.mark.parametrize("cap", [1, 5, 30])
def test_max_support_keeps_the_most_probable_prefix(t: float, k: int, p: float, cap: int) -> None:
    logits = np.random.default_rng(cap).normal(size=500) * 2
    full_ids, full_probs = truncated_distribution(logits, t, k, p, 0)
    ids, probs = truncated_distribution(logits, t, k, p, cap)
    _check_sparse(ids, probs)
    n = min(cap, full_ids.size)
    np.testing.assert_array_equal(ids, full_ids[:n])
    np.testing.assert_allclose(probs, full_probs[:n] / full_probs[:n].sum(), rtol=1e-5)


def test_edge_greedy_and_ties() -> None:
    ids, probs = truncated_distribution(np.array([0.0, 3.0, 3.0, 1.0]), 0.0, 0, 1.0, 0)
    assert ids.tolist() == [1] and probs.tolist() == [1.0]
    ids, probs = truncated_distribution(np.array([2.0, 5.0, 5.0, 5.0]), 1.0, 0, 1.0, 2)
    assert ids.tolist() == [1, 2]
    np.testing.assert_allclose(probs, [0.5, 0.5])


def test_edge_drops_zero_probability_tokens() -> None:
    logits = np.array([0.0, -np.inf, -200.0, 1.0, -np.inf], dtype=np.float32)
    ids, probs = truncated_distribution(logits, 1.0, 0, 1.0, 0)
    _check_sparse(ids, probs)
    assert ids.tolist() == [3, 0]  # exp(-200) underflows in float32


def test_edge_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="finite"):
        truncated_distribution(np.array([-np.inf, -np.inf]), 1.0, 0, 1.0, 0)
    with pytest.raises(ValueError, match="finite"):
        truncated_distribution(np.array([np.nan, 1.0]), 1.0, 0, 1.0, 0)
    with pytest.raises(ValueError, match=r"\[V\]"):
        truncated_distribution(np.zeros((2, 2)), 1.0, 0, 1.0, 0)
    for t, k, p, cap in [(-1.0, 0, 1.0, 0), (1.0, -1, 1.0, 0), (1.0, 0, 0.0, 0),
                         (1.0, 0, 1.0, -1), (math.nan, 0, 1.0, 0)]:
        with pytest.raises(ValueError):
            truncated_distribution(np.zeros(3), t, k, p, cap)


# ---------------------------------------------------------------------------------------------
# Edge: sample


def test_sample_follows_probs() -> None:
    """50,000 draws; each id within 6 * sqrt(n * p * (1 - p)) + 5 of n * p; p = 0 never drawn."""
    n = 50_000
    ids = np.array([42, 7, 1000, 3, 9], dtype=np.int64)
    probs = np.array([0.5, 0.25, 0.15, 0.1, 0.0], dtype=np.float32)
    rng = np.random.default_rng(0)
    drawn = np.array([sample(ids, probs, rng) for _ in range(n)])
    counts = np.array([(drawn == i).sum() for i in ids])
    expected = n * probs.astype(np.float64)
    bound = 6 * np.sqrt(expected * (1 - probs)) + 5
    assert np.all(np.abs(counts - expected) <= bound), (counts, expected)
    assert counts[-1] == 0
    assert set(drawn.tolist()) <= set(ids.tolist())


def test_sample_uses_exactly_one_draw() -> None:
    ids, probs = truncated_distribution(np.random.default_rng(1).normal(size=100), 1.0, 0, 1.0, 0)
    rng = np.random.default_rng(9)
    replay = np.random.default_rng(9)
    for _ in range(100):
        sample(ids, probs, rng)
        replay.random()
        assert rng.bit_generator.state == replay.bit_generator.state


def test_sample_point_mass_and_round_off() -> None:
    rng = np.random.default_rng(0)
    assert sample(np.array([5]), np.array([1.0], dtype=np.float32), rng) == 5
    # Probs summing a little under 1: the uniform is scaled, the zero-probability tail never won.
    ids = np.array([1, 2, 3])
    probs = np.array([0.5, 0.4999999, 0.0], dtype=np.float32)
    assert {sample(ids, probs, rng) for _ in range(200)} == {1, 2}


def test_sample_is_seeded() -> None:
    ids, probs = truncated_distribution(np.random.default_rng(2).normal(size=50), 1.0, 0, 1.0, 0)
    rng_a, rng_b = np.random.default_rng(4), np.random.default_rng(4)
    a = [sample(ids, probs, rng_a) for _ in range(100)]
    b = [sample(ids, probs, rng_b) for _ in range(100)]
    assert a == b


def test_sample_rejects_bad_input() -> None:
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError):
        sample(np.array([1, 2]), np.array([0.5], dtype=np.float32), rng)
    with pytest.raises(ValueError):
        sample(np.array([], dtype=np.int64), np.array([], dtype=np.float32), rng)
    with pytest.raises(ValueError):
        sample(np.array([1, 2]), np.array([0.0, 0.0], dtype=np.float32), rng)


def test_edge_sampling_does_not_import_torch() -> None:
    code = "import sys, edge_client.sampling; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True,
                         text=True, check=True, timeout=60)
    assert out.stdout.strip() == "False"
