"""Draft, or let the server decode alone? Whichever has been delivering more tokens per second.

Speculation pays only when E[tokens per round] / (round trip + drafting + verification) beats
the rate at which the server streams plainly decoded tokens (one forward per token, no round
trip per token, via ``Continue``). Which side wins depends on the network, the device, the
draft's acceptance on this kind of text and the server's load, all of which move. Rather than
model them, a ``RateChooser`` measures both: an exponential moving average of delivered tokens
per second for each mode, timed by the caller from request to reply (so network, drafting,
queueing and forwards are all in it). It picks the faster mode and re-measures the slower one
every ``explore_every`` decisions (16), so it notices when load or acceptance changes.

One chooser lives as long as a device's connection (it spans generations: a short IME
completion alone is too short to learn anything). The server's ``suggested_draft_len = 0``
still overrides it: under saturation, drafts cost the other sessions compute, which this
device cannot measure.
"""

from __future__ import annotations

SPEC = "spec"
CONTINUE = "continue"
# Tokens per Decode the chooser asks for: long enough that the stream's one round
# trip is small against its decoding time, short enough to re-measure drafting soon.
CONTINUE_TOKENS = 64
EXPLORE_CONTINUE_TOKENS = 16


class RateChooser:
    def __init__(self, weight: float = 0.3, explore_every: int = 16) -> None:
        if not 0 < weight <= 1 or explore_every < 2:
            raise ValueError("weight must be in (0, 1] and explore_every at least 2")
        self.weight = weight
        self.explore_every = explore_every
        self.rate: dict[str, float | None] = {SPEC: None, CONTINUE: None}
        self._since: dict[str, int] = {SPEC: 0, CONTINUE: 0}
        self.exploring = False

    def observe(self, mode: str, tokens: int, seconds: float) -> None:
        """``tokens`` delivered in ``seconds`` (from sending the request to the last reply)."""
        if tokens <= 0 or seconds <= 0:
            return
        value = tokens / seconds
        old = self.rate[mode]
        self.rate[mode] = value if old is None else old + self.weight * (value - old)

    def choose(self) -> str:
        """The mode for the next round (SPEC) or stream (CONTINUE); call once per decision."""
        spec, cont = self.rate[SPEC], self.rate[CONTINUE]
        self.exploring = True
        if spec is None:
            return SPEC
        if cont is None:
            return CONTINUE
        best, other = (SPEC, CONTINUE) if spec >= cont else (CONTINUE, SPEC)
        self._since[other] += 1
        if self._since[other] >= self.explore_every:
            self._since[other] = 0
            return other
        self.exploring = False
        return best

    def continue_tokens(self) -> int:
        return EXPLORE_CONTINUE_TOKENS if self.exploring else CONTINUE_TOKENS
