"""How many drafts are worth verifying, from the draft's own confidences.

A draft model's probability of its greedy token is a well-calibrated estimate of that
token's acceptance (the fleet's chat workload shows it: acceptance rises with the draft's
confidence, bin by bin). With c_i the confidence
of d_i given d_1..d_{i-1}, d_i is committed with probability g_i = c_1 * ... * c_i, so
verifying k drafts commits ``1 + g_1 + ... + g_k`` tokens on average. The verifier publishes
``token_cost``: what one more verified token costs a session at its current load, relative to
what the forward costs the session anyway (``cloud_verifier.draft_policy``). The k worth
sending maximises expected tokens per unit of cost, ``(1 + g_1 + ... + g_k) / (1 +
token_cost * (k + 1))``: long runs of confident drafts when the machine is idle, short ones
(or none) under load.

Lossless only if c_i is a function of q_i, the distribution d_i is drawn from, and not of
the drawn d_i: whether d_i is verified must not depend on d_i itself, or the committed token
is biased towards (or away from) the tokens the draft is sure of. For a greedy draft the two
coincide (c_i is q_i's top probability); a sampling draft would send q_i's top probability,
not q_i(d_i) (tests/test_lookahead.py fails with the latter).

Pure Python: the edge client and the verifier both use it.
"""

from __future__ import annotations

from collections.abc import Sequence


def worth_verifying(confidence: Sequence[float], token_cost: float) -> int:
    """The k in [0, len(confidence)] with the most expected tokens per unit of cost (the
    shortest such k on a tie)."""
    if token_cost < 0:
        raise ValueError(f"token_cost must be >= 0, got {token_cost}")
    best_k, best = 0, 1.0 / (1.0 + token_cost)
    expected, reach = 1.0, 1.0
    for k, c in enumerate(confidence, start=1):
        reach *= min(max(float(c), 0.0), 1.0)
        expected += reach
        value = expected / (1.0 + token_cost * (k + 1))
        if value > best * (1 + 1e-9):
            best_k, best = k, value
    return best_k
