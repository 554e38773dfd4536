"""Editing sessions on the verifier, without the network: an edit rolls the session's text
and KV cache back to the kept tokens, and what follows is exactly what a fresh session over
the edited text gives, greedy or sampled. Also the draft's cache resync after edits.

The random edits are what a keyboard makes: typing, backspace, accepting part of the
suggestion, retyping in the middle of the text, asking again over the same text.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from cloud_verifier.config import VerifierConfig
from cloud_verifier.engine import VerifierEngine
from cloud_verifier.errors import InvalidRequest, RoundOutOfOrder
from cloud_verifier.metrics import VerifierMetrics
from cloud_verifier.rounds import RoundRunner
from cloud_verifier.sampling import SamplingParams, target_probs
from cloud_verifier.sessions import Session
from cloud_verifier.target_engine import DraftRound
from cloud_verifier.wire import ROUNDS, EditParams, OpenParams

GREEDY_SEQUENCES = 480  # with tests/test_document.py's, over 500 random edit sequences


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Thousands of tiny forwards: intra-op threads only contend (measured 20x slower with 2
    threads on a loaded 2-core machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def runner(target):
    engine = VerifierEngine(target.model, target.vocab_size, target.max_context)
    # No prefix cache: what a forward feeds is then only the session's own doing.
    return RoundRunner(engine, VerifierConfig(max_sessions=4096, prefix_cache_bytes=0),
                       VerifierMetrics())


class FedCounter:
    """Wraps the engine's forward and records the tokens each segment fed."""

    def __init__(self, engine: VerifierEngine) -> None:
        self.engine = engine
        self.fed: list[int] = []

    def __enter__(self) -> FedCounter:
        inner = self.engine._forward

        def counting(model, segments):
            self.fed.extend(len(s.tokens) for s in segments)
            return inner(model, segments)

        self.engine._forward = counting
        self._inner = inner
        return self

    def __exit__(self, *exc) -> None:
        self.engine._forward = self._inner


def open_session(runner: RoundRunner, prompt: list[int], max_new_tokens: int,
                 sampling: SamplingParams | None = None, editable: bool = True) -> Session:
    sampling = sampling or SamplingParams()
    return runner.create_session(OpenParams(list(prompt), sampling, max_new_tokens,
                                            frozenset(), ROUNDS, None, editable), "test")


def run_suggestion(runner: RoundRunner, session: Session, drafts) -> list[int]:
    """Rounds until the suggestion finishes; ``drafts(session)`` gives each round's."""
    start = len(session.committed)
    while not session.finished:
        runner.engine.run_round(session, drafts(session))
    return session.committed[start:]


def fresh_greedy(runner: RoundRunner, text: list[int], n: int) -> list[int]:
    session = open_session(runner, text, n, editable=False)
    out = run_suggestion(runner, session, lambda s: DraftRound([], None))
    runner.close(session)
    return out


def random_drafts(rng: random.Random, vocab: int, reference: dict):
    """Drafts that are partly right (the greedy continuation, when known) and partly
    random, so that rounds both accept and reject."""

    def drafts(session: Session) -> DraftRound:
        k = rng.randint(0, 3)
        known = reference.get(tuple(session.committed[:session.prompt_len]))
        done = session.num_generated
        if known is not None and rng.random() < 0.5:
            tokens = known[done:done + k]
            if tokens and rng.random() < 0.5:
                tokens[-1] = rng.randrange(3, vocab)
        else:
            tokens = [rng.randrange(3, vocab) for _ in range(k)]
        return DraftRound(tokens, None)

    return drafts


def random_edit(rng: random.Random, text: list[int], suggestion: list[int], vocab: int
                ) -> list[int]:
    """The field's next text."""
    kind = rng.choice(["type", "backspace", "accept", "retype", "again"])
    if kind == "type":
        return text + [rng.randrange(3, vocab) for _ in range(rng.randint(1, 3))]
    if kind == "backspace" and len(text) > 1:
        return text[:-rng.randint(1, min(3, len(text) - 1))]
    if kind == "accept" and suggestion:
        return text + suggestion[:rng.randint(1, len(suggestion))]
    if kind == "retype" and len(text) > 2:
        cut = rng.randint(1, len(text) - 1)
        return text[:cut] + [rng.randrange(3, vocab) for _ in range(rng.randint(1, 3))]
    return list(text)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.mark.parametrize("block", range(4))
