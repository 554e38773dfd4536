"""The draft's sampling distribution q on the device (numpy only: the device has no torch).

``truncated_distribution`` shapes one row of draft logits exactly as
``cloud_verifier.sampling.target_probs`` shapes the target's (temperature, then top-k, then
top-p, the same lowest-id-wins tie rule), then keeps at most ``max_support`` of the most
probable tokens. The result is sparse: ids and probabilities, most probable first, which is
what goes on the wire as the q of that draft position.

Truncating q costs no correctness. Speculative sampling is lossless for any q, provided the
verifier judges each draft token by the q it was actually sampled from (acceptance
u < p(x) / q(x), residual max(0, p - q)). ``sample`` draws from exactly the (ids, probs) that are
sent, so the verifier sees the true q and the output still follows the target. A truncated q
can only lower the acceptance rate (mass the target puts outside it must come back through the
residual), while it keeps the payload to at most ``max_support`` (id, prob) pairs per token
instead of a whole vocabulary.
"""

from __future__ import annotations

import math

import numpy as np

_F32_MAX = float(np.finfo(np.float32).max)


def truncated_distribution(logits: np.ndarray, temperature: float, top_k: int, top_p: float,
                           max_support: int) -> tuple[np.ndarray, np.ndarray]:
    """Logits ``[V]`` -> ``(ids int64[n], probs float32[n])``, most probable first.

    temperature = 0 is greedy: the argmax (lowest id on ties) with probability 1. top_k = 0,
    top_p = 1 and max_support = 0 each switch their cut off. The probabilities are all > 0 and
    renormalised to sum to 1 in float32.
    """
    _check_params(temperature, top_k, top_p, max_support)
    x = np.asarray(logits)
    if x.ndim != 1 or x.size == 0:
        raise ValueError(f"logits must have shape [V] with V > 0, got {x.shape}")
    # float32 first, as the torch side does, then float64 for the arithmetic.
    with np.errstate(over="ignore"):  # a float64 logit beyond float32 becomes +inf here
        x = np.minimum(x.astype(np.float32), np.float32(_F32_MAX)).astype(np.float64)  # [V]
    top = x.max()
    if not math.isfinite(top):
        raise ValueError("logits need a finite maximum: they are all -inf or contain NaN")
    if temperature == 0:
        return np.array([int(np.argmax(x))], dtype=np.int64), np.ones(1, dtype=np.float32)

    z = (x - top) / temperature  # [V], all <= 0
    vocab = z.size
    k = top_k if 0 < top_k < vocab else vocab
    cap = min(k, max_support) if 0 < max_support < vocab else k
    order = _descending(z, cap)  # [cap] the cap best ids, ties to the lowest id
    weights = np.exp(z[order])  # [cap]
    if top_p < 1:
        # top-p looks at probabilities after top-k: normalise over all k kept tokens, not the cap.
        norm = weights.sum() if k == cap else np.exp(_largest(z, k)).sum()
        # Mass strictly ahead of each token; the first sees 0 < top_p and is always kept.
        before = np.concatenate(([0.0], np.cumsum(weights[:-1] / norm)))  # [cap]
        order = order[: int(np.searchsorted(before, top_p, side="left"))]
        weights = weights[: order.size]

    probs = (weights / weights.sum()).astype(np.float32)
    keep = probs > 0  # float32 underflow would leave ids that can never be sampled
    ids, probs = order[keep].astype(np.int64), probs[keep]
    return ids, probs / probs.sum(dtype=np.float32)


def sample(ids: np.ndarray, probs: np.ndarray, rng: np.random.Generator) -> int:
    """One token from the sparse distribution (ids, probs), using exactly one ``rng.random()``.

    Inverse CDF over the float32 probs accumulated in float64. The uniform is scaled by the
    total, so a sum slightly off 1 is renormalised rather than biasing the last id.
    """
    ids = np.asarray(ids)
    probs = np.asarray(probs)
    if ids.ndim != 1 or ids.shape != probs.shape or ids.size == 0:
        raise ValueError(f"ids and probs must be non-empty and of one length, got {ids.shape} "
                         f"and {probs.shape}")
    cdf = np.cumsum(probs, dtype=np.float64)  # [n]
    total = float(cdf[-1])
    if not (total > 0 and math.isfinite(total)) or bool((probs < 0).any()):
        raise ValueError("probs must be finite, non-negative and not all zero")
    x = rng.random() * total
    if x >= total:
        # Round-off pushed u * total up to total: the last id with mass, never one past it.
        index = int(np.searchsorted(cdf, total, side="left"))
    else:
        # side="right": an id with zero probability owns an empty interval.
        index = int(np.searchsorted(cdf, x, side="right"))
    return int(ids[index])


def _check_params(temperature: float, top_k: int, top_p: float, max_support: int) -> None:
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 = off), got {top_k!r}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1] (1 = off), got {top_p!r}")
    if max_support < 0:
        raise ValueError(f"max_support must be >= 0 (0 = no cap), got {max_support!r}")


def _largest(z: np.ndarray, n: int) -> np.ndarray:
    """The n largest values of z, unordered (ties do not matter for a sum)."""
    if n >= z.size:
        return z
    return np.partition(z, z.size - n)[z.size - n:]


def _descending(z: np.ndarray, n: int) -> np.ndarray:
    """Ids of the n largest values of z, in descending order, equal values by ascending id."""
    if n >= z.size:
        return np.argsort(-z, kind="stable")
    # Everything tied with the n-th value is a candidate; the stable sort then keeps low ids.
    candidates = np.flatnonzero(z >= _largest(z, n).min())
    return candidates[np.argsort(-z[candidates], kind="stable")][:n]
