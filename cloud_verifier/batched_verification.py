"""Accept/reject for a whole batch of rounds at once, on the device that holds the logits.

The same decisions as ``cloud_verifier.verification`` (the per-session reference, whose
docstring defines p, q, K and the accepted, correction and bonus tokens), computed for B
sessions with tensor ops over their packed logits, so a forward costs one host sync however
many sessions it served: the caller reads ``num_accepted``, ``next_token`` and ``valid``
together (``BatchDecisions.tolist``). Sessions may mix greedy and sampling, any K, dense-free
sparse q or point masses.

Randomness: session b's round uses ``uniforms[b]``, the first K_b + 1 numbers of the stream
its generator gives after being seeded from (session seed, committed length), drawn on the
host (``round_uniforms``). Drafts are tested left to right with u_0 .. u_{n}; the correction or
bonus token is sampled with u_{min(n + 1, K)}. That is exactly the sequence of draws the
reference makes one at a time, so every decision, sampled token included, equals the
reference's bit for bit on the CPU (tests/test_batched_verification.py). The reference never
draws a number it does not use; here up to K_b + 1 are drawn and the tail is left unused, which
no one can observe, because the next round reseeds the generator.

Pure: no protobuf, no model, no I/O; inputs are validated before any tensor work.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from cloud_verifier.device_copy import to_device
from cloud_verifier.sampling import SamplingParams, target_probs_rows

# Per position: (token ids, probs) of the q the draft was sampled from.
SparseQ = Sequence[tuple[Sequence[int], Sequence[float]]]


def round_uniforms(generator: torch.Generator, k: int) -> torch.Tensor:
    """``[K+1]`` float64: the next K + 1 uniforms of ``generator``, the same numbers K + 1
    single draws give (what the reference ``verify`` draws at most)."""
    return torch.rand(k + 1, dtype=torch.float64, generator=generator,
                      device=generator.device)


@dataclass(frozen=True)
class BatchDecisions:
    num_accepted: torch.Tensor  # [B] int64, n in [0, K_b]
    next_token: torch.Tensor  # [B] int64, correction (n < K_b) or bonus (n = K_b)
    valid: torch.Tensor  # [B] bool; False: a sampling session's logits had a NaN/no maximum

    def tolist(self) -> list[tuple[int, int, bool]]:
        """The decisions on the host: the one device-to-host copy of a batch."""
        rows = torch.stack([self.num_accepted, self.next_token, self.valid.long()]).tolist()
        return [(n, t, bool(ok)) for n, t, ok in zip(*rows, strict=True)]


def verify_batch(logits: torch.Tensor, draft_tokens: Sequence[Sequence[int]],
                 draft_q: Sequence[SparseQ | None], params: Sequence[SamplingParams],
                 uniforms: torch.Tensor) -> BatchDecisions:
    """Decides B rounds from their target logits.

    logits: ``[R, V]`` packed rows, session b's K_b + 1 rows (p_1 .. p_{K_b+1} before shaping)
    following session b - 1's. draft_tokens: B lists of K_b ids. draft_q: per session its
    sparse q per position, or None when every draft is a point mass. params: per session.
    uniforms: ``[B, Kmax+1]`` float64 (any device), row b from ``round_uniforms`` (columns
    past K_b and rows of greedy sessions are ignored).

    Greedy sessions compare drafts with the argmax of the raw logits (``verify_greedy``);
    sampling sessions shape their rows with ``target_probs_rows`` and run speculative
    sampling (``verify``). Invalid inputs (shapes, ids, a draft with q(x) = 0) raise
    ValueError before any tensor work.
    """
    b = len(draft_tokens)
    if not (len(draft_q) == len(params) == b):
        raise ValueError(f"{b} drafts, {len(draft_q)} q and {len(params)} params: one each per "
                         "session")
    ks = [len(t) for t in draft_tokens]
    k_max = max(ks, default=0)
    if logits.dim() != 2 or logits.shape[0] != sum(ks) + b or logits.shape[1] == 0:
        raise ValueError(f"logits must be [sum(K+1), V] = [{sum(ks) + b}, V], got "
                         f"{tuple(logits.shape)}")
    if tuple(uniforms.shape) != (b, k_max + 1) or uniforms.dtype != torch.float64:
        raise ValueError(f"uniforms must be float64 [B, Kmax+1] = [{b}, {k_max + 1}], got "
                         f"{uniforms.dtype} {tuple(uniforms.shape)}")
    vocab, device = logits.shape[1], logits.device
    plan = _Plan.build(draft_tokens, draft_q, params, vocab)
    idx = plan.to(device)
    uniforms = to_device(uniforms, device)
    greedy = idx["greedy"]  # [B]

    # acc[b, j]: draft j of session b is accepted (False past K_b).
    acc = torch.zeros(b, k_max, dtype=torch.bool, device=device)
    best = None
    if plan.any_greedy:
        best = logits.argmax(dim=1)  # [R]
        acc |= greedy[:, None] & (best[idx["draft_row"]] == idx["draft_tok"])
    probs = None
    row_valid = torch.ones(logits.shape[0], dtype=torch.bool, device=device)
    if plan.any_sampling:
        probs, row_valid = target_probs_rows(logits, plan.row_params)  # [R, V], [R]
        p_x = probs[idx["draft_row"], idx["draft_tok"]]  # [B, Kmax] float32
        # float64, like the reference's Python floats: u < p(x) / q(x), strict.
        ratio = p_x.double() / idx["q_x"].double()
        acc |= ~greedy[:, None] & (uniforms[:, :k_max] < ratio)
    acc &= idx["in_draft"]
    n = acc.long().cumprod(dim=1).sum(dim=1)  # [B] leading accepted drafts
    row = idx["offset"] + n  # [B] p's row at position n + 1: correction or bonus

    next_token = torch.zeros(b, dtype=torch.long, device=device)
    if best is not None:
        next_token = torch.where(greedy, best[row], next_token)
    valid = torch.ones(b, dtype=torch.bool, device=device)
    if probs is not None:
        sampled, ok = _sample_next(probs, row, n, idx, uniforms, b)
        next_token = torch.where(greedy, next_token, sampled)
        rows_ok = row_valid[idx["all_rows"]].all(dim=1)  # [B] every row of the session
        valid = greedy | (ok & rows_ok)
    return BatchDecisions(n, next_token, valid)


def _sample_next(probs: torch.Tensor, row: torch.Tensor, n: torch.Tensor,
                 idx: dict[str, torch.Tensor], uniforms: torch.Tensor, b: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The correction (from the residual at row n + 1, n < K) or bonus (from p_{K+1}) token
    of every session by inverse CDF, as the reference's ``_sample``; and whether the row
    had mass."""
    device, vocab = probs.device, probs.shape[1]
    k = idx["k"]
    p_n = probs[row]  # [B, V]
    rejected = n < k  # [B]
    # q at position n + 1 as a dense row: sparse entries of that position, others add 0.
    q_n = torch.zeros(b, vocab, dtype=torch.float32, device=device)
    if idx["q_session"].numel():
        here = idx["q_position"] == n[idx["q_session"]]
        q_n.index_put_((idx["q_session"], idx["q_id"]),
                       torch.where(here, idx["q_prob"], 0.0), accumulate=True)
    weights = torch.where(rejected[:, None], (p_n - q_n).clamp_min_(0), p_n)
    # A point-mass q: max(0, p - onehot(x)) is p with x removed (the reference sets it to 0).
    drafted = idx["draft_tok_ext"].gather(1, n[:, None])  # [B, 1] x at position n + 1
    point = rejected & idx["point_mass"]
    weights.scatter_(1, drafted, torch.where(point[:, None], 0.0, weights.gather(1, drafted)))
    # An empty residual (p == q up to round-off) falls back to p, as in the reference.
    empty = rejected & ~(weights > 0).any(dim=1)
    weights = torch.where(empty[:, None], p_n, weights)
    cdf = weights.cumsum(dim=1, dtype=torch.float64)  # [B, V]
    total = cdf[:, -1:].contiguous()  # [B, 1]
    u = uniforms.gather(1, torch.minimum(n + 1, k)[:, None])  # [B, 1]
    x = (total * u).contiguous()
    # right=True: ids with zero mass own an empty interval and are never picked; u * total
    # rounded up to total takes the last id that holds mass, never one past it.
    token = torch.where(x >= total, torch.searchsorted(cdf, total),
                        torch.searchsorted(cdf, x, right=True))[:, 0]
    ok = (total[:, 0] > 0) & torch.isfinite(total[:, 0])
    return token.clamp_(max=vocab - 1), ok


