"""Lookahead mode of the Session stream: which drafts a forward takes (pure), that the
stream's output is the target's (greedy over real gRPC; sampling as a law, simulated), its
half-close and cancel, and its bad-input statuses."""

from __future__ import annotations

import time

import grpc
import numpy as np
import pytest
import torch
from stream_helpers import (
    LOOKAHEAD,
    PROMPT,
    SessionCall,
    decode_message,
    lookahead_message,
    open_message,
    reference_greedy,
    stream_error,
    verify_message,
)

from cloud_verifier.config import VerifierConfig
from cloud_verifier.lookahead import Lookahead, fresh_drafts
from cloud_verifier.server import EmbeddedVerifier
from cloud_verifier.target_engine import NO_DRAFT, DraftRound
from cloud_verifier.verification import verify
from shared import errors
from shared.draft_length import worth_verifying
from shared.pb import verifier_pb2 as pb
from shared.pb import verifier_pb2_grpc as pb_grpc

INVALID = grpc.StatusCode.INVALID_ARGUMENT
PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION

# -- which drafts a forward takes ---------------------------------------------------------------

Q = [([5, 6], [0.6, 0.4]), ([7], [1.0]), ([8, 9], [0.5, 0.5]), ([1], [1.0])]


def test_fresh_drafts_take_what_continues_the_committed_text():
    look = Lookahead(3, DraftRound([5, 7, 8, 1], Q))
    # Nothing committed since the base: the drafts from the start, cut at k.
    assert fresh_drafts(look, [0, 0, 0], 2) == DraftRound([5, 7], Q[:2])
    # Two committed since, equal to the first two drafts: the rest, with their own q.
    assert fresh_drafts(look, [0, 0, 0, 5, 7], 8) == DraftRound([8, 1], Q[2:])
    assert fresh_drafts(look, [0, 0, 0, 5, 7], 1) == DraftRound([8], Q[2:3])
    point = Lookahead(3, DraftRound([5, 7, 8], None))
    assert fresh_drafts(point, [0, 0, 0, 5], 4) == DraftRound([7, 8], None)


@pytest.mark.parametrize("committed, k", [
    ([0, 0, 0, 5, 6], 4),  # the second committed token differs from the second draft: stale
    ([0, 0, 0, 6], 4),  # the first differs
    ([0, 0, 0, 5, 7, 8, 1], 4),  # every draft already committed: nothing left
    ([0, 0, 0, 5, 7, 8, 1, 4], 4),  # committed past the drafts
    ([0, 0, 0], 0),  # drafting does not pay right now
])
def test_stale_or_used_up_lookahead_gives_no_drafts(committed, k):
    assert fresh_drafts(Lookahead(3, DraftRound([5, 7, 8, 1], Q)), committed, k) is NO_DRAFT
    assert fresh_drafts(None, committed, 4) is NO_DRAFT


# -- sampling stays lossless: a simulated stream ------------------------------------------------
#
# Target and draft are Markov chains over V = 3 tokens (p and q depend on the previous token),
# so every law is exact. A "client" drafts lookaheads of 3 tokens by sampling q after the
# committed text it last saw, which lags the server's by 0 or 1 forwards at random (a
# lookahead that arrives in time, or one forward late); the "server" verifies what
# fresh_drafts takes (K <= 2) with cloud_verifier.verification.verify, or decodes one token.
# The first three generated tokens must follow the target's law: N = 8,000 streams, 27
# outcomes, each count within 5 sigma + 5 of N * p (a misaligned q, e.g. q of the wrong
# position, moves several bins by far more).

V = 3
P_CHAIN = np.array([[0.6, 0.3, 0.1], [0.2, 0.2, 0.6], [0.3, 0.5, 0.2]])
Q_CHAIN = np.array([[0.3, 0.4, 0.3], [0.1, 0.6, 0.3], [0.5, 0.25, 0.25]])
N_STREAMS = 8_000


