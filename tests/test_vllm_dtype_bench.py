"""The dtype bench's two judgements (cloud_verifier.bench.vllm_dtype), without vLLM."""

from cloud_verifier.bench.vllm_dtype import degenerate, first_difference


def test_a_loop_is_degenerate_and_fluent_text_is_not():
    assert degenerate([16, 30] * 40)  # "1.1.1.1..."
    assert degenerate(list(range(40)) + [7, 8, 9] * 12)
    assert not degenerate(list(range(64)))
    assert not degenerate([])


def test_the_first_difference_is_the_first_differing_position_or_the_shorter_end():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2
