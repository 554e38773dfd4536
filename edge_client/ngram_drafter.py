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

``ContextLookup`` is the same lookup asked one position at a time, for the combined drafter
(``edge_client.drafter.ModelDrafter`` with a lookup): a suffix of at least two tokens that
occurred earlier proposes its follower, anything shorter leaves the position to the model.

Numpy and the standard library only (the device has no torch). It keeps no state, so
``resync`` has nothing to roll back.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from edge_client.drafter import Proposal


def _check_ngram(max_ngram: int, min_ngram: int) -> None:
    if not 1 <= min_ngram <= max_ngram:
        raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")


def longest_match(tokens: Sequence[int], max_ngram: int, min_ngram: int = 1
                  ) -> tuple[int, int] | None:
    """(start, n): the longest suffix of ``tokens`` with min_ngram <= n <= max_ngram that
    occurs earlier, and the index of the token that followed its latest earlier occurrence (an
    occurrence may overlap the suffix but not be it). None when no such suffix occurs."""
    _check_ngram(max_ngram, min_ngram)
    seq = np.asarray(tokens, dtype=np.int64)  # [L]
    length = seq.size
    if length < 2:
        return None
    # Occurrences end where the last token recurs; walk back from each candidate end at once.
    ends = np.flatnonzero(seq[:-1] == seq[-1])  # [C], each < L - 1
    if ends.size == 0:
        return None
    matched = np.ones(ends.size, dtype=np.int64)  # suffix tokens matched so far, per candidate
    alive = np.ones(ends.size, dtype=bool)
    for back in range(1, min(max_ngram, length - 1)):
        idx = ends - back
        alive &= idx >= 0
        alive[alive] = seq[idx[alive]] == seq[length - 1 - back]
        matched += alive
    best = int(matched.max())
    if best < min_ngram:
        return None
    return int(ends[np.flatnonzero(matched == best)[-1]]) + 1, best


def find_continuation(tokens: Sequence[int], k: int, max_ngram: int,
                      min_ngram: int = 1) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the longest suffix.

    Suffix lengths n = max_ngram .. min_ngram are tried in turn; for the first n that occurs
    earlier, the copy starts right after that occurrence and continues through the proposal
    itself. Returns [] when nothing matches.
    """
    if k < 0:
        raise ValueError(f"need k >= 0, got k={k}")
    _check_ngram(max_ngram, min_ngram)
    match = longest_match(tokens, max_ngram, min_ngram) if k else None
    if match is None:
        return []
    start, length = match[0], len(tokens)
    out: list[int] = []
    for j in range(k):
        src = start + j
        out.append(int(tokens[src]) if src < length else out[src - length])
    return out


# How often the lookup's token was the target's, by match length n (greedy, teacher-forced on
# the target's 64-token paths of the 136 realistic-set prompts outside the report subset, draft
# v7, 2026-12-02; docs/benchmarks.md "Combined drafting"): n = 2: 0.51 (584 positions),
# 3: 0.61 (308), 4: 0.67 (197), 5-7: 0.74-0.80 (335), >= 8: 0.90 (494). The model's own
# argmax was right at 0.40-0.51 of those positions, and at only 0.39 against the lookup's
# 0.19 where just one token matched: hence a minimum of two.
LOOKUP_CONFIDENCE = {1: 0.19, 2: 0.51, 3: 0.61, 4: 0.67, 5: 0.74, 6: 0.74, 7: 0.74, 8: 0.9}


class ContextLookup:
    """Prompt lookup asked for one position: the follower of the longest earlier suffix of
    2..8 tokens, with the measured chance that it is the target's greedy token, or None.

    A function of the context alone (never of a sampled draft at this position), so a drafter
    may choose per position between it and the model and stay lossless.
    """

    def __init__(self, max_ngram: int = 8, min_ngram: int = 2) -> None:
        _check_ngram(max_ngram, min_ngram)
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.proposed = 0  # tokens this lookup supplied, for the benchmarks

    def __call__(self, context: Sequence[int]) -> tuple[int, float] | None:
        match = longest_match(context, self.max_ngram, self.min_ngram)
        if match is None:
            return None
        start, n = match
        self.proposed += 1
        return int(context[start]), LOOKUP_CONFIDENCE[min(n, max(LOOKUP_CONFIDENCE))]


class NgramDrafter:
    """Drafts by prompt lookup; the same interface as ``ModelDrafter``."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        _check_ngram(max_ngram, min_ngram)
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def resync(self, committed: list[int]) -> int:
        """Nothing is cached: every proposal reads ``committed`` afresh."""
        return len(committed)

    def propose(self, committed: list[int], k: int) -> Proposal:
        """At most k point-mass drafts after ``committed``; none when no n-gram matches."""
        return Proposal(find_continuation(committed, k, self.max_ngram, self.min_ngram), None)
