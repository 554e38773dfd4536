"""Tests for cloud_verifier.verification: exact residual algebra, hand-built certainties, seeded
determinism, and the output distribution of the full draft + verify process."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from cloud_verifier.verification import (
    residual_distribution,
    sparse_to_dense,
    verify,
    verify_greedy,
)

# ---------------------------------------------------------------------------------------------
# Statistical checks
#
# A position-dependent but prefix-independent model (row t of P is p at absolute position t, row
# t of Q is q there) is a valid target and draft, and makes every law below exact. V = 8.
# Each bin is checked with |count - N * pr| <= 6 * sqrt(N * pr * (1 - pr)) + 5, and bins with
# pr = 0 must be empty.
#
# Calling verify 50,000 times per case takes 15-35 s per K on this 2-core machine, so the
# large runs use _verify_many, a numpy transcription of verify that takes its uniforms as an
# array. test_verify_many_replays_verify checks that it returns exactly what verify returns,
# trial by trial, when fed the uniforms verify draws from its generator.

N_SAMPLES = 100_000
N_REPLAY = 2_000
P = np.array([
    [9, 4, 2, 2, 1, 1, 1, 0],
    [1, 1, 2, 3, 5, 4, 4, 0],
    [0, 5, 5, 2, 2, 2, 2, 2],
    [2, 2, 2, 2, 3, 3, 3, 3],
    [8, 0, 4, 0, 4, 0, 4, 0],
    [1, 2, 3, 4, 4, 3, 2, 1],
], dtype=np.float64) / 20  # [positions, V]
Q = np.array([
    [4, 6, 2, 1, 2, 1, 0, 4],  # id 7: q > 0 where p = 0; id 6: q = 0 where p > 0
    [2, 1, 2, 2, 6, 3, 1, 3],
    [3, 4, 6, 1, 2, 2, 1, 1],
    [5, 0, 2, 3, 3, 2, 3, 2],
    [4, 4, 2, 2, 2, 2, 2, 2],
    [2, 2, 2, 4, 4, 2, 2, 2],
], dtype=np.float64) / 20
# Point-mass drafts per position; position 3 drafts id 1, where p = 0.
POINT = [0, 4, 1, 1, 0, 3]
V = P.shape[1]
P32 = P.astype(np.float32)
Q32 = Q.astype(np.float32)


def _assert_counts(counts: np.ndarray, probs: np.ndarray, n: int) -> None:
    expected = n * probs
    bound = 6 * np.sqrt(n * probs * (1 - probs)) + 5
    bad = np.abs(counts - expected) > bound
    assert not bad.any(), (f"counts {counts[bad]} vs expected {expected[bad]} "
                           f"(bound {bound[bad]}) at {np.argwhere(bad).tolist()}")
    assert counts[probs == 0].sum() == 0, "a zero-probability outcome occurred"


def _exact_stop_law(k: int, dense: bool) -> np.ndarray:
    """[K+1, V]: P(exactly n drafts accepted and next_token = v) for one round at position 0."""
    law = np.zeros((k + 1, V))
    reach = 1.0  # P(the first n drafts were accepted)
    for n in range(k):
        if dense:
            overlap = np.minimum(P[n], Q[n])
        else:
            overlap = np.zeros(V)
            overlap[POINT[n]] = P[n, POINT[n]]
        beta = overlap.sum()
        # (1 - beta) * residual = p - min(p, q), with no division needed.
        law[n] = reach * (P[n] - overlap)
        reach *= beta
    law[k] = reach * P[k]
    return law


def _drafts(rng: np.random.Generator, start: int, k: int, dense: bool, n: int) -> np.ndarray:
    """[n, K] draft tokens for positions start .. start+K-1: sampled from Q, or POINT."""
    if not dense:
        return np.tile(np.array(POINT[start:start + k], dtype=np.int64), (n, 1))
    cols = [rng.choice(V, size=n, p=Q[t]) for t in range(start, start + k)]
    return np.stack(cols, axis=1).reshape(n, k)


def _verify_many(tokens: np.ndarray, start: int, dense: bool,
                 u: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """verify for N independent rounds at positions start.., in numpy, float for float.

    tokens: [N, K]; u: [N, K+1], row i holding the uniforms verify would draw in order.
    Returns n [N] and next_token [N].
    """
    trials, k = tokens.shape
    rows = np.arange(trials)
    p = P32[start:start + k + 1]  # [K+1, V]
    p_x = p[np.arange(k), tokens].astype(np.float64)  # [N, K]
    q_x = Q32[start:start + k][np.arange(k), tokens].astype(np.float64) if dense else 1.0
    rejected = ~(u[:, :k] < p_x / q_x)  # [N, K]
    n = np.where(rejected.any(axis=1), rejected.argmax(axis=1), k)  # [N]

    if dense:
        residual = np.maximum(p[:k] - Q32[start:start + k], np.float32(0))  # [K, V]
        weights = np.concatenate([residual, p[k:]])[n]  # [N, V]
    else:
        weights = p[n].copy()
        stopped = n < k
        weights[rows[stopped], tokens[stopped, n[stopped]]] = 0
    cdf = np.cumsum(weights, axis=1, dtype=np.float64)
    empty = cdf[:, -1] == 0  # the residual fallback: p itself
    cdf[empty] = np.cumsum(p[n[empty]], axis=1, dtype=np.float64)
    total = cdf[:, -1]
    x = total * u[rows, np.minimum(n + 1, k)]
    picked = (cdf <= x[:, None]).sum(axis=1)  # searchsorted, right side
    last = (cdf < total[:, None]).sum(axis=1)  # searchsorted of the total, left side
    return n, np.where(x >= total, last, picked)


def _simulate(k: int, dense: bool, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Drafts and verifies N_SAMPLES times, continuing with a second round (at position 1)
    when the first emitted a single token; returns the first round's counts of
    (n, next_token) [K+1, V] and the counts of the first two emitted tokens [V, V]."""
    rng = np.random.default_rng(seed)
    tokens1 = _drafts(rng, 0, k, dense, N_SAMPLES)
    n1, next1 = _verify_many(tokens1, 0, dense, rng.random((N_SAMPLES, k + 1)))
    tokens2 = _drafts(rng, 1, k, dense, N_SAMPLES)
    n2, next2 = _verify_many(tokens2, 1, dense, rng.random((N_SAMPLES, k + 1)))

    first = np.where(n1 >= 1, tokens1[:, 0], next1)
    second_round2 = np.where(n2 >= 1, tokens2[:, 0], next2)
    second = np.where(n1 >= 2, tokens1[:, min(1, k - 1)], np.where(n1 == 1, next1, second_round2))
    stop = np.zeros((k + 1, V), dtype=np.int64)
    np.add.at(stop, (n1, next1), 1)
    joint = np.zeros((V, V), dtype=np.int64)
    np.add.at(joint, (first, second), 1)
    return stop, joint


