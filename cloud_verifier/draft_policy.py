"""How many drafts a client should send next: the server's suggestion in every reply.

Model (per forward, in units of the forward's fixed cost): verifying B sessions with K drafts
each costs ``1 + s * B + t * B * (K + 1)``: a fixed part (reading the weights), a part per
session (its attention and KV writes, one call per layer each) and a part per token. A
session whose drafts are accepted with probability alpha gets
``E(K) = (1 - alpha^(K+1)) / (1 - alpha)`` tokens per round (Leviathan et al. eq. 1). The
suggestion maximises each session's tokens per unit of forward cost, ``E(K) / cost``, so under
saturation it shrinks K (to 0: plain decoding) exactly when a round's extra tokens cost more
than they commit.

The server fits s and t online to its own forwards (``VerifyCostModel``); the constants
below are its prior and what it uses with ``--fixed-verify-cost``. They are a least-squares
fit of the packed verify forward on the project's CPU (``python -m
cloud_verifier.bench.verify_cost`` prints the fit for any machine;
``edgespec-verifier --verify-session-cost/--verify-token-cost`` take it). Tokens are cheap
next to sessions because a small-batch forward is bound by streaming the weights, not by
FLOPs. An affine model ``1 + c * tokens`` (fitted to decode batches, where tokens and sessions
grow together) would charge every draft as much as a new session and turn speculation off at
the batch sizes where it pays most. A linear model cannot follow the per-shape jumps (small
forwards take other kernel paths; with many rows a forward turns compute-bound), which is why
the server refits it to the shapes it is actually running.
"""

from __future__ import annotations

from collections import deque

import numpy as np

DEFAULT_SESSION_COST = 0.032
DEFAULT_TOKEN_COST = 0.020
# With K = 0, alpha is never measured again; probe with K = 1 every this many rounds. Each
# probe ends the client's Decode (one round trip), so it is kept rare.
PROBE_EVERY = 32


def expected_tokens(alpha: float, k: int) -> float:
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def suggest_draft_len(alpha: float, batch_sessions: int, max_k: int,
                      token_cost: float = DEFAULT_TOKEN_COST,
                      session_cost: float = DEFAULT_SESSION_COST) -> int:
    """The K in [0, max_k] with the most tokens per unit of verification cost."""
    best_k, best = 0, 0.0
    fixed = 1.0 + session_cost * batch_sessions
    for k in range(max_k + 1):
        value = expected_tokens(alpha, k) / (fixed + token_cost * batch_sessions * (k + 1))
        if value > best + 1e-12:
            best_k, best = k, value
    return best_k


def draft_token_cost(batch_sessions: int, token_cost: float = DEFAULT_TOKEN_COST,
                     session_cost: float = DEFAULT_SESSION_COST) -> float:
    """What one more verified token costs a session in a forward of ``batch_sessions``,
    relative to that session's share of the forward without drafts: ``t * B / (1 + s * B)``.
    ``suggest_draft_len`` maximises ``E(K) / (1 + this * (K + 1))``; clients that send
    confidences maximise the same with their own E (``shared.draft_length``)."""
    return token_cost * batch_sessions / (1.0 + session_cost * batch_sessions)


