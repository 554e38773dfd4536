"""The one line ``edge-client generate`` (and ``make demo``) prints about a generation."""

from edge_client.wire import GenerationStats


def test_the_line_says_what_the_draft_saved():
    stats = GenerationStats(new_tokens=64, drafted=120, accepted=30, target_forwards=40,
                            round_trips=41, reopens=1, wall_s=3.2, rounds=40)
    assert stats.describe() == (
        "64 tokens in 3.20 s (20.0 tok/s): 30 of 120 drafted tokens accepted (25%), "
        "1.60 tokens per target forward, 40 target forwards where cloud-only decoding takes "
        "64 (38% saved); 41 round trips, 1 reopens")


def test_an_empty_generation_divides_by_nothing():
    line = GenerationStats().describe()
    assert line.startswith("0 tokens in 0.00 s (0.0 tok/s): 0 of 0 drafted tokens accepted (0%)")
    assert "0.00 tokens per target forward" in line and "(0% saved)" in line