@dataclass(frozen=True)
class _Plan:
    """Host-side index tensors of a batch (built from Python lists, copied once)."""

    tensors: dict[str, torch.Tensor]
    row_params: list[SamplingParams]
    any_greedy: bool
    any_sampling: bool

    def to(self, device: torch.device) -> dict[str, torch.Tensor]:
        return {name: to_device(t, device) for name, t in self.tensors.items()}

    @staticmethod
    def build(draft_tokens: Sequence[Sequence[int]], draft_q: Sequence[SparseQ | None],
              params: Sequence[SamplingParams], vocab: int) -> _Plan:
        ks = [len(t) for t in draft_tokens]
        k_max = max(ks, default=0)
        offsets, row_params = [], []
        draft_row, draft_tok, q_x, in_draft, all_rows = [], [], [], [], []
        q_session, q_position, q_id, q_prob = [], [], [], []
        start = 0
        for s, (tokens, q, sp) in enumerate(zip(draft_tokens, draft_q, params, strict=True)):
            k = len(tokens)
            offsets.append(start)
            row_params.extend([sp] * (k + 1))
            tokens = [_token(t, vocab, s, j) for j, t in enumerate(tokens)]
            if q is not None and len(q) != k:
                raise ValueError(f"session {s}: {len(q)} q positions for {k} drafts")
            qx = [1.0] * k
            for j, (ids, ps) in enumerate(() if sp.is_greedy else q or ()):
                if len(ids) != len(ps):
                    raise ValueError(f"session {s} position {j}: {len(ids)} ids, {len(ps)} probs")
                support = dict(zip(ids, ps, strict=True))
                if len(support) != len(ids):
                    raise ValueError(f"session {s} position {j}: a token id is listed twice")
                for t in ids:
                    if not 0 <= t < vocab:
                        raise ValueError(f"session {s} position {j}: token id {t} is out of "
                                         f"range [0, {vocab})")
                qx[j] = support.get(tokens[j], 0.0)
                q_session.extend([s] * len(ids))
                q_position.extend([j] * len(ids))
                q_id.extend(ids)
                q_prob.extend(ps)
            pad = k_max - k
            draft_row.append([start + j for j in range(k)] + [start] * pad)
            draft_tok.append(tokens + [0] * (pad + 1))
            q_x.append(qx + [1.0] * pad)
            in_draft.append([True] * k + [False] * pad)
            all_rows.append([start + min(j, k) for j in range(k_max + 1)])
            start += k + 1
        b = len(ks)
        long = torch.long
        # float32, as the reference's dense q holds it; checked after that rounding.
        q_x_t = torch.tensor(q_x, dtype=torch.float32).reshape(b, k_max)
        bad = ~((q_x_t > 0) & torch.isfinite(q_x_t))
        if bool(bad.any()):
            s, j = bad.nonzero()[0].tolist()
            raise ValueError(f"session {s}: draft token {draft_tok[s][j]} at position {j} has "
                             f"q = {q_x_t[s, j].item()}; a draft must be sampled from its q, so "
                             "q(x) must be positive")
        tensors = {
            "k": torch.tensor(ks, dtype=long),
            "offset": torch.tensor(offsets, dtype=long),
            "greedy": torch.tensor([sp.is_greedy for sp in params], dtype=torch.bool),
            "point_mass": torch.tensor([q is None for q in draft_q], dtype=torch.bool),
            "draft_row": torch.tensor(draft_row, dtype=long).reshape(b, k_max),
            "draft_tok": torch.tensor([t[:k_max] for t in draft_tok], dtype=long
                                      ).reshape(b, k_max),
            "draft_tok_ext": torch.tensor(draft_tok, dtype=long).reshape(b, k_max + 1),
            "q_x": q_x_t,
            "in_draft": torch.tensor(in_draft, dtype=torch.bool).reshape(b, k_max),
            "all_rows": torch.tensor(all_rows, dtype=long).reshape(b, k_max + 1),
            "q_session": torch.tensor(q_session, dtype=long),
            "q_position": torch.tensor(q_position, dtype=long),
            "q_id": torch.tensor(q_id, dtype=long),
            "q_prob": torch.tensor(q_prob, dtype=torch.float32),
        }
        greedy = [sp.is_greedy for sp in params]
        return _Plan(tensors, row_params, any(greedy), not all(greedy))


def _token(t: object, vocab: int, session: int, position: int) -> int:
    try:
        t = operator.index(t)
    except TypeError:
        raise ValueError(f"session {session}: draft tokens must be integers") from None
    if not 0 <= t < vocab:
        raise ValueError(f"session {session}: draft token {t} at position {position} is out of "
                         f"range [0, {vocab})")
    return t
