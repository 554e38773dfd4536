"""Lossless verification of a draft: speculative sampling (Leviathan et al. 2023, arXiv 2211.17192).

Notation, used throughout the project:

- p is the target distribution, q the draft distribution, both over a vocabulary of V tokens;
- K is the draft length: the device proposes tokens x_1 .. x_K, x_i sampled from q_i;
- p_1 .. p_{K+1} are the target's distributions at those positions (p_i judges x_i, p_{K+1}
  follows the last draft), already shaped by ``cloud_verifier.sampling.target_probs``.

One round emits n + 1 tokens:

- accepted tokens: x_1 .. x_n, each kept because u_i < p_i(x_i) / q_i(x_i), u_i ~ U[0, 1);
- a correction (also called recovered) token when x_{n+1} is rejected (n < K), sampled from
  the residual norm(max(0, p_{n+1} - q_{n+1}));
- a bonus token when all K drafts are accepted, sampled from p_{K+1}.

Whatever q is, the emitted tokens are distributed exactly as if sampled from p one by one. So q
may be any distribution the device really sampled from, for example a truncated one, or a point
mass (a deterministic draft, ``draft_probs=None``).

Everything here is a pure function of tensors: no protobuf, no model, no I/O. Randomness comes
only from the caller's ``torch.Generator``, one uniform per decision, never one more.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence

import torch

TokenIds = torch.Tensor | Sequence[int]


def verify(draft_tokens: TokenIds, draft_probs: torch.Tensor | None,
           target_probs: torch.Tensor, generator: torch.Generator) -> tuple[int, int]:
    """One round of speculative sampling; returns ``(n, next_token)``.

    draft_tokens: ``[K]`` drafted ids. draft_probs: ``[K, V]`` the q each draft was sampled
    from, or None when every draft is a point mass. target_probs: ``[K+1, V]`` p.

    n in [0, K] is the number of accepted drafts; next_token is the correction token sampled
    from the residual at position n + 1 when n < K, or the bonus token sampled from p_{K+1}
    when n = K. Drafts are tested left to right with one uniform each, stopping at the first
    rejection, then one more uniform samples next_token: exactly min(n + 1, K) + 1 draws from
    ``generator`` (float64 ``torch.rand``), so the same seed replays the same round.

    If the residual has no mass (p == q up to round-off, where rejection has probability 0)
    next_token is sampled from p instead, as in ``residual_distribution``.

    A draft with q(x) = 0 (or not finite) could not have been sampled: ValueError, raised,
    like every other input error, before any random number is drawn.
    """
    tokens = _token_list(draft_tokens)
    k = len(tokens)
    vocab = _check_rows(target_probs, k, "target_probs")
    _check_ids(tokens, vocab)
    if draft_probs is not None and tuple(draft_probs.shape) != (k, vocab):
        raise ValueError(f"draft_probs must have shape [K, V] = [{k}, {vocab}], "
                         f"got {tuple(draft_probs.shape)}")
    if k == 0:
        return 0, _sample(target_probs[0], generator)

    # Flat offsets i * V + x_i pick p_i(x_i) and q_i(x_i) in one gather each.
    flat = torch.tensor([i * vocab + t for i, t in enumerate(tokens)])  # [K]
    p_x = target_probs.take(flat.to(target_probs.device)).tolist()  # [K]
    if draft_probs is None:
        q_x = [1.0] * k
    else:
        q_x = draft_probs.take(flat.to(draft_probs.device)).tolist()  # [K]
        for i, q in enumerate(q_x):
            if not (q > 0 and math.isfinite(q)):
                raise ValueError(f"draft token {tokens[i]} at position {i} has q = {q}; a draft "
                                 "must be sampled from its q, so q(x) must be positive")

    for i in range(k):
        # Strict: p(x) = 0 is never accepted; p(x) >= q(x) always is, as u < 1.
        if _uniform(generator) < p_x[i] / q_x[i]:
            continue
        p = target_probs[i]  # [V]
        if draft_probs is None:
            # max(0, p - onehot(x)) is p with x removed, as p(x) <= 1.
            weights = p.clone()
            weights[tokens[i]] = 0
        else:
            weights = _residual_weights(p, draft_probs[i].to(p.device))
        # Sampling by inverse CDF needs no normalisation; an empty residual falls back to p,
        # as in residual_distribution.
        return i, _sample(weights, generator, fallback=p)
    return k, _sample(target_probs[k], generator)


def verify_greedy(draft_tokens: TokenIds, target_logits: torch.Tensor) -> tuple[int, int]:
    """Greedy verification; returns ``(n, next_token)`` and draws no random numbers.

    target_logits: ``[K+1, V]`` logits or probabilities; only the argmax of each row matters,
    with ties going to the lowest token id (``torch.argmax``). Drafts are accepted while they
    equal the argmax; next_token is the argmax at the first mismatch, or of row K+1 (bonus).
    """
    tokens = _token_list(draft_tokens)
    k = len(tokens)
    vocab = _check_rows(target_logits, k, "target_logits")
    _check_ids(tokens, vocab)
    best = target_logits.argmax(dim=1).tolist()  # [K+1]
    for i, token in enumerate(tokens):
        if token != best[i]:
            return i, best[i]
    return k, best[k]


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)) along the last dim, for ``[V]`` or ``[N, V]`` p and q.

    Safe fallback: where max(0, p - q) has no mass (p == q, up to float round-off) the row is
    p itself. Rejection has probability 1 - sum(min(p, q)) = 0 when p == q exactly, so the
    choice cannot change the output distribution; under round-off it moves it by O(eps).
    Never NaN for finite, non-negative inputs.
    """
    if p.shape != q.shape or p.dim() not in (1, 2):
        raise ValueError(f"p and q must both be [V] or [N, V], got {tuple(p.shape)} and "
                         f"{tuple(q.shape)}")
    r = _residual_weights(p, q)
    total = r.sum(dim=-1, keepdim=True)
    has_mass = total > 0
    return torch.where(has_mass, r / torch.where(has_mass, total, 1), p)


