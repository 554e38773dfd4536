"""Prompt-lookup drafting: propose a continuation copied from the context itself, no model.

The last n committed tokens (n from ``max_ngram`` down to ``min_ngram``) are looked up in the
earlier context; at the most recent earlier occurrence of the longest n that matches, the
tokens that followed it are proposed. The copy is allowed to run on into the tokens it has
just proposed (as an LZ77 copy does), so a match near the end of a repeating pattern extends
the pattern instead of stopping short: any match yields exactly K drafts, no match yields none.

The drafter is a deterministic function of the committed tokens, so each draft's q is a point
mass: ``Proposal.q`` is None in every mode, and the verifier treats an empty ``Draft.q`` as
point masses. That is lossless in sampling mode too: a point-mass draft x is accepted with
probability p(x) and on rejection the correction is drawn from p with x removed.

Numpy and the standard library only (the device has no torch). It keeps no state, so
``resync`` has nothing to roll back.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from edge_client.drafter import Proposal


def find_continuation(tokens: Sequence[int], k: int, max_ngram: int,
                      min_ngram: int = 1) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the longest suffix.

    Suffix lengths n = max_ngram .. min_ngram are tried in turn; for the first n that occurs
    earlier (an occurrence may overlap the suffix but not be it), the copy starts right after
    that occurrence and continues through the proposal itself. Returns [] when nothing matches.
    """
    if k < 0 or not 1 <= min_ngram <= max_ngram:
        raise ValueError(f"need k >= 0 and 1 <= min_ngram <= max_ngram, got k={k}, "
                         f"min_ngram={min_ngram}, max_ngram={max_ngram}")
    seq = np.asarray(tokens, dtype=np.int64)  # [L]
    length = seq.size
    if k == 0 or length < 2:
        return []
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        suffix = seq[length - n:]  # [n]
        # Windows of seq[:-1] start at 0 .. L-1-n: every n-gram except the suffix itself.
        windows = sliding_window_view(seq[:-1], n)  # [L-n, n]
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n  # < L, the first token after the occurrence
            out: list[int] = []
            for j in range(k):
                src = start + j
                out.append(int(seq[src]) if src < length else out[src - length])
            return out
    return []


class NgramDrafter:
    """Drafts by prompt lookup; the same interface as ``ModelDrafter``."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def resync(self, committed: list[int]) -> int:
        """Nothing is cached: every proposal reads ``committed`` afresh."""
        return len(committed)

    def propose(self, committed: list[int], k: int) -> Proposal:
        """At most k point-mass drafts after ``committed``; none when no n-gram matches."""
        return Proposal(find_continuation(committed, k, self.max_ngram, self.min_ngram), None)