def test_greedy_after_random_edits_equals_a_fresh_session(runner, target, block):
    """GREEDY_SEQUENCES random edit sequences (4 blocks), 1-4 edits each: every suggestion
    after an edit is token for token the greedy continuation a fresh session gives over the
    edited text, and the edit's round feeds only what follows the cached kept tokens."""
    vocab, engine = target.vocab_size, runner.engine
    per_block = GREEDY_SEQUENCES // 4
    checked = 0
    for seq in range(block * per_block, (block + 1) * per_block):
        rng = random.Random(seq)
        reference: dict = {}
        drafts = random_drafts(rng, vocab, reference)
        text = [1] + [rng.randrange(3, vocab) for _ in range(rng.randint(1, 10))]
        n = rng.randint(2, 4)
        reference[tuple(text)] = fresh_greedy(runner, text, 4)[:n]
        session = open_session(runner, text, n)
        suggestion = run_suggestion(runner, session, drafts)
        assert suggestion == reference[tuple(text)]
        for number in range(1, rng.randint(2, 5)):
            text = random_edit(rng, text, suggestion, vocab)
            n = rng.randint(1, 4)
            if len(reference.get(tuple(text), ())) < n:
                reference[tuple(text)] = fresh_greedy(runner, text, n)
            want = reference[tuple(text)][:n]
            keep = common_prefix(session.committed, text)
            cached = session.cache_len
            runner.apply_edit(session, EditParams(keep, text[keep:], number, n))
            # Explicit rollback: the cache keeps the kept tokens it had, never the last one.
            assert session.cache_len == min(cached, keep, len(text) - 1)
            assert session.committed == text and session.num_generated == 0
            first = drafts(session)
            with FedCounter(engine) as counter:
                engine.run_round(session, first)
            assert counter.fed == [len(text) - min(cached, keep, len(text) - 1)
                                   + len(first.tokens)]
            suggestion = session.committed[len(text):] + run_suggestion(runner, session, drafts)
            assert suggestion == want, f"sequence {seq}, edit {number}"
            checked += 1
        runner.close(session)
    assert checked >= per_block  # every sequence made at least one edit


def test_kv_after_an_edit_is_a_fresh_forwards_cache(runner, target):
    """The rolled-back cache holds exactly the keys and values of the kept tokens."""
    from test_engine import assert_same_cache, fresh_cache

    session = open_session(runner, [1, 17, 42, 5, 63, 8], 6)
    run_suggestion(runner, session, lambda s: DraftRound([9, 10], None))
    runner.apply_edit(session, EditParams(4, [70, 71], 1, 3))
    assert session.cache_len == 4
    assert_same_cache(session.kv, fresh_cache(target.model, session.committed[:4]))
    run_suggestion(runner, session, lambda s: DraftRound([9], None))
    assert_same_cache(session.kv, fresh_cache(target.model, session.committed[:-1]))


def test_sampled_edits_commit_what_a_fresh_session_commits(runner, target):
    """Seeded sampling: with the same seed and drafts, the suggestion after random edits is
    exactly the one a fresh session over the edited text commits (the verifier's randomness
    depends on (seed, position) only), over 60 sequences of 1-3 edits."""
    vocab = target.vocab_size
    sampling = SamplingParams(temperature=1.0, top_k=8)
    for seq in range(60):
        rng = random.Random(1000 + seq)
        params = SamplingParams(sampling.temperature, sampling.top_k, 1.0, seed=seq)
        text = [1] + [rng.randrange(3, vocab) for _ in range(rng.randint(1, 8))]
        session = open_session(runner, text, 3, params)
        suggestion = run_suggestion(runner, session, lambda s: DraftRound([], None))
        for number in range(1, rng.randint(2, 4)):
            text = random_edit(rng, text, suggestion, vocab)
            n = rng.randint(1, 4)
            tokens = [rng.randrange(3, vocab) for _ in range(rng.randint(0, 3))]
            q = [([t, (t + 1) % vocab], [0.6, 0.4]) for t in tokens]
            draft = DraftRound(tokens, q)
            keep = common_prefix(session.committed, text)
            runner.apply_edit(session, EditParams(keep, text[keep:], number, n))
            suggestion = run_suggestion(runner, session, lambda s, d=draft: d if
                                        s.num_generated == 0 else DraftRound([], None))
            fresh = open_session(runner, text, n, params, editable=False)
            want = run_suggestion(runner, fresh, lambda s, d=draft: d if
                                  s.num_generated == 0 else DraftRound([], None))
            runner.close(fresh)
            assert suggestion == want, f"sequence {seq}, edit {number}"
        runner.close(session)


