"""How many drafts a client should send next: the server's suggestion in every reply.

Model (per forward, in units of a batch-1 one-token step): verifying B sessions with K drafts
each costs ``1 + c * B * (K + 1)``; a session whose drafts are accepted with probability alpha
gets ``E(K) = (1 - alpha^(K+1)) / (1 - alpha)`` tokens per round (Leviathan et al. eq. 1).
The suggestion maximises each session's tokens per unit of forward cost, ``E(K) / cost``.
c = 0.15 is fitted to this verifier's decode batches on the project's 2-core CPU (the
baseline's step at 1, 8 and 16 sessions gives c = 0.12-0.17); the project notes' "5 new tokens
cost 1.3x a 1-token step at batch 1, 3x at batch 16" gave 0.081, which let speculation run on
at loads where it cost the other sessions more than it saved (fleet sweep, 4g, spec/baseline
tokens/s at 1/2/4/8/16 clients: 1.05/0.89/0.88/0.84/0.79 with 0.081; 1.03/1.04/0.91/1.14/1.20
with 0.15). Under saturation this shrinks K towards 0, so the server never spends more compute
per token than plain decoding would need.
"""

from __future__ import annotations

DEFAULT_TOKEN_COST = 0.15
# With K = 0, alpha is never measured again; probe with K = 1 every this many rounds. Each
# probe ends the client's Continue stream (one round trip), so it is kept rare.
PROBE_EVERY = 32


def expected_tokens(alpha: float, k: int) -> float:
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def suggest_draft_len(alpha: float, batch_sessions: int, max_k: int,
                      token_cost: float = DEFAULT_TOKEN_COST) -> int:
    """The K in [0, max_k] with the most tokens per unit of verification cost."""
    best_k, best = 0, 0.0
    for k in range(max_k + 1):
        value = expected_tokens(alpha, k) / (1.0 + token_cost * batch_sessions * (k + 1))
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