def _simulate_stream(rng: np.random.Generator, gen: torch.Generator) -> tuple[int, ...]:
    committed = [0]
    seen = [0]  # what the client knew when it drafted the latest lookahead
    latest = None
    while len(committed) < 4:
        if latest is None or rng.random() < 0.6:  # a new lookahead arrives in time
            seen = list(committed) if rng.random() < 0.5 else list(seen)
            tokens, q, confidence = [], [], []
            prev = seen[-1]
            for _ in range(3):
                t = int(rng.choice(V, p=Q_CHAIN[prev]))
                tokens.append(t)
                q.append((list(range(V)), Q_CHAIN[prev].tolist()))
                confidence.append(float(Q_CHAIN[prev].max()))  # of q_i, not of d_i
                prev = t
            latest = Lookahead(len(seen), DraftRound(tokens, q, confidence))
        draft = fresh_drafts(latest, committed, 2)
        if draft.confidence is not None:  # the server's cut, from the draft's own q(d)
            draft = draft.window(0, worth_verifying(draft.confidence, 0.25))
        rows, prev = [], committed[-1]
        for t in draft.tokens + [None]:
            rows.append(P_CHAIN[prev])
            prev = t
        p = torch.tensor(np.array(rows))
        qd = torch.tensor(np.array([probs for _, probs in draft.q])) if draft.q else None
        n, nxt = verify(draft.tokens, qd, p, gen)
        committed += draft.tokens[:n] + [nxt]
        seen = seen if len(seen) <= len(committed) else committed[:]
    return tuple(committed[1:4])


def test_lookahead_stream_keeps_sampling_lossless():
    """8,000 simulated streams with random staleness, lookaheads cut by their confidences
    (q_i's largest probability: a cut by q_i(d_i), which depends on the drawn d_i itself,
    fails this test); every count of the 27 three-token outputs within 5 sigma (+5) of the
    target's law."""
    rng = np.random.default_rng(7)
    gen = torch.Generator().manual_seed(7)
    counts = np.zeros((V, V, V), dtype=np.int64)
    for _ in range(N_STREAMS):
        counts[_simulate_stream(rng, gen)] += 1
    law = np.einsum("a,ab,bc->abc", P_CHAIN[0], P_CHAIN, P_CHAIN)
    expected = N_STREAMS * law
    bound = 5 * np.sqrt(expected * (1 - law)) + 5
    assert np.all(np.abs(counts - expected) <= bound), (counts, expected.round())


# -- over real gRPC, tiny random target --------------------------------------------------------


def opening(max_new_tokens: int, first_draft: list[int] | None = None) -> pb.SessionRequest:
    return open_message(drafting=LOOKAHEAD, first=first_draft, max_new_tokens=max_new_tokens)


@pytest.fixture()
def verifier(target):
    with EmbeddedVerifier(target, VerifierConfig(port=0, max_draft_len=8, max_sessions=2,
                                                 session_ttl_s=30)) as v:
        yield v


@pytest.fixture()
def stub(verifier):
    with grpc.insecure_channel(verifier.address) as channel:
        yield pb_grpc.VerifierServiceStub(channel)


def lookahead_forwards(verifier) -> dict[str, float]:
    counter = verifier.server.metrics.lookahead_forwards
    return {kind: counter.labels(kind)._value.get()
            for kind in ("fresh", "stale", "none", "unsure")}


def live_sessions(verifier) -> int:
    async def count() -> int:
        return len(verifier.server.service.store)
    return verifier.call(count())


def to_the_end(call: SessionCall, answer=None, steps=()) -> list[pb.Step]:
    """Reads Steps (after ``steps``, already read) until the finishing one, calling
    ``answer(steps so far)`` after each earlier one, then half-closes; the stream must end
    OK with nothing more."""
    steps = list(steps)
    while not steps or not steps[-1].finished:
        steps.append(call.step())
        if answer is not None and not steps[-1].finished:
            answer(steps)
    call.close()
    assert call.rest() == [] and call.call.code() == grpc.StatusCode.OK
    return steps


def test_greedy_lookahead_stream_is_plain_greedy_decoding(stub, target):
    """The client answers every step with a lookahead of the next 6 greedy tokens after
    what it has; whether a lookahead arrives in time or not, the text is the target's."""
    n = 30
    want = reference_greedy(target, PROMPT, n + 8)
    call = SessionCall(stub, opening(n, first_draft=want[:4]))
    first = call.reply()
    assert len(first.session_id) == 32  # on the first reply only

    def answer(steps):
        done = sum(len(s.token_ids) for s in steps)
        call.send(lookahead_message(len(PROMPT) + done, want[done:done + 6]))

    answer([first.step])
    steps = to_the_end(call, answer, [first.step])
    assert [t for s in steps for t in s.token_ids] == want[:n]
    assert [s.round for s in steps] == list(range(len(steps)))
    assert all(s.committed_length == len(PROMPT) + sum(len(t.token_ids) for t in steps[:i + 1])
               for i, s in enumerate(steps))
    assert all(s.num_accepted <= s.num_drafted and s.timing.forward_ns > 0 for s in steps)
    assert steps[-1].finished and not any(s.finished for s in steps[:-1])
    # Forward 0 takes the open's first draft: all 4 right, plus the bonus token.
    assert (steps[0].num_drafted, steps[0].num_accepted, len(steps[0].token_ids)) == (4, 4, 5)
    # Every verified lookahead token was right, so each was accepted.
    assert all(s.num_accepted == s.num_drafted for s in steps)
    assert len(steps) < n  # fewer forwards than tokens


