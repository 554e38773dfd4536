"""Token healing on the verifier (Session.continue_with): the new tokens spell the given bytes
first, greedy exactly as the target's masked argmax and sampled with the masked,
renormalised distribution; the client state checks what it is sent; bad requests are refused.

The tiny target's tokenizer is word-level (no spelling), so these tests give its 96 ids a
byte spelling of their own: every string of 1-3 letters over "abc" and 54 of length 4."""

from __future__ import annotations

import itertools
from dataclasses import replace

import numpy as np
import pytest
import torch

from cloud_verifier.engine import VerifierEngine
from cloud_verifier.errors import InvalidRequest
from cloud_verifier.sampling import SamplingParams, target_probs
from cloud_verifier.sessions import SessionStore
from cloud_verifier.target_engine import DraftRound
from cloud_verifier.wire import Limits, parse_edit, parse_open
from shared.pb import verifier_pb2 as pb
from shared.token_spelling import MAX_CONTINUE_WITH, TokenSpelling

PROMPT = [1, 17, 42, 5, 63, 8]


def toy_spelling(vocab: int = 96) -> TokenSpelling:
    words = [("".join(w)).encode() for n in (1, 2, 3, 4)
             for w in itertools.product("abc", repeat=n)]
    return TokenSpelling([None, None, None] + words[:vocab - 3])


SPELLING = toy_spelling()


def masked_reference(model, prompt: list[int], rest: bytes, n: int,
                     spelling: TokenSpelling = SPELLING) -> list[int]:
    """The target's greedy tokens, one plain forward each, with the mask applied by hand."""
    ids = list(prompt)
    for _ in range(n):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1].clone()
        if rest:
            allowed = torch.from_numpy(spelling.allowed(rest))
            keep = logits[allowed]
            logits[:] = float("-inf")
            logits[allowed] = keep
        token = int(logits.argmax())
        rest = spelling.advance(rest, token) if rest else b""
        ids.append(token)
    return ids[len(prompt):]


@pytest.mark.parametrize("rest", [b"abcab", b"c", b"bbbcc"])
def test_greedy_rounds_commit_the_masked_argmax(target, rest):
    """Random drafts (some spell the rest, most do not) and K = 0 steps: the committed tokens
    are the masked argmax path, and they spell the rest."""
    engine = VerifierEngine(target.model, target.vocab_size, target.max_context,
                            spelling=SPELLING)
    want = masked_reference(target.model, PROMPT, rest, 12)
    session = SessionStore(1, 60).create("me", SamplingParams(), PROMPT, 12, frozenset())
    session.continue_with = rest
    gen = torch.Generator().manual_seed(0)
    round_no = 0
    while not session.finished:
        done = len(session.committed) - len(PROMPT)
        k = round_no % 4
        drafts = torch.randint(3, target.vocab_size, (k,), generator=gen).tolist()
        if round_no % 2:  # half the rounds draft the right tokens for a while
            drafts = want[done:done + k]
        engine.run_round(session, DraftRound(drafts, None))
        round_no += 1
    got = session.committed[len(PROMPT):]
    assert got == want
    assert SPELLING.spell(got).startswith(rest) and session.continue_with == b""


def test_sampled_first_token_follows_the_masked_distribution(target):
    """2,000 sessions, one K = 1 round each with a draft from a uniform q over the allowed
    tokens: the first committed token's frequencies match p restricted to the tokens that
    complete "a" and renormalised, within 5 sigma + 0.01 per token; none outside."""
    rest = b"a"
    params = SamplingParams(temperature=1.0, seed=0)
    engine = VerifierEngine(target.model, target.vocab_size, target.max_context,
                            spelling=SPELLING)
    with torch.no_grad():
        logits = target.model(input_ids=torch.tensor([PROMPT])).logits[0, -1]
    allowed = SPELLING.allowed(rest)
    masked = torch.full_like(logits, float("-inf"))
    masked[allowed] = logits[allowed]
    p = target_probs(masked[None], params)[0].double().numpy()
    n = 2000
    store = SessionStore(n, 60)
    counts = np.zeros(target.vocab_size)
    q_ids = allowed.tolist()
    q = [(q_ids, [1.0 / len(q_ids)] * len(q_ids))]
    rng = np.random.default_rng(1)
    for i in range(n):
        session = store.create(str(i), replace(params, seed=i), PROMPT, 1, frozenset())
        session.continue_with = rest
        draft = int(rng.choice(q_ids))
        outcome = engine.run_round(session, DraftRound([draft], q))
        counts[outcome.committed[0]] += 1
        store.close(session.id)
    freq = counts / n
    assert counts[np.setdiff1d(np.arange(target.vocab_size), allowed)].sum() == 0
    bound = 5 * np.sqrt(p * (1 - p) / n) + 0.01
    assert np.all(np.abs(freq - p) <= bound), np.abs(freq - p).max()