def sparse_to_dense(token_ids: Sequence[Sequence[int]], probs: Sequence[Sequence[float]],
                    vocab_size: int) -> torch.Tensor:
    """Per-position sparse q (ids, probs) -> dense float32 ``[K, V]``; other ids get 0.

    Expects input already validated at the trust boundary; still refuses a length mismatch,
    an id outside [0, V) and a duplicate id (ValueError), which would otherwise corrupt q.
    """
    if len(token_ids) != len(probs):
        raise ValueError(f"{len(token_ids)} id lists but {len(probs)} prob lists")
    rows: list[int] = []
    cols: list[int] = []
    values: list[float] = []
    for i, (ids, ps) in enumerate(zip(token_ids, probs, strict=True)):
        if len(ids) != len(ps):
            raise ValueError(f"position {i}: {len(ids)} ids but {len(ps)} probs")
        if len(set(ids)) != len(ids):
            raise ValueError(f"position {i}: a token id is listed more than once")
        for t in ids:
            if not 0 <= t < vocab_size:
                raise ValueError(f"position {i}: token id {t} is out of range [0, {vocab_size})")
        rows.extend([i] * len(ids))
        cols.extend(ids)
        values.extend(ps)
    dense = torch.zeros(len(token_ids), vocab_size, dtype=torch.float32)
    if values:
        dense[rows, cols] = torch.tensor(values, dtype=torch.float32)
    return dense


def _token_list(draft_tokens: TokenIds) -> list[int]:
    if isinstance(draft_tokens, torch.Tensor):
        if draft_tokens.dim() != 1 or draft_tokens.is_floating_point():
            raise ValueError(f"draft_tokens must be a 1-D integer tensor, got "
                             f"{draft_tokens.dtype} of shape {tuple(draft_tokens.shape)}")
        return draft_tokens.tolist()
    try:
        return [operator.index(t) for t in draft_tokens]
    except TypeError as e:
        raise ValueError(f"draft_tokens must be integers: {e}") from None


def _check_rows(rows: torch.Tensor, k: int, name: str) -> int:
    if rows.dim() != 2 or rows.shape[0] != k + 1 or rows.shape[1] == 0:
        raise ValueError(f"{name} must have shape [K+1, V] = [{k + 1}, V] for K = {k} drafts, "
                         f"got {tuple(rows.shape)}")
    return rows.shape[1]


def _check_ids(tokens: list[int], vocab: int) -> None:
    for i, t in enumerate(tokens):
        if not 0 <= t < vocab:
            raise ValueError(f"draft token {t} at position {i} is out of range [0, {vocab})")


def _residual_weights(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    return (p - q).clamp_min_(0)


def _uniform(generator: torch.Generator) -> float:
    return torch.rand((), dtype=torch.float64, generator=generator,
                      device=generator.device).item()


def _sample(weights: torch.Tensor, generator: torch.Generator,
            fallback: torch.Tensor | None = None) -> int:
    """One draw from ``[V]`` non-negative weights by inverse CDF, with one uniform.

    ``fallback`` is used instead when the weights have no mass.
    """
    cdf = weights.cumsum(0, dtype=torch.float64)  # [V]
    total = cdf[-1].item()
    if total == 0 and fallback is not None:
        cdf = fallback.cumsum(0, dtype=torch.float64)
        total = cdf[-1].item()
    if not (total > 0 and math.isfinite(total)):
        raise ValueError(f"cannot sample from a row with total mass {total}")
    x = total * _uniform(generator)
    if x >= total:
        # u * total rounded up to total: take the last id that holds mass, never one past it.
        return int(torch.searchsorted(cdf, total).item())
    # right=True: ids with zero mass own an empty interval and are never picked.
    return int(torch.searchsorted(cdf, x, right=True).item())