@pytest.mark.parametrize("sure", [True, False])
def test_lookaheads_are_cut_by_their_confidences(verifier, stub, target, sure):
    """Right lookaheads of 6 tokens: sure ones (confidence 1) are verified up to what is
    fresh, whatever the suggested draft length; hopeless ones (confidence 0) are never
    verified. Either way the text is the target's."""
    n = 24
    want = reference_greedy(target, PROMPT, n + 8)
    call = SessionCall(stub, opening(n))

    def answer(steps):
        done = sum(len(s.token_ids) for s in steps)
        call.send(lookahead_message(len(PROMPT) + done, want[done:done + 6],
                                    [1.0 if sure else 0.0] * 6))

    steps = to_the_end(call, answer)
    assert [t for s in steps for t in s.token_ids] == want[:n]
    assert all(s.HasField("draft_token_cost") for s in steps)
    seen = lookahead_forwards(verifier)
    if sure:
        assert all(s.num_accepted == s.num_drafted for s in steps)
        assert max(s.num_drafted for s in steps) >= 5 and len(steps) < n / 2
    else:
        assert all(s.num_drafted == 0 for s in steps) and len(steps) == n
        assert seen["unsure"] > 0 and seen["fresh"] == 0


def test_a_stale_lookahead_is_not_verified_and_output_is_unchanged(verifier, stub, target):
    """The first draft is right then wrong: forward 0 accepts 1 and corrects the second; the
    lookahead (that first draft) no longer continues the text, so no later forward uses
    it."""
    want = reference_greedy(target, PROMPT, 8)
    wrong = (want[1] + 1) % target.vocab_size
    steps = to_the_end(SessionCall(stub, opening(8, first_draft=[want[0], wrong, 3])))
    assert (steps[0].num_drafted, steps[0].num_accepted) == (3, 1)
    assert [s.num_drafted for s in steps[1:]] == [0] * (len(steps) - 1)
    assert [t for s in steps for t in s.token_ids] == want
    # The metric tells fresh from stale (or none, where drafting did not pay).
    seen = lookahead_forwards(verifier)
    assert seen["fresh"] == 1 and seen["stale"] + seen["none"] == len(steps) - 1


def test_a_lookahead_sent_early_serves_once_the_text_catches_up(stub, target):
    """A lookahead of 8 right tokens from the prompt, sent with the open: whatever forwards
    ran before it arrived, the later ones verify the part still ahead of the committed
    text."""
    want = reference_greedy(target, PROMPT, 12)
    steps = to_the_end(SessionCall(stub, opening(12, first_draft=want[:1]),
                                   lookahead_message(len(PROMPT), want[:8])))
    assert [t for s in steps for t in s.token_ids] == want
    assert sum(s.num_drafted for s in steps[1:]) > 0
    assert all(s.num_accepted == s.num_drafted for s in steps)


@pytest.mark.parametrize("messages, code, reason", [
    ([], INVALID, errors.INVALID_ARGUMENT),  # nothing at all
    ([lookahead_message(len(PROMPT), [5])], INVALID, errors.INVALID_ARGUMENT),  # no open
    ([opening(40), opening(40)], PRECONDITION, errors.OUT_OF_ORDER),  # a second open
    ([opening(40), verify_message(1, [5])], PRECONDITION, errors.OUT_OF_ORDER),
    ([opening(40), decode_message(1, 4)], PRECONDITION, errors.OUT_OF_ORDER),
    ([opening(40), lookahead_message(len(PROMPT) - 1, [5])], INVALID, errors.INVALID_ARGUMENT),
    ([opening(40), lookahead_message(len(PROMPT) + 50, [5])], INVALID,
     errors.INVALID_ARGUMENT),
    ([opening(40), lookahead_message(len(PROMPT), [10_000])], INVALID,
     errors.INVALID_ARGUMENT),
    ([opening(40), lookahead_message(len(PROMPT), list(range(3, 12)))],  # 9 > max_draft_len
     INVALID, errors.INVALID_ARGUMENT),
], ids=["nothing", "no-open", "second-open", "verify", "decode", "base-low", "base-high",
        "token", "too-long"])
