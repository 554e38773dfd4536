"""edge_client.typing_pace: the wait inside a word, learnt from the typist's own gaps."""

from __future__ import annotations

import pytest

from edge_client.typing_pace import MIN_GAPS, TypingPace, inside_word


def type_word(pace: TypingPace, word: str, start: float, gap_s: float) -> list[float]:
    """Types ``word`` after a space, one key every ``gap_s``; the waits each key got."""
    waits = [pace.key("so ", start)]
    for i in range(1, len(word) + 1):
        waits.append(pace.key("so " + word[:i], start + i * gap_s))
    return waits


def test_inside_a_word_is_a_last_letter_or_digit():
    assert inside_word("hel") and inside_word("route 6") and inside_word("naïve")
    assert not any(inside_word(t) for t in ("hello ", "hi,", "ok.", "", "a\n"))


def test_the_default_until_enough_gaps_then_one_and_a_half_times_their_median():
    pace = TypingPace(150)
    # "so " then 5 letters: 4 gaps between in-word keys per word (the first letter's gap
    # follows a space, which is not a gap inside a word).
    waits = type_word(pace, "abcde", 0.0, 0.120)
    assert waits[0] == 0 and waits[1:] == [150] * 5  # 4 gaps known: still the default
    waits = type_word(pace, "abcde", 10.0, 0.120)
    assert pace.wait_ms() == pytest.approx(180)  # 8 gaps of 120 ms
    assert waits[-1] == pytest.approx(180)
    assert waits[0] == 0  # after the space: no wait


@pytest.mark.parametrize("gap_s, want", [(0.02, 75), (0.5, 300)])
def test_the_learnt_wait_stays_within_half_and_twice_the_default(gap_s, want):
    pace = TypingPace(150)
    for word in range(3):
        type_word(pace, "abcdef", 100.0 * word, gap_s)
    assert pace.wait_ms() == pytest.approx(want)


def test_pauses_and_word_boundaries_are_not_gaps():
    pace = TypingPace(150)
    at = 0.0
    for _ in range(MIN_GAPS * 2):  # each in-word key after a 3 s pause: none is a gap
        at += 3.0
        pace.key("so a", at)
    assert pace.wait_ms() == 150
    for i in range(MIN_GAPS * 2):  # keys that end words: no gaps either
        pace.key("so a " if i % 2 else "so a", 100 + 0.1 * i)
    assert pace.wait_ms() == 150


def test_zero_turns_the_wait_off_and_negative_is_refused():
    pace = TypingPace(0)
    assert type_word(pace, "abcdefghijkl", 0.0, 0.1) == [0.0] * 13
    with pytest.raises(ValueError, match="settle"):
        TypingPace(-1)
