"""How long a suggestion inside a word waits for the typing to settle, learnt from the typist.

A key inside a word is usually followed by the next one within the typist's own key
interval, and a suggestion for it is stale by then: sending it costs the verifier forwards
that nobody sees. ``TypingPace`` watches the gaps between consecutive keys inside a word and
waits a little longer than the typical one (1.5 x the median of the last 32, once 8 are
known), so a steady burst sends nothing and a hesitation inside a word gets its suggestion.
A slow typist thus waits longer and a fast one less than a fixed time would make them. The
wait stays within [default / 2, 2 x default] of ``GenerationConfig.word_settle_ms``, the
wait until enough gaps are known; 0 turns the wait off.
"""

from __future__ import annotations

import statistics
from collections import deque

WINDOW = 32  # the gaps the median is taken over
MIN_GAPS = 8  # before this many, the default
FACTOR = 1.5  # times the median gap: most in-word gaps are shorter
MAX_GAP_S = 2.0  # a longer gap is a pause, not the typing pace


def inside_word(text: str) -> bool:
    """Whether ``text`` ends inside a word: its last character a letter or a digit."""
    return text[-1:].isalnum()


class TypingPace:
    def __init__(self, default_ms: float) -> None:
        if not default_ms >= 0:
            raise ValueError("the word settle time must be >= 0")
        self.default_ms = float(default_ms)
        self._gaps: deque[float] = deque(maxlen=WINDOW)  # seconds
        self._last: tuple[float, bool] | None = None  # (time, inside a word) of the last key

    def key(self, text: str, at: float) -> float:
        """Records a key whose text is now ``text`` at ``at`` (seconds, any monotonic clock);
        how long its suggestion waits, in ms: 0 outside a word."""
        inside = inside_word(text)
        if self._last is not None and inside and self._last[1]:
            gap = at - self._last[0]
            if 0 <= gap <= MAX_GAP_S:
                self._gaps.append(gap)
        self._last = (at, inside)
        return self.wait_ms() if inside else 0.0

    def wait_ms(self) -> float:
        """The wait inside a word as things stand."""
        if self.default_ms == 0 or len(self._gaps) < MIN_GAPS:
            return self.default_ms
        learnt = FACTOR * 1000 * statistics.median(self._gaps)
        return min(max(learnt, self.default_ms / 2), 2 * self.default_ms)
