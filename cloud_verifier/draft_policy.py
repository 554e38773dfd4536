"""How many drafts a client should send next: the server's suggestion in every reply.

Model (per forward, in units of the forward's fixed cost): verifying B sessions with K drafts
each costs ``1 + s * B + t * B * (K + 1)``: a fixed part (reading the weights), a part per
session (its attention and KV writes, one call per layer each) and a part per token. A
session whose drafts are accepted with probability alpha gets
``E(K) = (1 - alpha^(K+1)) / (1 - alpha)`` tokens per round (Leviathan et al. eq. 1). The
suggestion maximises each session's tokens per unit of forward cost, ``E(K) / cost``, so under
saturation it shrinks K (to 0: plain decoding) exactly when a round's extra tokens cost more
than they commit.

s = 0.038 and t = 0.018 are a least-squares fit of the packed verify forward on the project's
2-core CPU (``python -m cloud_verifier.bench_verify_cost``, which prints the fit for any
machine; ``edgespec-verifier --verify-session-cost/--verify-token-cost`` take it): about
130 ms fixed, 4.9 ms per session and 2.3 ms per token, for 2..80 tokens. Tokens are cheap next
to sessions because a small-batch forward is bound by streaming the weights, not by FLOPs
(16 sessions x 5 tokens cost 1.36x 16 sessions x 1 token in that run). A second run that
added 32 sessions (up to 160 tokens, where the forward turns compute-bound) fitted
s = 0.035, t = 0.029: these are noisy single-run figures, to be refitted per machine. The
earlier affine model ``1 + c * tokens`` (c = 0.081 from the project notes, then 0.15 fitted
to decode batches, where tokens and sessions grow together) charged every draft as much as a
new session and turned speculation off from 8 sessions on, where it pays most.
"""

from __future__ import annotations

DEFAULT_SESSION_COST = 0.038
DEFAULT_TOKEN_COST = 0.018
# With K = 0, alpha is never measured again; probe with K = 1 every this many rounds. Each
# probe ends the client's Continue stream (one round trip), so it is kept rare.
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


class AcceptanceTracker:
    """Exponential moving average of one session's per-draft acceptance."""

    def __init__(self, prior: float = 0.5, weight: float = 0.3) -> None:
        self.alpha = prior
        self.weight = weight

    def update(self, drafted: int, accepted: int) -> None:
        if drafted:
            self.alpha += self.weight * (accepted / drafted - self.alpha)
