"""Which part of a lookahead session's latest draft the next forward verifies.

A lookahead d_1..d_m was drafted after the first ``base`` committed tokens. By the time a
forward runs, the server may have committed more tokens since (it does not wait for drafts).
The lookahead still serves when its first tokens are exactly those committed tokens: each
remaining d_i was then sampled from q given the true committed prefix and the drafts before
it, independently of the target's randomness, which is all lossless speculative sampling
needs. Otherwise it is stale, and the forward decodes one token without drafts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from cloud_verifier.target_engine import NO_DRAFT, DraftRound


@dataclass(frozen=True)
class Lookahead:
    base: int  # committed length the draft continues
    draft: DraftRound


def fresh_drafts(lookahead: Lookahead | None, committed: Sequence[int], k: int) -> DraftRound:
    """At most ``k`` drafts of ``lookahead`` that continue ``committed``, or none."""
    if lookahead is None or k <= 0:
        return NO_DRAFT
    done = len(committed) - lookahead.base
    tokens = lookahead.draft.tokens
    if not 0 <= done < len(tokens) or list(committed[lookahead.base:]) != tokens[:done]:
        return NO_DRAFT
    return lookahead.draft.window(done, done + k)