class VerifyCostModel:
    """The verify cost ``ms = a + s * sessions + t * tokens``, fitted online to the forwards
    the batcher actually runs, so the suggestion follows the machine and the model it serves
    instead of constants measured once elsewhere.

    The configured relative costs are a prior, entered as pseudo-forwards at a spread of batch
    shapes (scaled to the observed forward times) and weighted as ``prior_weight`` real ones:
    with few or collinear observations (plain decoding has tokens == sessions, so s and t
    cannot be told apart from it alone) the prior decides the direction the data cannot.
    ``relative_costs()`` returns (s / a, t / a), what ``suggest_draft_len`` takes.
    """

    # (sessions, tokens) of the prior's pseudo-forwards: decode and K = 4 batches, 1..32 sessions.
    _PRIOR_SHAPES = ((1, 1), (1, 5), (4, 4), (4, 20), (16, 16), (16, 80), (32, 32), (32, 160))

    def __init__(self, session_cost: float = DEFAULT_SESSION_COST,
                 token_cost: float = DEFAULT_TOKEN_COST, fit: bool = True,
                 window: int = 512, prior_weight: float = 32.0, refit_every: int = 16) -> None:
        if session_cost < 0 or token_cost < 0:
            raise ValueError("verify costs must be >= 0")
        self.prior = (session_cost, token_cost)
        self.fit = fit
        self.prior_weight = prior_weight
        self.refit_every = refit_every
        self._seen: deque[tuple[int, int, float]] = deque(maxlen=window)
        self._since_fit = 0
        self._relative = self.prior
        self._fixed_ms: float | None = None

    def observe(self, sessions: int, tokens: int, seconds: float) -> bool:
        """Records one forward; True when this refitted the model."""
        if not self.fit or sessions < 1 or tokens < 1 or not seconds > 0:
            return False
        self._seen.append((sessions, tokens, seconds * 1000.0))
        self._since_fit += 1
        if self._since_fit < self.refit_every:
            return False
        self._since_fit = 0
        self._refit()
        return True

    def relative_costs(self) -> tuple[float, float]:
        """(session cost, token cost), each relative to a forward's fixed cost."""
        return self._relative

    @property
    def fixed_ms(self) -> float | None:
        """The fitted fixed cost of a forward in ms (None before the first fit)."""
        return self._fixed_ms

    def _refit(self) -> None:
        seen = np.array(self._seen, dtype=np.float64)
        a, s, t = fit_verify_cost(seen[:, 0], seen[:, 1], seen[:, 2], self.prior,
                                  self.prior_weight, self._PRIOR_SHAPES)
        if a <= 0:  # nothing sensible to normalise by; keep the last answer
            return
        self._fixed_ms = a
        self._relative = (max(s / a, 0.0), max(t / a, 0.0))


def fit_verify_cost(sessions, tokens, ms, prior: tuple[float, float] | None = None,
                    prior_weight: float = 0.0, prior_shapes=()) -> tuple[float, float, float]:
    """(a, s, t) in ms of ``ms = a + s * sessions + t * tokens``, weighted least squares over
    the given forwards plus, with ``prior = (s0, t0)`` (relative to the fixed cost), the
    pseudo-forwards ``prior_shapes`` (sessions, tokens) costed by the prior, scaled to the
    forwards seen and weighted as ``prior_weight`` forwards in all."""
    b, n, y = (np.asarray(v, dtype=np.float64) for v in (sessions, tokens, ms))
    rows, w = np.column_stack([np.ones(len(b)), b, n]), np.ones(len(b))
    if prior is not None and prior_weight > 0 and len(prior_shapes):
        s0, t0 = prior
        f = 1.0 + s0 * b + t0 * n  # the prior's cost of each forward, in units of a
        a0 = float(f @ y / (f @ f))  # the fixed cost that best explains y, given s0 and t0
        pb, pn = np.array(prior_shapes, dtype=np.float64).T
        rows = np.concatenate([rows, np.column_stack([np.ones(len(pb)), pb, pn])])
        y = np.concatenate([y, a0 * (1.0 + s0 * pb + t0 * pn)])
        w = np.concatenate([w, np.full(len(pb), prior_weight / len(pb))])
    sw = np.sqrt(w)
    a, s, t = np.linalg.lstsq(rows * sw[:, None], y * sw, rcond=None)[0]
    return float(a), float(s), float(t)


class AcceptanceTracker:
    """Exponential moving average of one session's per-draft acceptance."""

    def __init__(self, prior: float = 0.5, weight: float = 0.3) -> None:
        self.alpha = prior
        self.weight = weight

    def update(self, drafted: int, accepted: int) -> None:
        if drafted:
            self.alpha += self.weight * (accepted / drafted - self.alpha)
