"""How many drafts are worth verifying, from the draft's confidences (shared.draft_length)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from cloud_verifier.draft_policy import draft_token_cost, suggest_draft_len
from shared.draft_length import worth_verifying


def brute_force(confidence: list[float], cost: float) -> int:
    values = []
    for k in range(len(confidence) + 1):
        expected = 1 + sum(np.prod(confidence[:i]) for i in range(1, k + 1))
        values.append(expected / (1 + cost * (k + 1)))
    return int(np.argmax(np.round(values, 9)))  # the first (shortest) best on a tie


def test_worked_example():
    # k = 0: 1/1.2 = 0.833; k = 1: 1.9/1.4 = 1.357; k = 2: 2.35/1.6 = 1.469;
    # k = 3: 2.44/1.8 = 1.356 -> two drafts are worth their cost, the third is not.
    assert worth_verifying([0.9, 0.5, 0.2], 0.2) == 2


def test_free_tokens_verify_every_draft_that_may_be_accepted():
    assert worth_verifying([0.3, 0.01, 0.5], 0.0) == 3
    assert worth_verifying([0.9, 0.0, 1.0], 0.0) == 1  # nothing after a sure rejection
    assert worth_verifying([], 0.3) == 0


def test_cost_cuts_the_unsure_tail_first():
    confidence = [0.99, 0.95, 0.6, 0.3, 0.9, 0.9]
    by_cost = [worth_verifying(confidence, c) for c in (0.0, 0.02, 0.1, 0.3, 1.0, 5.0)]
    assert by_cost == [6, 6, 3, 3, 2, 2]
    assert worth_verifying([0.5, 0.5], 5.0) == 0  # under heavy load, unsure drafts do not pay
    assert worth_verifying([1.0, 1.0], 100.0) == 2  # a sure token always pays for itself


@pytest.mark.parametrize("seed", range(20))
def test_matches_brute_force(seed):
    """20 random cases of 0-8 confidences and costs in [0, 0.6]."""
    rng = np.random.default_rng(seed)
    confidence = rng.uniform(0, 1, size=int(rng.integers(0, 9))).tolist()
    cost = float(rng.uniform(0, 0.6))
    assert worth_verifying(confidence, cost) == brute_force(confidence, cost)


@pytest.mark.parametrize("alpha, sessions", itertools.product((0.3, 0.6, 0.8, 0.95),
                                                              (1, 4, 16, 64)))
def test_constant_confidence_agrees_with_the_servers_suggestion(alpha, sessions):
    """A draft that is always alpha-sure is the server's model of a session with acceptance
    alpha: the cut by draft_token_cost is the suggested draft length."""
    cost = draft_token_cost(sessions, token_cost=0.02, session_cost=0.03)
    assert worth_verifying([alpha] * 8, cost) == suggest_draft_len(
        alpha, sessions, 8, token_cost=0.02, session_cost=0.03)


def test_rejects_a_negative_cost():
    with pytest.raises(ValueError):
        worth_verifying([0.5], -0.1)
