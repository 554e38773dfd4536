"""The verifier over real gRPC on a loopback port, with tiny random models.

Covers the protocol (info, open with first draft, verify, close, stream), KV-cache rollback
through rejections, idempotent retries, ownership, health, and one test per bad-input row.
"""

from __future__ import annotations

import time

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cloud_verifier.config import VerifierConfig, key_digest
from cloud_verifier.draft_policy import PROBE_EVERY
from cloud_verifier.server import EmbeddedVerifier
from shared.pb import verifier_pb2 as pb
from shared.pb import verifier_pb2_grpc as pb_grpc

PROMPT = [1, 17, 42, 5, 63, 8]
GREEDY = pb.SamplingParams(temperature=0.0)


def reference_greedy(target, prompt: list[int], n: int) -> list[int]:
    """Plain greedy decoding, one full forward per token (no cache)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits = target.model(torch.tensor([ids])).logits[0, -1]
            ids.append(int(torch.argmax(logits)))
    return ids[len(prompt):]


@pytest.fixture()
def server(target):
    with EmbeddedVerifier(target, VerifierConfig(port=0, max_draft_len=8, max_sessions=4,
                                                 session_ttl_s=30)) as v:
        yield v


@pytest.fixture()
def stub(server):
    with grpc.insecure_channel(server.address) as channel:
        yield pb_grpc.VerifierStub(channel)


def code_of(call, *args, **kwargs) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        call(*args, **kwargs)
    assert info.value.details(), "every error carries a message"
    return info.value.code()


def open_session(stub, prompt=PROMPT, sampling=GREEDY, **kwargs) -> pb.OpenSessionResponse:
    return stub.OpenSession(pb.OpenSessionRequest(prompt_token_ids=prompt, sampling=sampling,
                                                  ignore_eos=True, **kwargs))


def test_info_advertises_model_and_limits(stub, target):
    info = stub.GetInfo(pb.GetInfoRequest())
    assert info.protocol_version == "edgespec.v1"
    assert info.vocab_size == target.vocab_size
    assert info.tokenizer_fingerprint == target.tokenizer_fingerprint
    assert info.tokenizer_fingerprint.startswith("sha256:")
    assert info.max_draft_len == 8
    assert info.max_context == target.max_context
    assert set(info.modes) == {"greedy", "sampling"}


def test_greedy_rounds_reproduce_plain_decoding_through_rejections(stub, target):
    """Drafts alternate between right and wrong tokens, so the cache is rolled back on most
    rounds; the committed text must still be plain greedy decoding."""
    want = reference_greedy(target, PROMPT, 40)
    first = pb.Draft(token_ids=want[:3])  # all right: 3 accepted + bonus
    opened = open_session(stub, first_draft=first)
    assert opened.first_round.num_accepted == 3
    assert opened.first_round.next_token == want[3]
    assert opened.first_round.target_forwards == 1
    got = want[:4]
    round_no = 1
    while len(got) < 24:
        # Two right drafts, then a wrong one (rejected), then one that is never judged.
        right = want[len(got):len(got) + 2]
        wrong = (want[len(got) + 2] + 1) % target.vocab_size
        draft = right + [wrong, 7]
        # Confidences (odd rounds) only inform the cut, never the verdict.
        confidence = [0.9, 0.8, 0.3, 0.1] if round_no % 2 else []
        reply = stub.Verify(pb.VerifyRequest(
            session_id=opened.session_id, round=round_no,
            draft=pb.Draft(token_ids=draft, confidence=confidence))).result
        assert reply.num_accepted == 2
        assert reply.HasField("draft_token_cost") and reply.draft_token_cost >= 0
        assert reply.next_token == want[len(got) + 2]
        got += right + [reply.next_token]
        assert reply.committed_length == len(PROMPT) + len(got)
        round_no += 1
    assert got == want[:len(got)]


def test_k0_round_is_a_plain_step(stub, target):
    opened = open_session(stub)
    assert not opened.HasField("first_round") and opened.committed_length == len(PROMPT)
    reply = stub.Verify(pb.VerifyRequest(session_id=opened.session_id, round=0,
                                         draft=pb.Draft())).result
    assert reply.num_accepted == 0
    assert reply.next_token == reference_greedy(target, PROMPT, 1)[0]


def test_session_ids_are_random_128_bit_hex(stub):
    ids = {open_session(stub).session_id for _ in range(4)}
    assert len(ids) == 4
    assert all(len(i) == 32 and int(i, 16) >= 0 for i in ids)


def test_retried_round_is_answered_once(stub, target):
    opened = open_session(stub)
    draft = pb.Draft(token_ids=[5, 6])
    req = pb.VerifyRequest(session_id=opened.session_id, round=0, draft=draft)
    first = stub.Verify(req).result
    again = stub.Verify(req).result
    assert (again.num_accepted, again.next_token, again.committed_length) == \
        (first.num_accepted, first.next_token, first.committed_length)
    assert first.target_forwards == 1 and again.target_forwards == 0
    # Same round number with a different draft is not a retry.
    other = pb.VerifyRequest(session_id=opened.session_id, round=0,
                             draft=pb.Draft(token_ids=[9]))
    assert code_of(stub.Verify, other) == grpc.StatusCode.FAILED_PRECONDITION


def test_max_new_tokens_finishes_and_closes_the_session(stub, target):
    want = reference_greedy(target, PROMPT, 8)
    opened = open_session(stub, max_new_tokens=3, first_draft=pb.Draft(token_ids=want[:5]))
    result = opened.first_round
    assert result.finished and result.committed_length == len(PROMPT) + 3
    nxt = pb.VerifyRequest(session_id=opened.session_id, round=1, draft=pb.Draft())
    assert code_of(stub.Verify, nxt) == grpc.StatusCode.NOT_FOUND


def test_close_rides_on_verify(stub):
    opened = open_session(stub)
    stub.Verify(pb.VerifyRequest(session_id=opened.session_id, round=0, draft=pb.Draft(),
                                 close=True))
    nxt = pb.VerifyRequest(session_id=opened.session_id, round=1, draft=pb.Draft())
    assert code_of(stub.Verify, nxt) == grpc.StatusCode.NOT_FOUND


def test_stream_carries_a_whole_session(stub, target):
    want = reference_greedy(target, PROMPT, 6)
    requests = [
        pb.SessionRequest(open=pb.OpenSessionRequest(
            prompt_token_ids=PROMPT, sampling=GREEDY, ignore_eos=True,
            first_draft=pb.Draft(token_ids=want[:2]))),
        pb.SessionRequest(verify=pb.VerifyRequest(round=1, draft=pb.Draft(token_ids=want[3:5]))),
    ]
    replies = list(stub.Session(iter(requests)))
    assert replies[0].opened.first_round.num_accepted == 2
    assert replies[0].opened.first_round.next_token == want[2]
    assert replies[1].verified.result.num_accepted == 2
    assert replies[1].verified.result.next_token == want[5]


def test_health_and_reflection(server):
    with grpc.insecure_channel(server.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        status = health.Check(health_pb2.HealthCheckRequest(service="edgespec.v1.Verifier"))
        assert status.status == health_pb2.HealthCheckResponse.SERVING
        from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

        refl = reflection_pb2_grpc.ServerReflectionStub(channel)
        reply = next(refl.ServerReflectionInfo(iter([
            reflection_pb2.ServerReflectionRequest(list_services="")])))
        names = {s.name for s in reply.list_services_response.service}
        assert "edgespec.v1.Verifier" in names


# -- bad input: one test per row of the status table -----------------------------------------

def verify_code(stub, draft: pb.Draft, round_no: int = 0) -> grpc.StatusCode:
    opened = open_session(stub, sampling=pb.SamplingParams(temperature=1.0, seed=3))
    return code_of(stub.Verify, pb.VerifyRequest(session_id=opened.session_id,
                                                 round=round_no, draft=draft))


def q(ids, probs):
    return pb.SparseDistribution(token_ids=ids, probs=probs)


@pytest.mark.parametrize("draft", [
    pb.Draft(token_ids=[96]),  # token id == V
    pb.Draft(token_ids=[5], q=[q([5, 200], [0.5, 0.5])]),  # q id out of range
    pb.Draft(token_ids=[5], q=[q([5, 6], [1.2, -0.2])]),  # negative / above one
    pb.Draft(token_ids=[5], q=[q([5, 6], [float("nan"), 0.5])]),  # NaN
    pb.Draft(token_ids=[5], q=[q([5, 6], [0.6, 0.41])]),  # sums past 1 + 1e-3
    pb.Draft(token_ids=[5], q=[q([6, 7], [0.5, 0.5])]),  # drafted token missing from q
    pb.Draft(token_ids=[5], q=[q([5, 6], [0.0, 1.0])]),  # drafted token with q = 0
    pb.Draft(token_ids=[5, 6], q=[q([5], [1.0])]),  # q count != K
    pb.Draft(token_ids=[5], q=[q([5, 5], [0.5, 0.5])]),  # duplicate ids
    pb.Draft(token_ids=list(range(3, 12))),  # K = 9 > max_draft_len 8
    pb.Draft(token_ids=[5, 6], confidence=[0.5]),  # confidence count != K
    pb.Draft(token_ids=[5], confidence=[1.5]),  # confidence above one
    pb.Draft(token_ids=[5], confidence=[-0.1]),  # negative confidence
    pb.Draft(token_ids=[5], confidence=[float("nan")]),  # NaN confidence
], ids=["token", "q-token", "negative", "nan", "sum", "missing", "zero-q", "q-count",
        "duplicate", "k-too-big", "confidence-count", "confidence-above-one",
        "confidence-negative", "confidence-nan"])
def test_invalid_drafts_are_invalid_argument(stub, draft):
    assert verify_code(stub, draft) == grpc.StatusCode.INVALID_ARGUMENT


def test_invalid_open_requests(stub):
    assert code_of(open_session, stub, prompt=[]) == grpc.StatusCode.INVALID_ARGUMENT
    assert code_of(open_session, stub, prompt=[1, 96]) == grpc.StatusCode.INVALID_ARGUMENT
    bad_t = pb.SamplingParams(temperature=float("nan"))
    assert code_of(open_session, stub, sampling=bad_t) == grpc.StatusCode.INVALID_ARGUMENT
    bad_p = pb.SamplingParams(temperature=1.0, top_p=1.5)
    assert code_of(open_session, stub, sampling=bad_p) == grpc.StatusCode.INVALID_ARGUMENT
    bad_id = pb.VerifyRequest(session_id="not-a-session", round=0)
    assert code_of(stub.Verify, bad_id) == grpc.StatusCode.INVALID_ARGUMENT


def test_context_past_maximum_is_out_of_range(stub, target):
    full = [5] * target.max_context
    assert code_of(open_session, stub, prompt=full) == grpc.StatusCode.OUT_OF_RANGE
    nearly = [5] * (target.max_context - 3)
    opened = open_session(stub, prompt=nearly)
    too_many = pb.VerifyRequest(session_id=opened.session_id, round=0,
                                draft=pb.Draft(token_ids=[5, 6, 7]))
    assert code_of(stub.Verify, too_many) == grpc.StatusCode.OUT_OF_RANGE
    fits = pb.VerifyRequest(session_id=opened.session_id, round=0,
                            draft=pb.Draft(token_ids=[5, 6]))
    assert stub.Verify(fits).result.committed_length <= target.max_context


def test_unknown_session_is_not_found(stub):
    unknown = pb.VerifyRequest(session_id="0" * 32, round=0)
    assert code_of(stub.Verify, unknown) == grpc.StatusCode.NOT_FOUND


def test_expired_session_is_not_found(target):
    config = VerifierConfig(port=0, session_ttl_s=0.2)
    with EmbeddedVerifier(target, config) as server, \
            grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.VerifierStub(channel)
        opened = open_session(stub)
        time.sleep(0.4)
        req = pb.VerifyRequest(session_id=opened.session_id, round=0)
        assert code_of(stub.Verify, req) == grpc.StatusCode.NOT_FOUND


def test_a_streaming_session_is_not_idle(target):
    """Generate never looks its session up by id; its rounds keep it in use, so a generation
    longer than the TTL is not expired halfway (the sweep runs every TTL / 4)."""
    config = VerifierConfig(port=0, session_ttl_s=0.1)
    with EmbeddedVerifier(target, config) as server, \
            grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.VerifierStub(channel)
        t0 = time.monotonic()
        replies = list(stub.Generate(pb.GenerateRequest(prompt_token_ids=PROMPT,
                                                        ignore_eos=True)))
        assert time.monotonic() - t0 > 0.2  # longer than the TTL
        assert replies[-1].finished


def test_round_out_of_order_is_failed_precondition(stub):
    opened = open_session(stub)
    skip = pb.VerifyRequest(session_id=opened.session_id, round=1, draft=pb.Draft())
    assert code_of(stub.Verify, skip) == grpc.StatusCode.FAILED_PRECONDITION


def test_too_many_sessions_is_resource_exhausted(stub):
    for _ in range(4):
        open_session(stub)
    assert code_of(open_session, stub) == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_draining_is_unavailable_but_running_sessions_finish(server, stub, target):
    from cloud_verifier.healthcheck import main as healthcheck

    want = reference_greedy(target, PROMPT, 2)
    opened = open_session(stub)
    assert healthcheck(["--address", server.address]) == 0
    server.call(server.server.begin_drain())
    assert healthcheck(["--address", server.address]) == 1  # NOT_SERVING
    assert code_of(open_session, stub) == grpc.StatusCode.UNAVAILABLE
    reply = stub.Verify(pb.VerifyRequest(session_id=opened.session_id, round=0,
                                         draft=pb.Draft(token_ids=want[:1]))).result
    assert (reply.num_accepted, reply.next_token) == (1, want[1])


def test_bad_requests_do_not_disturb_another_session(stub, target):
    want = reference_greedy(target, PROMPT, 6)
    good = open_session(stub, first_draft=pb.Draft(token_ids=want[:2]))
    for draft in (pb.Draft(token_ids=[500]), pb.Draft(token_ids=[5], q=[q([5], [2.0])])):
        verify_code(stub, draft)
    code_of(stub.Verify, pb.VerifyRequest(session_id=good.session_id, round=5))
    reply = stub.Verify(pb.VerifyRequest(session_id=good.session_id, round=1,
                                         draft=pb.Draft(token_ids=want[3:5]))).result
    assert (reply.num_accepted, reply.next_token) == (2, want[5])


def test_sessions_belong_to_their_api_key(target):
    config = VerifierConfig(port=0, api_key_digests=frozenset({key_digest("alice"),
                                                               key_digest("bob")}))
    with EmbeddedVerifier(target, config) as server, \
            grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.VerifierStub(channel)
        alice = (("authorization", "Bearer alice"),)
        bob = (("authorization", "Bearer bob"),)
        req = pb.OpenSessionRequest(prompt_token_ids=PROMPT, sampling=GREEDY)
        assert code_of(stub.OpenSession, req) == grpc.StatusCode.UNAUTHENTICATED
        assert code_of(stub.OpenSession, req, metadata=(("authorization", "Bearer eve"),)) \
            == grpc.StatusCode.UNAUTHENTICATED
        opened = stub.OpenSession(req, metadata=alice)
        verify = pb.VerifyRequest(session_id=opened.session_id, round=0)
        assert code_of(stub.Verify, verify, metadata=bob) == grpc.StatusCode.NOT_FOUND
        assert stub.Verify(verify, metadata=alice).result.committed_length == len(PROMPT) + 1


def test_generate_is_plain_greedy_decoding_streamed(stub, target):
    want = reference_greedy(target, PROMPT, 10)
    replies = list(stub.Generate(pb.GenerateRequest(prompt_token_ids=PROMPT, max_new_tokens=10,
                                                    ignore_eos=True)))
    assert [t for r in replies for t in r.token_ids] == want
    assert [r.finished for r in replies] == [False] * 9 + [True]
    assert replies[-1].committed_length == len(PROMPT) + 10


def test_resource_exhausted_carries_a_retry_hint(stub):
    for _ in range(4):
        open_session(stub)
    with pytest.raises(grpc.RpcError) as info:
        open_session(stub)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    hint = dict(info.value.trailing_metadata())["retry-after-ms"]
    assert int(hint) > 0


def test_continue_streams_plain_decoding_in_the_session(target):
    """Under a cost model where drafting never pays, Continue decodes round after round in
    the session, streams each one, and stops after the acceptance probe (PROBE_EVERY)."""
    config = VerifierConfig(port=0, max_draft_len=8, verify_token_cost=100.0,
                            fit_verify_cost=False)
    with EmbeddedVerifier(target, config) as server, \
            grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.VerifierStub(channel)
        n = 2 * PROBE_EVERY + 6
        want = reference_greedy(target, PROMPT, n)
        opened = open_session(stub, max_new_tokens=n,
                              first_draft=pb.Draft(token_ids=[want[0], 3]))
        first = opened.first_round
        assert first.suggested_draft_len == 0  # plain decoding is cheaper
        got = [want[0], first.next_token] if first.num_accepted else [first.next_token]
        replies = list(stub.Continue(pb.ContinueRequest(
            session_id=opened.session_id, round=1, max_tokens=1000,
            stop_when_drafting_pays=True)))
        # Rounds 1..P-1 stream; round P-1 is the probe (suggests 1) and ends the stream.
        assert [r.round for r in replies] == list(range(1, PROBE_EVERY))
        assert [r.suggested_draft_len for r in replies] == [0] * (PROBE_EVERY - 2) + [1]
        assert all(r.num_accepted == 0 and r.target_forwards == 1 for r in replies)
        got += [r.next_token for r in replies]
        assert got == want[:len(got)]
        assert replies[-1].committed_length == len(PROMPT) + len(got)
        # A round the client missed is replayed, not applied twice.
        last = PROBE_EVERY - 1
        again = list(stub.Continue(pb.ContinueRequest(session_id=opened.session_id,
                                                      round=last, max_tokens=1)))
        assert [(r.round, r.next_token, r.target_forwards) for r in again] == \
            [(last, replies[-1].next_token, 0)]
        # Not stopping for the probes: to the end of the session (its max_new_tokens).
        rest = list(stub.Continue(pb.ContinueRequest(session_id=opened.session_id,
                                                      round=last + 1, max_tokens=1000)))
        assert any(r.suggested_draft_len for r in rest[:-1])  # the probe at round 2P-1
        got += [r.next_token for r in rest]
        assert got == want and rest[-1].finished


def test_continue_rejects_bad_requests(stub):
    opened = open_session(stub)
    sid = opened.session_id

    def code(**kw):
        return code_of(lambda r: list(stub.Continue(r)), pb.ContinueRequest(**kw))

    assert code(session_id=sid, round=0, max_tokens=0) == grpc.StatusCode.INVALID_ARGUMENT
    assert code(session_id=sid, round=3, max_tokens=1) == grpc.StatusCode.FAILED_PRECONDITION
    assert code(session_id="ab" * 16, round=0, max_tokens=1) == grpc.StatusCode.NOT_FOUND
    assert code(session_id="nope", round=0, max_tokens=1) == grpc.StatusCode.INVALID_ARGUMENT
    # The session is undisturbed.
    assert len(list(stub.Continue(pb.ContinueRequest(session_id=sid, round=0,
                                                     max_tokens=1)))) == 1


def test_command_line_checks_its_numbers():
    from cloud_verifier.server import parse_args

    args, config = parse_args(["--threads", "1", "--kv-budget-mb", "2", "--port", "0",
                               "--kv-wait", "2.5"])
    assert args.threads == 1 and config.kv_budget_bytes == 2 * 2**20
    assert config.kv_wait_s == 2.5
    for bad in (["--threads", "0"], ["--verify-token-cost", "-1"], ["--kv-wait", "-1"]):
        with pytest.raises(SystemExit):
            parse_args(bad)
