"""Prompt-lookup (n-gram) drafting and the combined drafter: lookup on hand-built sequences,
the model drafter's cache under mixed rounds, and greedy identity end to end."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cloud_verifier.config import VerifierConfig
from cloud_verifier.server import EmbeddedVerifier
from edge_client.client import EdgeClient, GenerationConfig
from edge_client.combined_drafter import CombinedDrafter, make_drafter
from edge_client.draft_model import OnnxDraftModel
from edge_client.drafter import DraftSampling, ModelDrafter
from edge_client.ngram_drafter import NgramDrafter, find_continuation

PROMPT = [1, 17, 42, 5, 63, 8]  # no token repeats: the n-gram drafter finds nothing


def reference_continuation(seq: list[int], k: int, max_ngram: int, min_ngram: int) -> list[int]:
    """Plain loops: longest suffix first, latest earlier start, copy through the output."""
    for n in range(max_ngram, min_ngram - 1, -1):
        if n >= len(seq):
            continue
        for start in range(len(seq) - n - 1, -1, -1):
            if seq[start:start + n] == seq[len(seq) - n:]:
                out = list(seq)
                for j in range(k):
                    out.append(out[start + n + j])
                return out[len(seq):]
    return []


def test_lookup_takes_the_longest_suffix_first():
    # "4 1 2" matches at 0; the shorter "1 2" would match later, at 5.
    assert find_continuation([4, 1, 2, 5, 9, 1, 2, 6, 4, 1, 2], 2, max_ngram=3) == [5, 9]
    assert find_continuation([4, 1, 2, 5, 9, 1, 2, 6, 4, 1, 2], 2, max_ngram=2) == [6, 4]


def test_lookup_takes_the_most_recent_occurrence():
    assert find_continuation([1, 2, 7, 1, 2, 8, 0, 1, 2], 2, max_ngram=2) == [8, 0]


def test_no_proposal_without_a_match():
    assert find_continuation([1, 2, 3, 4], 4, max_ngram=3) == []
    assert find_continuation([9], 4, max_ngram=3) == []
    # Only a unigram matches: refused when the minimum n is 2.
    assert find_continuation([1, 2, 1], 4, max_ngram=3, min_ngram=2) == []
    assert find_continuation([1, 2, 1], 2, max_ngram=3, min_ngram=1) == [2, 1]
    proposal = NgramDrafter().propose(PROMPT, 4)
    assert proposal.tokens == [] and proposal.q is None


def test_proposal_is_capped_at_k():
    seq = [1, 2, 3, 4, 5, 6, 1]
    assert find_continuation(seq, 2, max_ngram=3) == [2, 3]
    assert find_continuation(seq, 0, max_ngram=3) == []
    for k in range(8):
        assert len(NgramDrafter().propose(seq, k).tokens) <= k


def test_copy_runs_on_through_a_repeating_pattern():
    assert find_continuation([1, 2, 3, 1, 2, 3, 1, 2], 5, max_ngram=3) == [3, 1, 2, 3, 1]
    assert find_continuation([7, 7], 3, max_ngram=3) == [7, 7, 7]


def test_lookup_matches_a_plain_loop_reference():
    """2000 random sequences over 4 symbols (many matches, many overlaps)."""
    rng = np.random.default_rng(0)
    for _ in range(2000):
        seq = rng.integers(0, 4, size=int(rng.integers(0, 14))).tolist()
        k, max_n = int(rng.integers(0, 6)), int(rng.integers(1, 5))
        min_n = int(rng.integers(1, max_n + 1))
        assert find_continuation(seq, k, max_n, min_n) == \
            reference_continuation(seq, k, max_n, min_n), (seq, k, max_n, min_n)


def fresh_keys(model: OnnxDraftModel, tokens: list[int]) -> list[np.ndarray]:
    cache = model.new_cache()
    model.forward(cache, tokens)
    return cache.keys


@pytest.fixture(scope="module")
def draft_model(tiny_llama_pair):
    return OnnxDraftModel(tiny_llama_pair.draft_dir)


def test_combined_falls_back_to_the_model_and_keeps_its_cache_in_sync(draft_model):
    model = draft_model
    combined = CombinedDrafter(ModelDrafter(model, DraftSampling(), np.random.default_rng(0)),
                               NgramDrafter())

    # Round 1: nothing repeats, so the model drafts, as a fresh model drafter would.
    first = combined.propose(PROMPT, 4)
    assert first.tokens == ModelDrafter(model, DraftSampling(),
                                        np.random.default_rng(0)).propose(PROMPT, 4).tokens
    # Round 2: "17 42" occurred before, so the n-gram drafts and the model is not run.
    committed = PROMPT + first.tokens[:1] + [17, 42]
    length = combined.model.cache.length
    second = combined.propose(committed, 4)
    assert second.tokens == [5, 63, 8, first.tokens[0]] and second.q is None
    assert combined.model.cache.length == length
    # Round 3: a never-seen token ends the context; the model catches up over both rounds.
    new = next(t for t in range(3, model.vocab_size) if t not in committed + second.tokens)
    committed += second.tokens[:2] + [new]
    third = combined.propose(committed, 3)
    assert (combined.ngram_rounds, combined.model_rounds) == (1, 2)
    assert combined.model.cache.length == len(committed) + 2  # d_3 is sampled, never fed
    for got, want in zip(combined.model.cache.keys,
                         fresh_keys(model, committed + third.tokens[:2]), strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5)
    fresh = ModelDrafter(model, DraftSampling(), np.random.default_rng(0))
    assert third.tokens == fresh.propose(committed, 3).tokens


def test_combined_in_sampling_mode_sends_q_only_for_model_rounds(draft_model):
    sampling = DraftSampling(temperature=0.8, top_p=0.9)
    combined = make_drafter("combined", draft_model, sampling, np.random.default_rng(1))
    model_round = combined.propose(PROMPT, 3)
    assert model_round.q is not None and len(model_round.q) == 3
    for token, (ids, probs) in zip(model_round.tokens, model_round.q, strict=True):
        assert token in ids.tolist() and probs.sum() == pytest.approx(1, abs=1e-5)
    ngram_round = combined.propose(PROMPT + [17], 3)
    assert ngram_round.tokens == [42, 5, 63] and ngram_round.q is None


def test_unknown_drafter_is_refused(draft_model):
    with pytest.raises(ValueError, match="drafter"):
        GenerationConfig(drafter="oracle")
    with pytest.raises(ValueError, match="drafter"):
        make_drafter("oracle", draft_model, DraftSampling(), np.random.default_rng(0))


def test_cli_takes_the_drafter():
    from edge_client.cli import build_parser

    args = build_parser().parse_args(["generate", "--embedded", "--prompt", "x",
                                      "--drafter", "combined"])
    assert args.drafter == "combined"


@pytest.fixture(scope="module")
def verifier(target):
    with EmbeddedVerifier(target, VerifierConfig(port=0, max_sessions=4)) as v:
        yield v


@pytest.mark.parametrize("drafter", ["ngram", "combined"])
@pytest.mark.parametrize("draft_len", [1, 4])
def test_greedy_output_is_the_targets(verifier, tiny_llama_pair, target, drafter, draft_len):
    prompt = PROMPT + [17, 42, 9, 17, 42]  # a repeat, so the n-gram drafter has work from the start
    want = target.model.generate(torch.tensor([prompt]), max_new_tokens=40, min_new_tokens=40,
                                 do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()
    with EdgeClient(verifier.address, tiny_llama_pair.draft_dir) as client:
        gen = client.generate(prompt, GenerationConfig(max_new_tokens=40, draft_len=draft_len,
                                                       ignore_eos=True, drafter=drafter))
        list(gen)
    assert gen.token_ids == want
    s = gen.stats
    assert s.round_trips == s.rounds == s.target_forwards
    assert s.drafted > 0 and 0 <= s.accepted <= s.drafted


@pytest.mark.parametrize("drafter", ["ngram", "combined"])
def test_sampled_generation_runs_with_point_mass_rounds(verifier, tiny_llama_pair, drafter):
    """Sampling mode with n-gram rounds (empty q on the wire): valid, seeded, complete."""
    config = GenerationConfig(max_new_tokens=30, temperature=0.9, top_p=0.95, seed=3,
                              draft_len=3, ignore_eos=True, drafter=drafter)
    outputs = []
    with EdgeClient(verifier.address, tiny_llama_pair.draft_dir) as client:
        for _ in range(2):
            gen = client.generate(PROMPT + [17, 42, 9, 17, 42], config)
            list(gen)
            outputs.append(gen.token_ids)
    assert len(outputs[0]) == 30 and outputs[0] == outputs[1]