@pytest.mark.parametrize("dense", [True, False], ids=["dense_q", "point_mass_q"])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_verify_many_replays_verify(k: int, dense: bool) -> None:
    """2,000 rounds, each with its own seeded generator: identical (n, next_token)."""
    rng = np.random.default_rng(k)
    for start in (0, 1):
        tokens = _drafts(rng, start, k, dense, N_REPLAY)
        p = torch.from_numpy(P32[start:start + k + 1])
        q = torch.from_numpy(Q32[start:start + k]) if dense else None
        u = np.empty((N_REPLAY, k + 1))
        expected = []
        for trial in range(N_REPLAY):
            seed = 7919 * trial + 13 * k + start
            expected.append(verify(tokens[trial].tolist(), q, p,
                                   torch.Generator().manual_seed(seed)))
            replay = torch.Generator().manual_seed(seed)
            u[trial] = [torch.rand((), dtype=torch.float64, generator=replay).item()
                        for _ in range(k + 1)]
        n, nxt = _verify_many(tokens, start, dense, u)
        assert list(zip(n.tolist(), nxt.tolist(), strict=True)) == expected
        assert len(set(n.tolist())) > 1


@pytest.mark.parametrize("dense", [True, False], ids=["dense_q", "point_mass_q"])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_draft_and_verify_follow_the_target(k: int, dense: bool) -> None:
    """100,000 full draft + verify runs per case; bound 6 sigma + 5 per bin (see above).

    (b) (n accepted, next token) follows the exact law: P(stop at n) = prod_{i<n} beta_i *
    (1 - beta_n), next ~ residual_n for n < K and ~ p_{K+1} for n = K; (a) the first emitted
    token follows p_1 and the first two emitted tokens follow p_1(a) * p_2(b).
    """
    stop, joint = _simulate(k, dense, seed=1000 + 10 * k + dense)
    _assert_counts(stop, _exact_stop_law(k, dense), N_SAMPLES)
    _assert_counts(joint.sum(axis=1), P[0], N_SAMPLES)
    _assert_counts(joint, np.outer(P[0], P[1]), N_SAMPLES)