def test_the_state_refuses_a_step_that_does_not_spell_the_rest():
    from edge_client.drafter import Proposal
    from edge_client.generation_state import (
        GenerationState,
        ProtocolError,
        ServerLimits,
        SessionParams,
    )

    state = GenerationState(PROMPT, SessionParams(max_new_tokens=8), ServerLimits(96, 4, 128),
                            4, spelling=SPELLING, continue_with=b"ab")
    assert state.open_message(Proposal([], None)).open.continue_with == b"ab"
    bad = SPELLING._exact[b"b"][0]
    step = pb.Step(round=0, token_ids=[bad], num_drafted=0, num_accepted=0,
                   committed_length=len(PROMPT) + 1)
    with pytest.raises(ProtocolError, match="spell"):
        state.apply(step, Proposal([], None))
    good = SPELLING._exact[b"a"][0]  # spells a part: "b" is left
    assert SPELLING.allowed(b"ab").size and state.spell() == (SPELLING, b"ab")
    step.token_ids[:] = [SPELLING._exact[b"ab"][0]]
    state.apply(step, Proposal([], None))
    assert state.continue_with == b"" and state.spell() is None and good != bad


def test_spellable_cuts_drafts_at_the_first_that_cannot_spell():
    from edge_client.drafter import Proposal
    from edge_client.generation_state import GenerationState, ServerLimits, SessionParams

    state = GenerationState(PROMPT, SessionParams(max_new_tokens=8), ServerLimits(96, 4, 128),
                            4, spelling=SPELLING, continue_with=b"ccab")
    # No token starts with "ccab" (none of length 4 starts with "c"): parts spell it.
    cca, c, b = (SPELLING._exact[w][0] for w in (b"cca", b"c", b"b"))
    assert state.spellable(Proposal([cca, b, c], None)).tokens == [cca, b, c]
    assert state.spellable(Proposal([cca, c], None)).tokens == [cca]
    assert state.spellable(Proposal([b, cca], None)).tokens == []


def open_msg(**kw) -> pb.OpenSession:
    return pb.OpenSession(prompt_token_ids=PROMPT, drafting=pb.DRAFTING_ROUNDS, **kw)


def test_requests_with_continue_with_are_checked():
    limits = Limits(96, 4, 128, spelling=SPELLING)
    eos = frozenset({2})
    assert parse_open(open_msg(continue_with=b"abc"), limits, eos).continue_with == b"abc"
    assert parse_open(open_msg(), limits, eos).continue_with == b""
    with pytest.raises(InvalidRequest, match="max_continue_with"):
        parse_open(open_msg(continue_with=b"a" * (MAX_CONTINUE_WITH + 1)), limits, eos)
    with pytest.raises(InvalidRequest, match="no token"):
        parse_open(open_msg(continue_with=b"xyz"), limits, eos)
    with pytest.raises(InvalidRequest, match="DRAFTING_ROUNDS"):
        parse_open(pb.OpenSession(prompt_token_ids=PROMPT, drafting=pb.DRAFTING_LOOKAHEAD,
                                  continue_with=b"a"), limits, eos)
    with pytest.raises(InvalidRequest, match="does not spell") as err:
        parse_open(open_msg(continue_with=b"a"), Limits(96, 4, 128), eos)
    assert err.value.metadata["field"] == "open.continue_with"
    edit = parse_edit(pb.Edit(keep_length=3, suggestion=1, continue_with=b"ca"), limits)
    assert edit.continue_with == b"ca"
    with pytest.raises(InvalidRequest) as err:
        parse_edit(pb.Edit(keep_length=3, suggestion=1, continue_with=b"q"), limits)
    assert err.value.metadata["field"] == "verify.edit.continue_with"