def test_bad_lookahead_streams_end_with_a_status_and_free_the_session(verifier, stub, target,
                                                                       messages, code, reason):
    err = stream_error(stub, *messages, half_close=not messages)
    assert (err.code, err.reason) == (code, reason)
    if reason == errors.INVALID_ARGUMENT and messages and messages[0].HasField("open"):
        assert err.metadata["field"].startswith("lookahead.")
    deadline = time.monotonic() + 5
    while live_sessions(verifier):  # closed after the forward it may have had in flight
        assert time.monotonic() < deadline
        time.sleep(0.02)
    # Both session slots (max_sessions 2) are free, and the server serves on.
    want = reference_greedy(target, PROMPT, 4)
    calls = [SessionCall(stub, opening(4)) for _ in range(2)]
    outs = [to_the_end(call) for call in calls]
    assert all([t for s in out for t in s.token_ids] == want for out in outs)


def test_half_closing_stops_the_generation_and_closes_the_session(verifier, stub):
    """A half-close before the finish is how a lookahead client stops early: the stream ends
    OK, and the session is closed by then."""
    call = SessionCall(stub, opening(0))  # 0: until the context is full
    assert [call.step().round for _ in range(3)] == [0, 1, 2]
    call.close()
    rest = call.rest()
    assert call.call.code() == grpc.StatusCode.OK
    assert not any(r.step.finished for r in rest) and len(rest) < 20  # of about 120
    assert live_sessions(verifier) == 0
    assert verifier.server.metrics.active_sessions._value.get() == 0


def test_cancelling_the_stream_closes_the_session(verifier, stub, target):
    call = SessionCall(stub, opening(0))
    call.step(), call.step()
    assert live_sessions(verifier) == 1
    call.cancel()
    deadline = time.monotonic() + 5
    while live_sessions(verifier):
        assert time.monotonic() < deadline, "the cancelled stream's session stayed open"
        time.sleep(0.02)
    # Both slots are free again.
    calls = [SessionCall(stub, opening(2)) for _ in range(2)]
    assert all(len(to_the_end(c)) >= 1 for c in calls)


def test_the_stream_outlives_its_last_step_until_the_client_ends_it(stub, target):
    """A late lookahead (written as the last step goes out) meets an RPC that is still open
    and is ignored: the server ends the stream only when the client half-closes."""
    want = reference_greedy(target, PROMPT, 3)
    call = SessionCall(stub, opening(3))
    got = []
    while not (step := call.step()).finished:
        got += step.token_ids
    got += step.token_ids
    call.send(lookahead_message(len(PROMPT) + len(got), [5, 6]))  # late
    time.sleep(0.3)
    assert not call.call.done()
    call.close()
    assert call.rest() == [] and call.call.code() == grpc.StatusCode.OK and got == want


def test_grpc_aio_clients_writing_to_the_end_get_every_step(verifier, target):
    """grpc.aio turns a client write that meets an ended RPC into INTERNAL, losing the
    stream's last step (grpc/grpc#36066). A client that answers every step with a lookahead,
    the last one included, gets all steps and status OK: 12 streams of 4 tokens."""
    import asyncio

    want = reference_greedy(target, PROMPT, 4)

    async def one(stub) -> list[int]:
        call = stub.Session()
        await call.write(opening(4))
        got: list[int] = []
        while (reply := await call.read()) is not grpc.aio.EOF:
            got += reply.step.token_ids
            await call.write(lookahead_message(len(PROMPT) + len(got), [5, 6]))
            if reply.step.finished:
                await call.done_writing()
        assert await call.code() == grpc.StatusCode.OK
        return got

    async def main() -> list[list[int]]:
        async with grpc.aio.insecure_channel(verifier.address) as channel:
            stub = pb_grpc.VerifierServiceStub(channel)
            return [await one(stub) for _ in range(12)]

    assert asyncio.run(main()) == [want] * 12