def test_sampled_token_after_an_edit_follows_the_target(runner, target):
    """The law itself: n = 1000 sessions (seeds 0..999) at temperature 1, top-k 6, each
    opened over one text, rolled back by an edit to another, then one round with a sampled
    draft d ~ q. The first token after the edit against p over the edited text: per token
    |count - n p| <= 6 sqrt(n p (1 - p)) + 5, and a token with p = 0 never appears."""
    n, vocab = 1000, target.vocab_size
    before, after = [1, 17, 42, 5, 63, 8], [1, 17, 42, 30, 31]
    keep = common_prefix(before, after)
    q_ids, q_probs = [11, 12, 13, 14], [0.4, 0.3, 0.2, 0.1]
    draws = np.random.default_rng(0).choice(q_ids, size=n, p=q_probs)
    counts = np.zeros(vocab)
    for seed in range(n):
        session = open_session(runner, before, 2, SamplingParams(1.0, 6, 1.0, seed))
        runner.engine.run_round(session, DraftRound([], None))
        runner.apply_edit(session, EditParams(keep, after[keep:], 1, 1))
        runner.engine.run_round(session, DraftRound([int(draws[seed])],
                                                    [(q_ids, q_probs)]))
        counts[session.committed[len(after)]] += 1
        runner.close(session)
    with torch.no_grad():
        p = target_probs(target.model(torch.tensor([after])).logits[0, -1:],
                         SamplingParams(1.0, 6))[0].numpy().astype(np.float64)
    assert counts[p == 0].sum() == 0
    bound = 6 * np.sqrt(n * p * (1 - p)) + 5
    assert np.max(np.abs(counts - n * p) - bound) <= 0
    # Power: the law of the text before the edit (a missed rollback) would fail.
    with torch.no_grad():
        stale = target_probs(target.model(torch.tensor([before])).logits[0, -1:],
                             SamplingParams(1.0, 6))[0].numpy().astype(np.float64)
    assert np.max(np.abs(n * stale - n * p) - bound) > 0


def test_edits_are_checked_against_the_session(runner):
    session = open_session(runner, [1, 17, 42], 2)
    run_suggestion(runner, session, lambda s: DraftRound([], None))
    with pytest.raises(InvalidRequest, match="keep_length"):
        runner.apply_edit(session, EditParams(len(session.committed) + 1, [5], 1, 2))
    runner.apply_edit(session, EditParams(2, [5], 1, 2))
    with pytest.raises(RoundOutOfOrder, match="suggestion 1"):
        runner.apply_edit(session, EditParams(2, [5], 1, 2))
    plain = open_session(runner, [1, 17, 42], 2, editable=False)
    with pytest.raises(RoundOutOfOrder, match="not opened editable"):
        runner.apply_edit(plain, EditParams(2, [5], 1, 2))
    for s in (session, plain):
        runner.close(s)


def test_draft_cache_follows_the_edits(tiny_llama_pair):
    """Explicit draft-cache resync: after random edits the draft proposes what a fresh
    draft over the edited text proposes, and feeds only the tokens after the shared prefix."""
    from edge_client.draft_model import OnnxDraftModel
    from edge_client.drafter import DraftSampling, ModelDrafter

    model = OnnxDraftModel(tiny_llama_pair.draft_dir)
    drafter = ModelDrafter(model, DraftSampling(), np.random.default_rng(0))
    rng = random.Random(7)
    text = [1, 17, 42, 5, 63, 8]
    suggestion: list[int] = []
    for _ in range(40):
        text = random_edit(rng, text, suggestion, model.vocab_size)
        cached = list(drafter._fed)
        fed_before = len(drafter._fed)
        kept = drafter.resync(text)
        assert kept == min(common_prefix(cached, text), len(text) - 1)
        assert drafter.cache.length == kept
        proposal = drafter.propose(text, 3)
        fresh = ModelDrafter(model, DraftSampling(), np.random.default_rng(0))
        assert proposal.tokens == fresh.propose(text, 3).tokens
        # Fed: the text after the kept prefix, then d_1 and d_2 (d_3 is never fed).
        assert len(drafter._fed) == len(text) + 2
        assert fed_before >= kept
        suggestion = proposal.tokens
