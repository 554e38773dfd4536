"""Prompt-lookup (n-gram) drafting and the combined drafter: lookup on hand-built sequences,
per-position choice and the model drafter's cache under mixed rounds, greedy identity end to
end."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cloud_verifier.config import VerifierConfig
from cloud_verifier.server import EmbeddedVerifier
from edge_client.client import EdgeClient, GenerationConfig
from edge_client.combined_drafter import make_drafter
from edge_client.draft_model import OnnxDraftModel
from edge_client.drafter import DraftSampling
from edge_client.ngram_drafter import (
    LOOKUP_CONFIDENCE,
    ContextLookup,
    NgramDrafter,
    find_continuation,
    longest_match,
)

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


def test_context_lookup_needs_two_repeated_tokens_and_reports_its_confidence():
    lookup = ContextLookup()
    assert lookup([5, 17, 42, 9, 5]) is None  # only "5" repeats
    assert lookup([5, 17, 42, 9, 5, 17]) == (42, LOOKUP_CONFIDENCE[2])
    assert lookup([1, 2, 3, 4, 9, 1, 2, 3, 4]) == (9, LOOKUP_CONFIDENCE[4])
    long = list(range(20)) + [77] + list(range(20))
    assert lookup(long) == (77, LOOKUP_CONFIDENCE[8])  # n capped at max_ngram = 8
    assert lookup.proposed == 3
    assert longest_match([5, 17, 42, 9, 5, 17], 8, 2) == (2, 2)
    assert ContextLookup(min_ngram=1)([5, 17, 42, 9, 5]) == (17, LOOKUP_CONFIDENCE[1])
    with pytest.raises(ValueError, match="min_ngram"):
        ContextLookup(max_ngram=2, min_ngram=3)


def reference_combined(model: OnnxDraftModel, committed: list[int], k: int) -> list[int]:
    """Greedy combined drafts by plain means: per position, the follower of the longest
    earlier suffix of 2..8 tokens, else the argmax of a fresh forward over the context."""
    out: list[int] = []
    for _ in range(k):
        context = committed + out
        match = longest_match(context, 8, 2)
        if match is not None:
            out.append(context[match[0]])
        else:
            out.append(int(model.forward(model.new_cache(), context)[-1].argmax()))
    return out


def mixed_context(model: OnnxDraftModel) -> list[int]:
    """A context whose combined round starts with the model and then copies: it ends in a
    token y seen once before, followed there by d, the model's own next token here (found as
    a fixed point of "d = the argmax after X y d Z y")."""
    for seed in range(50):
        rng = np.random.default_rng(seed)
        x, z = rng.integers(3, 90, size=5).tolist(), rng.integers(3, 90, size=3).tolist()
        y, d = int(rng.integers(3, 90)), 0
        for _ in range(4):
            context = x + [y, d] + z + [y]
            nxt = int(model.forward(model.new_cache(), context)[-1].argmax())
            if nxt == d and longest_match(context, 8, 2) is None:
                return context
            d = nxt
    raise AssertionError("no context found")


def test_combined_chooses_per_position_and_keeps_the_model_cache_in_sync(draft_model):
    model = draft_model
    combined = make_drafter("combined", model, DraftSampling(), np.random.default_rng(0))
    rng = np.random.default_rng(3)
    committed = mixed_context(model)
    sources = set()
    for _ in range(16):
        calls = combined.forward_calls
        proposal = combined.propose(committed, 4)
        assert proposal.tokens == reference_combined(model, committed, 4)
        assert len(proposal.confidence) == 4 and proposal.q is None
        context = committed + proposal.tokens
        hits = [longest_match(context[:len(committed) + j], 8, 2) is not None
                for j in range(4)]
        sources.add(tuple(hits))
        if all(hits):
            assert combined.forward_calls == calls  # a round copied whole runs no forward
        # The cache holds exactly a prefix of the context, as a fresh forward computes it.
        fed = combined._fed
        assert fed == context[:len(fed)]
        if fed:
            for got, want in zip(combined.cache.keys, fresh_keys(model, fed), strict=True):
                np.testing.assert_allclose(got, want, atol=1e-5)
        # Commit a random prefix of the drafts, then either a fresh token or a copy of an
        # earlier span (text that repeats), so later rounds mix copied and modelled positions.
        keep = int(rng.integers(0, 5))
        if rng.random() < 0.5:
            at, n = int(rng.integers(0, len(committed) - 3)), int(rng.integers(2, 4))
            tail = committed[at:at + n]
        else:
            tail = [int(rng.integers(3, 90))]
        committed += proposal.tokens[:keep] + tail
    assert any(all(h) for h in sources) and any(not any(h) for h in sources)
    assert any(any(h) and not all(h) for h in sources), sources  # mixed rounds happened


def test_combined_in_sampling_mode_sends_point_masses_for_copied_positions(draft_model):
    sampling = DraftSampling(temperature=0.8, top_p=0.9)
    combined = make_drafter("combined", draft_model, sampling, np.random.default_rng(1))
    model_round = combined.propose(PROMPT, 3)
    assert model_round.q is not None and len(model_round.q) == 3
    for token, (ids, probs) in zip(model_round.tokens, model_round.q, strict=True):
        assert token in ids.tolist() and probs.sum() == pytest.approx(1, abs=1e-5)
    copied = combined.propose(PROMPT + [17, 42], 3)  # "17 42" repeats: copies 5 63 8
    assert copied.tokens == [5, 63, 8]
    assert [(ids.tolist(), probs.tolist()) for ids, probs in copied.q] == [([t], [1.0])
                                                                           for t in [5, 63, 8]]


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


def sampled_mixed_context(model: OnnxDraftModel, target, params) -> tuple[list[int], int]:
    """(context, t): the context ends in a token y seen once before, followed there by t,
    which both the draft (top-k 6, T = 1) and the target give at least 0.15: so the first
    draft is sampled from the model's q and, whenever it is t, the second is copied."""
    from cloud_verifier.sampling import target_probs
    from edge_client.sampling import truncated_distribution

    vocab = model.vocab_size
    for seed in range(200):
        rng = np.random.default_rng(seed)
        x, z = rng.integers(3, 90, size=5).tolist(), rng.integers(3, 90, size=3).tolist()
        y = int(rng.integers(3, 90))
        contexts = [x + [y, t] + z + [y] for t in range(vocab)]
        with torch.no_grad():
            p1 = target_probs(target.model(torch.tensor(contexts)).logits[:, -1], params)
        for t in np.flatnonzero(p1[torch.arange(vocab), torch.arange(vocab)] >= 0.15):
            context = contexts[t]
            if longest_match(context, 8, 2) is not None:
                continue
            ids, probs = truncated_distribution(
                model.forward(model.new_cache(), context)[-1], 1.0, 6, 1.0, 0)
            if probs[ids == t].sum() >= 0.15:
                return context, int(t)
    raise AssertionError("no context found")


