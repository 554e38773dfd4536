"""The simulated user: which messages they type, and when each key is pressed.

A message is typed into an empty text field character by character. Before every key the
typist waits a key interval drawn uniformly from ``key_ms`` (80-200 ms by default); after a
space it also pauses to find the next word (``word_pause_ms``), and after the end of a
sentence or a comma longer (``sentence_pause_ms``). With probability ``typo_rate`` a letter is
first mistyped (a random other lowercase letter), noticed after a reaction time and erased with
a backspace before the right letter follows: backspaces are edits too. After every key the
field's text is sent for a suggestion of 4-12 tokens (``suggest_tokens``).

Everything is drawn from one seeded generator, and a script is a plain list, so every mode of a
run types exactly the same keys at exactly the same offsets.
"""

from __future__ import annotations

import string
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path

import numpy as np

from edge_client.typing_pace import inside_word

BACKSPACE = "\b"
_SENTENCE_ENDS = ".?!"


@dataclass(frozen=True)
class TypingProfile:
    key_ms: tuple[float, float] = (80.0, 200.0)
    word_pause_ms: tuple[float, float] = (100.0, 500.0)
    sentence_pause_ms: tuple[float, float] = (500.0, 1500.0)
    reaction_ms: tuple[float, float] = (150.0, 400.0)  # from a typo to its backspace
    typo_rate: float = 0.03  # per letter
    suggest_tokens: tuple[int, int] = (4, 12)  # inclusive
    # After the last key the user reads the suggestion this long, then sends the message.
    linger_ms: float = 1500.0

    def __post_init__(self) -> None:
        for name in ("key_ms", "word_pause_ms", "sentence_pause_ms", "reaction_ms",
                     "suggest_tokens"):
            lo, hi = getattr(self, name)
            if not 0 <= lo <= hi:
                raise ValueError(f"{name} must be a range 0 <= low <= high")
        if self.suggest_tokens[0] < 1:
            raise ValueError("suggest_tokens must start at 1 or more")
        if not 0 <= self.typo_rate < 1:
            raise ValueError("typo_rate must be in [0, 1)")


@dataclass(frozen=True)
class Keystroke:
    at_s: float  # seconds after the field was opened
    key: str  # the character typed, or BACKSPACE
    text: str  # the field's text after the key
    max_new_tokens: int  # the length of the suggestion asked for


@dataclass(frozen=True)
class Field:
    """One message typed into one text field."""

    message: int  # index in the message list
    keys: tuple[Keystroke, ...]
    duration_s: float  # from opening the field to sending the message

    @property
    def text(self) -> str:
        return self.keys[-1].text if self.keys else ""


KEY_KINDS = ("word", "space", "punct", "backspace")


def key_kind(key: Keystroke) -> str:
    """Where a key leaves the text: inside a word ("word", as a document's settle wait
    judges it: ``typing_pace.inside_word``), after a space, after punctuation, or a
    backspace."""
    if key.key == BACKSPACE:
        return "backspace"
    if inside_word(key.text):
        return "word"
    return "space" if key.text.endswith(" ") else "punct"


def load_messages(path: Path | None = None) -> list[str]:
    """The messages to type: one a line (default: the benchmark's own ``messages.txt``)."""
    raw = (path.read_text(encoding="utf-8") if path is not None
           else files(__package__).joinpath("messages.txt").read_text(encoding="utf-8"))
    messages = [line.strip() for line in raw.splitlines() if line.strip()]
    if not messages:
        raise ValueError(f"no messages in {path or 'messages.txt'}")
    return messages


def _ms(rng: np.random.Generator, bounds: tuple[float, float]) -> float:
    return float(rng.uniform(*bounds)) / 1000


def type_message(message: str, index: int, rng: np.random.Generator,
                 profile: TypingProfile = TypingProfile()) -> Field:
    keys: list[Keystroke] = []
    text, t = "", 0.0
    lo, hi = profile.suggest_tokens

    def press(key: str, delay_s: float) -> None:
        nonlocal text, t
        t += delay_s
        text = text[:-1] if key == BACKSPACE else text + key
        keys.append(Keystroke(t, key, text, int(rng.integers(lo, hi + 1))))

    previous = ""
    for char in message:
        delay = _ms(rng, profile.key_ms)
        if previous == " ":
            delay += _ms(rng, profile.word_pause_ms)
        elif previous and previous in _SENTENCE_ENDS + ",":
            delay += _ms(rng, profile.sentence_pause_ms)
        if char.isalpha() and rng.random() < profile.typo_rate:
            wrong = str(rng.choice([c for c in string.ascii_lowercase if c != char.lower()]))
            press(wrong, delay)
            press(BACKSPACE, _ms(rng, profile.reaction_ms))
            delay = _ms(rng, profile.key_ms)
        press(char, delay)
        previous = char
    return Field(index, tuple(keys), t + profile.linger_ms / 1000)


class Script:
    """An endless, reproducible sequence of fields: the messages in a seeded order, then
    again in a new order, each typed afresh."""

    def __init__(self, messages: list[str], seed: int,
                 profile: TypingProfile = TypingProfile()) -> None:
        self.messages = messages
        self.profile = profile
        self.rng = np.random.default_rng([seed, 19])
        self._order: list[int] = []

    def next_field(self) -> Field:
        if not self._order:
            self._order = [int(i) for i in self.rng.permutation(len(self.messages))]
        index = self._order.pop(0)
        return type_message(self.messages[index], index, self.rng, self.profile)

    def fields_for(self, duration_s: float) -> list[Field]:
        """Fields whose keys fill ``duration_s`` seconds of typing; the last one is cut at
        the duration."""
        out, total = [], 0.0
        while total < duration_s:
            field = self.next_field()
            room = duration_s - total
            if field.duration_s > room:
                keys = tuple(k for k in field.keys if k.at_s <= room)
                if not keys:
                    break
                field = Field(field.message, keys,
                              keys[-1].at_s + self.profile.linger_ms / 1000)
            out.append(field)
            total += field.duration_s
        return out