@pytest.mark.parametrize("dense", [True, False], ids=["dense_q", "point_mass_q"])
def test_verify_itself_follows_the_target(dense: bool) -> None:
    """verify called directly, K = 2, 10,000 rounds; same law and bound as above."""
    trials, k = 10_000, 2
    rng = np.random.default_rng(5 + dense)
    gen = torch.Generator().manual_seed(5 + dense)
    tokens = _drafts(rng, 0, k, dense, trials).tolist()
    p = torch.from_numpy(P32[:k + 1])
    q = torch.from_numpy(Q32[:k]) if dense else None
    stop = np.zeros((k + 1, V), dtype=np.int64)
    for t in tokens:
        stop[verify(t, q, p, gen)] += 1
    _assert_counts(stop, _exact_stop_law(k, dense), trials)


def test_exact_stop_law_sums_to_one() -> None:
    for k in (1, 2, 4):
        for dense in (True, False):
            assert _exact_stop_law(k, dense).sum() == pytest.approx(1.0, abs=1e-12)


# ---------------------------------------------------------------------------------------------
# The residual, exactly


def _random_rows(seed: int, v: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(3 * torch.randn(4, v, generator=g, dtype=torch.float64), dim=1)
    q = torch.softmax(3 * torch.randn(4, v, generator=g, dtype=torch.float64), dim=1)
    p[0, : v // 3] = 0  # some p = 0 where q > 0
    p[0] /= p[0].sum()
    return p, q


@pytest.mark.parametrize("v", [2, 7, 100, 5000])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_residual_reconstructs_p(v: int, seed: int) -> None:
    """min(p, q) + (1 - sum min(p, q)) * residual(p, q) == p: the verifier's output law."""
    p, q = _random_rows(seed, v)
    overlap = torch.minimum(p, q)
    rebuilt = overlap + (1 - overlap.sum(1, keepdim=True)) * residual_distribution(p, q)
    torch.testing.assert_close(rebuilt, p, rtol=0, atol=1e-12)
    # Row by row (1-D) gives the same as batched.
    torch.testing.assert_close(residual_distribution(p[1], q[1]), residual_distribution(p, q)[1])


def test_residual_float32() -> None:
    p, q = _random_rows(3, 1000)
    p, q = p.float(), q.float()
    overlap = torch.minimum(p, q)
    rebuilt = overlap + (1 - overlap.sum(1, keepdim=True)) * residual_distribution(p, q)
    torch.testing.assert_close(rebuilt, p, rtol=0, atol=1e-6)


def test_residual_p_equals_q_falls_back_to_p() -> None:
    p, _ = _random_rows(4, 50)
    r = residual_distribution(p, p.clone())
    assert not torch.isnan(r).any()
    torch.testing.assert_close(r, p)


def test_residual_point_mass_q() -> None:
    p, _ = _random_rows(5, 30)
    q = torch.zeros_like(p)
    q[torch.arange(4), torch.tensor([3, 0, 29, 7])] = 1
    r = residual_distribution(p, q)
    for row, x in enumerate([3, 0, 29, 7]):
        expected = p[row].clone()
        expected[x] = 0
        torch.testing.assert_close(r[row], expected / expected.sum(), rtol=0, atol=1e-12)
    overlap = torch.minimum(p, q)
    rebuilt = overlap + (1 - overlap.sum(1, keepdim=True)) * r
    torch.testing.assert_close(rebuilt, p, rtol=0, atol=1e-12)


def test_residual_of_one_hot_p_and_same_q_is_p() -> None:
    p = torch.tensor([0.0, 1.0, 0.0])
    torch.testing.assert_close(residual_distribution(p, p.clone()), p)


# ---------------------------------------------------------------------------------------------
# Sampling verification: certain outcomes and input checks


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_p_of_one_is_always_accepted() -> None:
    p = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    q = torch.tensor([[0.5, 0.25, 0.25], [0.1, 0.1, 0.8]])
    gen = _gen()
    for _ in range(200):
        assert verify([1, 2], q, p, gen) == (2, 0)
        assert verify([1, 2], None, p, gen) == (2, 0)


def test_p_of_zero_is_never_accepted() -> None:
    p = torch.tensor([[0.5, 0.0, 0.5], [0.2, 0.3, 0.5]])
    q = torch.tensor([[0.0, 1e-6, 1 - 1e-6]])
    gen = _gen()
    for _ in range(200):
        n, token = verify([1], q, p, gen)
        assert n == 0 and token in (0, 2)
        n, token = verify([1], None, p, gen)
        assert n == 0 and token in (0, 2)


def test_correction_excludes_over_drafted_tokens() -> None:
    # Rejected draft 0 had q > p there; the residual lives on id 1 only.
    p = torch.tensor([[0.5, 0.5], [1.0, 0.0]])
    q = torch.tensor([[1.0, 0.0]])
    gen = _gen()
    outcomes = {verify([0], q, p, gen) for _ in range(200)}
    assert outcomes == {(1, 0), (0, 1)}


def test_empty_residual_falls_back_to_p() -> None:
    # p sums below q (think float round-off): draft 1 can be rejected, max(0, p - q) = 0.
    p = torch.tensor([[0.5, 0.25], [1.0, 0.0]])
    q = torch.tensor([[0.5, 0.5]])
    gen = _gen()
    outcomes = [verify([1], q, p, gen) for _ in range(300)]
    assert set(outcomes) == {(1, 0), (0, 0), (0, 1)}


def test_k_zero_samples_from_p1() -> None:
    gen = _gen()
    p = torch.tensor([[0.0, 0.0, 1.0, 0.0]])
    assert verify([], None, p, gen) == (0, 2)
    assert verify(torch.empty(0, dtype=torch.long), torch.empty(0, 4), p, gen) == (0, 2)
    with pytest.raises(ValueError, match="draft_probs"):
        verify([], torch.empty(1, 4), p, gen)


def test_zero_or_nonfinite_q_of_draft_is_rejected() -> None:
    p = torch.full((3, 4), 0.25)
    q = torch.full((2, 4), 0.25)
    q[1, 3] = 0
    with pytest.raises(ValueError, match="q = 0"):
        verify([0, 3], q, p, _gen())
    q[1, 3] = math.nan
    with pytest.raises(ValueError, match="q = nan"):
        verify([0, 3], q, p, _gen())


def test_invalid_input_draws_no_random_numbers() -> None:
    p = torch.full((2, 4), 0.25)
    q = torch.zeros(1, 4)
    gen = _gen(7)
    before = gen.get_state()
    with pytest.raises(ValueError):
        verify([2], q, p, gen)
    assert torch.equal(gen.get_state(), before)


@pytest.mark.parametrize("tokens, q_shape, p_shape, match", [
    ([0, 1], (2, 4), (2, 4), r"target_probs must have shape \[K\+1, V\] = \[3, V\]"),
    ([0, 1], (2, 4), (3,), "target_probs must have shape"),
    ([0, 1], (2, 5), (3, 4), r"draft_probs must have shape \[K, V\] = \[2, 4\]"),
    ([0, 1], (1, 4), (3, 4), "draft_probs must have shape"),
    ([0, 4], (2, 4), (3, 4), r"out of range \[0, 4\)"),
    ([-1, 0], (2, 4), (3, 4), "out of range"),
])
def test_shape_and_range_errors(tokens, q_shape, p_shape, match) -> None:
    with pytest.raises(ValueError, match=match):
        verify(tokens, torch.full(q_shape, 0.25), torch.full(p_shape, 0.25), _gen())


def test_non_integer_tokens_are_rejected() -> None:
    p = torch.full((2, 4), 0.25)
    with pytest.raises(ValueError):
        verify([1.0], None, p, _gen())
    with pytest.raises(ValueError):
        verify(torch.tensor([1.0]), None, p, _gen())


def test_token_tensor_and_list_agree() -> None:
    p = torch.softmax(torch.randn(4, 10, generator=_gen(1)), dim=1)
    q = torch.softmax(torch.randn(3, 10, generator=_gen(2)), dim=1)
    a, b = _gen(5), _gen(5)
    for _ in range(50):
        assert verify([3, 1, 4], q, p, a) == verify(torch.tensor([3, 1, 4]), q, p, b)


# ---------------------------------------------------------------------------------------------
# Randomness: seeded, and never one draw more than needed


def _sequence(seed: int, calls: int = 300) -> list[tuple[int, int]]:
    rows = torch.softmax(2 * torch.randn(5, 12, generator=_gen(99)), dim=1)
    q = torch.softmax(2 * torch.randn(4, 12, generator=_gen(98)), dim=1)
    gen = _gen(seed)
    out = []
    for i in range(calls):
        tokens = [(i + j) % 12 for j in range(4)]
        out.append(verify(tokens, q, rows, gen))
        out.append(verify(tokens[:2], None, rows[:3], gen))
    return out


def test_same_seed_same_outcomes() -> None:
    assert _sequence(11) == _sequence(11)


def test_different_seeds_differ() -> None:
    assert _sequence(11) != _sequence(12)


def test_draws_exactly_one_uniform_per_decision() -> None:
    """n < K: n + 1 acceptance tests and one correction draw; n = K: K tests and the bonus."""
    rows = torch.softmax(torch.randn(5, 6, generator=_gen(3)), dim=1)
    q = torch.softmax(torch.randn(4, 6, generator=_gen(4)), dim=1)
    gen = _gen(21)
    seen = set()
    for i in range(200):
        tokens = [(i * 7 + j) % 6 for j in range(4)]
        replay = torch.Generator().set_state(gen.get_state())
        n, _ = verify(tokens, q, rows, gen)
        seen.add(n)
        for _ in range(min(n + 1, 4) + 1):
            torch.rand((), dtype=torch.float64, generator=replay)
        assert torch.equal(replay.get_state(), gen.get_state())
    assert seen == {0, 1, 2, 3, 4}


# ---------------------------------------------------------------------------------------------
# Greedy verification


def _logits(argmaxes: list[int], v: int = 6) -> torch.Tensor:
    rows = torch.randn(len(argmaxes), v, generator=_gen(0))
    rows[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 10.0
    return rows


def test_greedy_full_match_takes_bonus() -> None:
    assert verify_greedy([1, 2, 3], _logits([1, 2, 3, 5])) == (3, 5)


def test_greedy_early_mismatch() -> None:
    assert verify_greedy([1, 2, 3], _logits([1, 4, 3, 5])) == (1, 4)


def test_greedy_first_position_mismatch() -> None:
    assert verify_greedy([0, 2, 3], _logits([1, 2, 3, 5])) == (0, 1)


def test_greedy_k_zero() -> None:
    assert verify_greedy([], _logits([4])) == (0, 4)


def test_greedy_tie_goes_to_lowest_id() -> None:
    logits = torch.tensor([[0.0, 3.0, 3.0, 1.0], [2.0, 2.0, 2.0, 2.0]])
    assert verify_greedy([2], logits) == (0, 1)
    assert verify_greedy([1], logits) == (1, 0)


def test_greedy_accepts_probabilities_too() -> None:
    probs = torch.softmax(_logits([1, 2, 3]), dim=1)
    assert verify_greedy([1, 2], probs) == (2, 3)


def test_greedy_shape_errors() -> None:
    with pytest.raises(ValueError, match="K\\+1"):
        verify_greedy([1, 2], _logits([1, 2]))
    with pytest.raises(ValueError, match="out of range"):
        verify_greedy([6], _logits([1, 2]))


# ---------------------------------------------------------------------------------------------
# Sparse q -> dense


def test_sparse_to_dense() -> None:
    dense = sparse_to_dense([[3, 0], [1]], [[0.75, 0.25], [1.0]], 5)
    expected = torch.tensor([[0.25, 0, 0, 0.75, 0], [0, 1.0, 0, 0, 0]])
    assert dense.dtype == torch.float32
    torch.testing.assert_close(dense, expected)
    assert sparse_to_dense([], [], 5).shape == (0, 5)


def test_sparse_to_dense_rejects_duplicates_and_mismatches() -> None:
    with pytest.raises(ValueError, match="more than once"):
        sparse_to_dense([[1, 1]], [[0.5, 0.5]], 4)
    with pytest.raises(ValueError):
        sparse_to_dense([[1]], [[0.5, 0.5]], 4)
    with pytest.raises(ValueError):
        sparse_to_dense([[1]], [], 4)
    with pytest.raises(ValueError, match="out of range"):
        sparse_to_dense([[4]], [[1.0]], 4)