def test_combined_sampling_follows_the_target_distribution(verifier, tiny_llama_pair, target,
                                                           draft_model):
    """Rounds that mix a sampled model draft and a copied one keep the target's law.

    The prompt (``sampled_mixed_context``) makes the first draft a sample from the model's q
    and, whenever that sample is t, the second draft the copied point mass that followed t
    before; the choice depends on the first draw, which is lossless because it is made
    before the second is drawn. n = 2000 generations (seeds 0..1999) at temperature 1, top-k
    6, K = 2; the joint law of the first two tokens against the exact target law
    p(a) p(b | a): per bin |count - n p| <= 6 sqrt(n p (1 - p)) + 5, and a pair with p = 0
    never appears.
    """
    from cloud_verifier.sampling import SamplingParams, target_probs

    n, params = 2000, SamplingParams(temperature=1.0, top_k=6)
    prompt, t = sampled_mixed_context(draft_model, target, params)
    with torch.no_grad():
        p1 = target_probs(target.model(torch.tensor([prompt])).logits[0, -1:], params)[0]
        firsts = torch.arange(target.vocab_size)
        batch = torch.cat([torch.tensor([prompt]).expand(len(firsts), -1), firsts[:, None]],
                          dim=1)
        p2 = target_probs(target.model(batch).logits[:, -1], params)  # [V, V]
    joint = (p1[:, None] * p2).numpy().astype(np.float64)
    counts = np.zeros_like(joint)
    with EdgeClient(verifier.address, tiny_llama_pair.draft_dir) as client:
        for seed in range(n):
            gen = client.generate(prompt, GenerationConfig(
                max_new_tokens=2, temperature=1.0, top_k=6, seed=seed, draft_len=2,
                ignore_eos=True, drafter="combined"))
            list(gen)
            a, b = gen.token_ids
            counts[a, b] += 1
    assert counts[joint == 0].sum() == 0, "a pair with target probability 0 appeared"
    bound = 6 * np.sqrt(n * joint * (1 - joint)) + 5
    worst = np.max(np.abs(counts - n * joint) - bound)
    assert worst <= 0, f"a bin is off by {worst:.1f} beyond its bound"
    # The test has power: had the copied draft after t always been kept, it would fail.
    copy = prompt[prompt.index(prompt[-1]) + 2]
    kept = joint.copy()
    kept[t] = 0
    kept[t, copy] = joint[t].sum()
    assert np.max(np.abs(n * kept - n * joint) - bound) > 0


@pytest.mark.parametrize("kind", ["model", "combined"])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_drafting_stops_once_the_joint_confidence_is_low(draft_model, kind, temperature):
    """With stop_confidence, a round drafts while the product of the drafts' confidences (a
    greedy draft's top probability, a sampled draft's q top probability, a copy's measured
    hit rate) stays at or above it, at least one draft; what it drafts is the unstopped
    round's prefix, since each stop is decided before the next draw."""
    contexts = [list(PROMPT), mixed_context(draft_model), PROMPT + [17, 42]]
    stopped_early = 0
    for stop in (0.05, 0.3, 0.9):
        for seed, context in enumerate(contexts):
            full = make_drafter(kind, draft_model, DraftSampling(temperature),
                                np.random.default_rng(seed)).propose(context, 6)
            cut = make_drafter(kind, draft_model, DraftSampling(temperature, stop_confidence=stop),
                               np.random.default_rng(seed)).propose(context, 6)
            n = len(cut.tokens)
            assert 1 <= n <= 6 and cut.tokens == full.tokens[:n]
            lookup = ContextLookup() if kind == "combined" else (lambda _context: None)
            copies = [lookup(context + full.tokens[:j]) for j in range(6)]
            sure = full.confidence if temperature == 0 else [
                float(probs[0]) if hit is None else hit[1]
                for hit, (_ids, probs) in zip(copies, full.q, strict=True)]
            if temperature == 0:
                assert cut.confidence == full.confidence[:n]
            joint = np.cumprod(sure)
            assert n == 6 or joint[n - 1] < stop  # stopped only below the threshold
            assert all(joint[:n - 1] >= stop)  # ... and not before
            stopped_early += n < 6
    assert stopped_early > 0


def test_stop_confidence_is_checked():
    for bad in (-0.1, 1.0, 2.0):
        with pytest.raises(ValueError, match="stop_confidence"):
            GenerationConfig(stop_confidence=bad)
