"""The verifier over real gRPC on a loopback port, with tiny random models.

Covers the protocol (info, a rounds session on its stream, Decode, Generate), KV-cache
rollback through rejections, the session's life (half-close, finish, TTL expiry), auth and
routing-key metadata, health, drain, and one test per bad-input row with its ErrorInfo
reason.
"""

from __future__ import annotations

import subprocess
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from stream_helpers import (
    LOOKAHEAD,
    PROMPT,
    SessionCall,
    decode_message,
    error_of,
    lookahead_message,
    open_message,
    reference_greedy,
    stream_error,
    verify_message,
)

from cloud_verifier.config import VerifierConfig, key_digest
from cloud_verifier.draft_policy import PROBE_EVERY
from cloud_verifier.server import EmbeddedVerifier
from shared import errors
from shared.pb import verifier_pb2 as pb
from shared.pb import verifier_pb2_grpc as pb_grpc

SERVICE = "edgespec.v1.VerifierService"


@pytest.fixture()
def server(target):
    with EmbeddedVerifier(target, VerifierConfig(port=0, max_draft_len=8, max_sessions=4,
                                                 session_ttl_s=30)) as v:
        yield v


@pytest.fixture()
def stub(server):
    with grpc.insecure_channel(server.address) as channel:
        yield pb_grpc.VerifierServiceStub(channel)


def live_sessions(server) -> int:
    return server.call(_count(server))


async def _count(server) -> int:
    return len(server.server.service.store)


def active_sessions_metric(server) -> float:
    return server.server.metrics.active_sessions._value.get()


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
    with SessionCall(stub, open_message(first=want[:3])) as call:  # all right: 3 + bonus
        opened = call.reply()
        first = opened.step
        assert len(opened.session_id) == 32 and int(opened.session_id, 16) >= 0
        assert (first.round, first.num_drafted, first.num_accepted) == (0, 3, 3)
        assert list(first.token_ids) == want[:4] and first.target_forwards == 1
        got = want[:4]
        round_no = 1
        while len(got) < 24:
            # Two right drafts, then a wrong one (rejected), then one that is never judged.
            right = want[len(got):len(got) + 2]
            wrong = (want[len(got) + 2] + 1) % target.vocab_size
            # Confidences (odd rounds) only inform the cut, never the verdict.
            confidence = [0.9, 0.8, 0.3, 0.1] if round_no % 2 else []
            step = call.send(verify_message(round_no, right + [wrong, 7],
                                            confidence=confidence)).step()
            assert (step.round, step.num_drafted, step.num_accepted) == (round_no, 4, 2)
            assert step.HasField("draft_token_cost") and step.draft_token_cost >= 0
            assert step.HasField("suggested_draft_len")
            assert list(step.token_ids) == right + [want[len(got) + 2]]
            got += list(step.token_ids)
            assert step.committed_length == len(PROMPT) + len(got)
            round_no += 1
    assert got == want[:len(got)]


def test_only_the_first_reply_carries_the_session_id(stub):
    with SessionCall(stub, open_message(first=[5])) as call:
        assert call.reply().session_id
        assert call.send(verify_message(1, [6])).reply().session_id == ""


def test_an_open_without_a_first_draft_is_one_plain_step(stub, target):
    want = reference_greedy(target, PROMPT, 2)
    for first in (None, []):
        with SessionCall(stub, open_message(first=first)) as call:
            step = call.step()
            assert (step.num_drafted, step.num_accepted) == (0, 0)
            assert list(step.token_ids) == want[:1]
            assert call.send(verify_message(1)).step().token_ids == want[1:2]


def test_session_ids_are_random_128_bit_hex(stub):
    ids = set()
    for _ in range(4):
        with SessionCall(stub, open_message()) as call:
            ids.add(call.reply().session_id)
    assert len(ids) == 4
    assert all(len(i) == 32 and int(i, 16) >= 0 for i in ids)


def test_max_new_tokens_finishes_and_the_stream_ends_at_the_half_close(server, stub, target):
    want = reference_greedy(target, PROMPT, 8)
    call = SessionCall(stub, open_message(first=want[:5], max_new_tokens=3))
    step = call.step()
    assert step.finished and list(step.token_ids) == want[:3]
    assert step.committed_length == len(PROMPT) + 3
    assert live_sessions(server) == 0  # closed by its finish
    time.sleep(0.2)
    assert not call.call.done()  # the server waits for the client's half-close
    call.close()
    assert call.rest() == [] and call.call.code() == grpc.StatusCode.OK


def test_a_message_after_the_finish_is_out_of_order(stub, target):
    err = stream_error(stub, open_message(first=[5, 6], max_new_tokens=1), verify_message(1))
    assert (err.code, err.reason) == (grpc.StatusCode.FAILED_PRECONDITION, errors.OUT_OF_ORDER)


def test_half_closing_closes_the_session_at_once(server, stub):
    call = SessionCall(stub, open_message())
    call.step()
    assert live_sessions(server) == 1 and active_sessions_metric(server) == 1
    call.close()
    assert call.rest() == [] and call.call.code() == grpc.StatusCode.OK
    assert live_sessions(server) == 0 and active_sessions_metric(server) == 0


def test_half_closing_during_a_decode_stops_it(server, stub):
    call = SessionCall(stub, open_message(), decode_message(1, 100))
    assert [call.step().round for _ in range(3)] == [0, 1, 2]
    call.close()
    rest = call.rest()  # the rounds answered before the server saw the half-close
    assert call.call.code() == grpc.StatusCode.OK
    assert len(rest) < 20  # of the 97 the Decode asked for
    assert live_sessions(server) == 0


def test_cancelling_the_stream_closes_the_session(server, stub):
    call = SessionCall(stub, open_message(), decode_message(1, 1000))
    call.step(), call.step()
    call.cancel()
    deadline = time.monotonic() + 5
    while live_sessions(server):
        assert time.monotonic() < deadline, "the cancelled stream's session stayed open"
        time.sleep(0.02)


def test_health_and_reflection(server):
    with grpc.insecure_channel(server.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for name in ("", SERVICE):
            status = health.Check(health_pb2.HealthCheckRequest(service=name))
            assert status.status == health_pb2.HealthCheckResponse.SERVING
        from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

        refl = reflection_pb2_grpc.ServerReflectionStub(channel)
        reply = next(refl.ServerReflectionInfo(iter([
            reflection_pb2.ServerReflectionRequest(list_services="")])))
        names = {s.name for s in reply.list_services_response.service}
        assert SERVICE in names


# -- bad input: one test per row of the status table -----------------------------------------

def q(ids, probs):
    return (ids, probs)


@pytest.mark.parametrize("tokens, dists, confidence, field", [
    ([96], None, None, "verify.draft.token_ids"),  # token id == V
    ([5], [q([5, 200], [0.5, 0.5])], None, "verify.draft.q[0]"),  # q id out of range
    ([5], [q([5, 6], [1.2, -0.2])], None, "verify.draft.q[0]"),  # negative / above one
    ([5], [q([5, 6], [float("nan"), 0.5])], None, "verify.draft.q[0]"),  # NaN
    ([5], [q([5, 6], [0.6, 0.41])], None, "verify.draft.q[0]"),  # sums past 1 + 1e-3
    ([5], [q([6, 7], [0.5, 0.5])], None, "verify.draft.q[0]"),  # drafted token missing
    ([5], [q([5, 6], [0.0, 1.0])], None, "verify.draft.q[0]"),  # drafted token with q = 0
    ([5, 6], [q([5], [1.0])], None, "verify.draft.q"),  # q count != K
    ([5], [q([5, 5], [0.5, 0.5])], None, "verify.draft.q[0]"),  # duplicate ids
    (list(range(3, 12)), None, None, "verify.draft.token_ids"),  # K = 9 > max_draft_len 8
    ([5, 6], None, [0.5], "verify.draft.confidence"),  # confidence count != K
    ([5], None, [1.5], "verify.draft.confidence"),  # confidence above one
    ([5], None, [-0.1], "verify.draft.confidence"),  # negative confidence
    ([5], None, [float("nan")], "verify.draft.confidence"),  # NaN confidence
], ids=["token", "q-token", "negative", "nan", "sum", "missing", "zero-q", "q-count",
        "duplicate", "k-too-big", "confidence-count", "confidence-above-one",
        "confidence-negative", "confidence-nan"])
def test_invalid_drafts_are_invalid_argument(server, stub, tokens, dists, confidence, field):
    sampled = pb.SamplingParams(temperature=1.0, seed=3)
    err = stream_error(stub, open_message(sampling=sampled),
                       verify_message(1, tokens, q=dists, confidence=confidence))
    assert (err.code, err.reason) == (grpc.StatusCode.INVALID_ARGUMENT, errors.INVALID_ARGUMENT)
    assert err.metadata == {"field": field}
    assert live_sessions(server) == 0  # the failed stream's session is closed


def test_invalid_opens_are_invalid_argument(stub):
    def opening_error(**kwargs):
        return stream_error(stub, open_message(**kwargs))

    bad_t = pb.SamplingParams(temperature=float("nan"))
    bad_p = pb.SamplingParams(temperature=1.0, top_p=1.5)
    for kwargs, field in [
        (dict(prompt=[]), "open.prompt_token_ids"),
        (dict(prompt=[1, 96]), "open.prompt_token_ids"),
        (dict(sampling=bad_t), "open.sampling.temperature"),
        (dict(sampling=bad_p), "open.sampling.top_p"),
        (dict(drafting=pb.DRAFTING_UNSPECIFIED), "open.drafting"),
        (dict(first=[5, 96]), "open.first_draft.token_ids"),
    ]:
        err = opening_error(**kwargs)
        assert (err.code, err.reason, err.metadata) == \
            (grpc.StatusCode.INVALID_ARGUMENT, errors.INVALID_ARGUMENT, {"field": field}), kwargs


def test_a_stream_must_start_with_open(stub):
    for messages in ([verify_message(0)], [pb.SessionRequest()]):
        err = stream_error(stub, *messages)
        assert (err.code, err.reason) == (grpc.StatusCode.INVALID_ARGUMENT,
                                          errors.INVALID_ARGUMENT)
    err = stream_error(stub, half_close=True)  # nothing at all
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT and err.metadata == {"field": "open"}


@pytest.mark.parametrize("message", [
    open_message(),  # a second open
    lookahead_message(len(PROMPT), [5]),  # not taken by a rounds session
    verify_message(0),  # round 0 again
    verify_message(2),  # skips round 1
    decode_message(3, 1),
], ids=["second-open", "lookahead", "repeat", "skip", "decode-skip"])
def test_messages_out_of_place_are_failed_precondition(server, stub, message):
    err = stream_error(stub, open_message(), message)
    assert (err.code, err.reason) == (grpc.StatusCode.FAILED_PRECONDITION, errors.OUT_OF_ORDER)
    assert live_sessions(server) == 0


def test_an_empty_message_after_the_open_is_invalid_argument(stub):
    err = stream_error(stub, open_message(), pb.SessionRequest())
    assert (err.code, err.reason) == (grpc.StatusCode.INVALID_ARGUMENT, errors.INVALID_ARGUMENT)


def test_context_past_maximum_is_out_of_range(stub, target):
    err = stream_error(stub, open_message(prompt=[5] * target.max_context))
    assert (err.code, err.reason) == (grpc.StatusCode.OUT_OF_RANGE, errors.CONTEXT_TOO_LONG)
    nearly = [5] * (target.max_context - 3)
    err = stream_error(stub, open_message(prompt=nearly), verify_message(1, [5, 6, 7]))
    assert (err.code, err.reason) == (grpc.StatusCode.OUT_OF_RANGE, errors.CONTEXT_TOO_LONG)
    err = stream_error(stub, open_message(prompt=nearly, first=[5, 6, 7]))
    assert (err.code, err.reason) == (grpc.StatusCode.OUT_OF_RANGE, errors.CONTEXT_TOO_LONG)
    with SessionCall(stub, open_message(prompt=nearly)) as call:
        call.step()
        assert call.send(verify_message(1, [5])).step().committed_length <= target.max_context


def test_an_expired_sessions_next_message_is_session_expired(target):
    """The TTL sweep closes a session idle on its stream; the stream's next message gets
    NOT_FOUND with SESSION_EXPIRED (the client reopens with its committed context)."""
    config = VerifierConfig(port=0, session_ttl_s=0.2)
    with EmbeddedVerifier(target, config) as server, \
            grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.VerifierServiceStub(channel)
        call = SessionCall(stub, open_message())
        call.step()
        deadline = time.monotonic() + 5
        while live_sessions(server):  # the sweep runs every TTL / 4
            assert time.monotonic() < deadline
            time.sleep(0.05)
        err = error_of(call.send(verify_message(1)).rest)
        assert (err.code, err.reason) == (grpc.StatusCode.NOT_FOUND, errors.SESSION_EXPIRED)
        assert server.server.metrics.evictions.labels("ttl")._value.get() == 1


def test_a_streaming_session_is_not_idle(target):
    """Generate's rounds keep its session in use, so a generation longer than the TTL is not
    expired halfway (the sweep runs every TTL / 4)."""
    config = VerifierConfig(port=0, session_ttl_s=0.1)
    with EmbeddedVerifier(target, config) as server, \
            grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.VerifierServiceStub(channel)
        t0 = time.monotonic()
        replies = list(stub.Generate(pb.GenerateRequest(prompt_token_ids=PROMPT,
                                                        ignore_eos=True)))
        assert time.monotonic() - t0 > 0.2  # longer than the TTL
        assert replies[-1].step.finished


def test_too_many_sessions_is_resource_exhausted_with_a_retry_delay(stub):
    calls = [SessionCall(stub, open_message()) for _ in range(4)]
    try:
        for call in calls:
            call.step()
        err = stream_error(stub, open_message())
        assert (err.code, err.reason) == (grpc.StatusCode.RESOURCE_EXHAUSTED, errors.OVERLOADED)
        assert err.retry_after_s == pytest.approx(0.2)
        gen = error_of(lambda: list(stub.Generate(pb.GenerateRequest(prompt_token_ids=PROMPT))))
        assert gen.reason == errors.OVERLOADED and gen.retry_after_s == pytest.approx(0.2)
    finally:
        for call in calls:
            call.cancel()


def test_rejections_are_counted_by_code(server, stub):
    stream_error(stub, open_message(prompt=[]))
    stream_error(stub, open_message(), verify_message(7))
    rejected = server.server.metrics.rejected_requests
    assert rejected.labels("INVALID_ARGUMENT")._value.get() == 1
    assert rejected.labels("FAILED_PRECONDITION")._value.get() == 1


def test_draining_is_unavailable_but_running_sessions_finish(server, stub, target):
    from cloud_verifier.healthcheck import main as healthcheck

    want = reference_greedy(target, PROMPT, 4)
    with SessionCall(stub, open_message(first=want[:1])) as call:
        assert list(call.step().token_ids) == want[:2]
        assert healthcheck(["--address", server.address]) == 0
        server.call(server.server.begin_drain())
        assert healthcheck(["--address", server.address]) == 1  # NOT_SERVING
        err = stream_error(stub, open_message())
        assert (err.code, err.reason) == (grpc.StatusCode.UNAVAILABLE, errors.DRAINING)
        assert err.retry_after_s is not None and err.retry_after_s > 0
        step = call.send(verify_message(1, want[2:3])).step()
        assert (step.num_accepted, list(step.token_ids)) == (1, want[2:4])


def test_bad_requests_do_not_disturb_another_session(stub, target):
    want = reference_greedy(target, PROMPT, 6)
    with SessionCall(stub, open_message(first=want[:2])) as good:
        good.step()
        for bad in (verify_message(1, [500]), verify_message(1, [5], q=[([5], [2.0])]),
                    verify_message(5)):
            stream_error(stub, open_message(), bad)
        step = good.send(verify_message(1, want[3:5])).step()
        assert (step.num_accepted, list(step.token_ids)) == (2, want[3:6])


def test_an_internal_error_closes_only_its_session(server, stub, target):
    engine = server.server.service.engine
    run_batch = engine.run_batch
    with SessionCall(stub, open_message()) as other:
        other.step()

        def failing(rounds):
            engine.run_batch = run_batch  # once
            raise RuntimeError("a bug")

        engine.run_batch = failing
        err = stream_error(stub, open_message())
        assert (err.code, err.reason) == (grpc.StatusCode.INTERNAL, errors.INTERNAL)
        assert "a bug" not in err.message  # no internals leak
        assert live_sessions(server) == 1
        want = reference_greedy(target, PROMPT, 2)
        assert list(other.send(verify_message(1)).step().token_ids) == want[1:2]


def test_the_service_needs_an_api_key_and_health_does_not(target):
    config = VerifierConfig(port=0, api_key_digests=frozenset({key_digest("alice")}))
    alice = (("authorization", "Bearer alice"),)
    with EmbeddedVerifier(target, config) as server, \
            grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.VerifierServiceStub(channel)
        for metadata in (None, (("authorization", "Bearer eve"),),
                         (("authorization", "alice"),)):
            err = error_of(stub.GetInfo, pb.GetInfoRequest(), metadata=metadata)
            assert (err.code, err.reason) == (grpc.StatusCode.UNAUTHENTICATED,
                                              errors.UNAUTHENTICATED)
            err = stream_error(stub, open_message(), metadata=metadata)
            assert err.reason == errors.UNAUTHENTICATED
            err = error_of(lambda m=metadata: list(stub.Generate(
                pb.GenerateRequest(prompt_token_ids=PROMPT), metadata=m)))
            assert err.reason == errors.UNAUTHENTICATED
        assert stub.GetInfo(pb.GetInfoRequest(), metadata=alice).vocab_size == target.vocab_size
        with SessionCall(stub, open_message(), metadata=alice) as call:
            assert call.step().committed_length == len(PROMPT) + 1
        health = health_pb2_grpc.HealthStub(channel)
        status = health.Check(health_pb2.HealthCheckRequest(service=SERVICE))
        assert status.status == health_pb2.HealthCheckResponse.SERVING


def test_routing_key_is_checked(stub):
    good = ((errors.ROUTING_KEY, "gen-42_A"),)
    assert stub.GetInfo(pb.GetInfoRequest(), metadata=good).protocol_version == "edgespec.v1"
    with SessionCall(stub, open_message(), metadata=good) as call:
        assert call.step().round == 0
    for bad in ("", "has space", "x" * 65, "a/b"):
        metadata = ((errors.ROUTING_KEY, bad),)
        err = error_of(stub.GetInfo, pb.GetInfoRequest(), metadata=metadata)
        assert (err.code, err.reason, err.metadata) == (
            grpc.StatusCode.INVALID_ARGUMENT, errors.INVALID_ARGUMENT,
            {"field": errors.ROUTING_KEY}), bad
        err = stream_error(stub, open_message(), metadata=metadata)
        assert err.code == grpc.StatusCode.INVALID_ARGUMENT


def test_generate_is_plain_greedy_decoding_streamed(stub, target):
    want = reference_greedy(target, PROMPT, 10)
    steps = [r.step for r in stub.Generate(pb.GenerateRequest(
        prompt_token_ids=PROMPT, max_new_tokens=10, ignore_eos=True))]
    assert [t for s in steps for t in s.token_ids] == want
    assert [s.round for s in steps] == list(range(10))
    assert [s.finished for s in steps] == [False] * 9 + [True]
    assert all(s.num_drafted == 0 and s.target_forwards == 1 for s in steps)
    assert not any(s.HasField("suggested_draft_len") for s in steps)
    assert steps[-1].committed_length == len(PROMPT) + 10


def test_decode_streams_plain_decoding_in_the_session(target):
    """Under a cost model where drafting never pays, a Decode decodes round after round in
    the session, one Step each, and stops after the acceptance probe (PROBE_EVERY)."""
    config = VerifierConfig(port=0, max_draft_len=8, verify_token_cost=100.0,
                            fit_verify_cost=False)
    with EmbeddedVerifier(target, config) as server, \
            grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.VerifierServiceStub(channel)
        n = 2 * PROBE_EVERY + 6
        want = reference_greedy(target, PROMPT, n)
        call = SessionCall(stub, open_message(first=[want[0], 3], max_new_tokens=n))
        first = call.step()
        assert first.suggested_draft_len == 0  # plain decoding is cheaper
        got = list(first.token_ids)
        call.send(decode_message(1, 1000, stop_when_drafting_pays=True))
        steps = []
        while not steps or steps[-1].suggested_draft_len == 0:
            steps.append(call.step())
        # Rounds 1..P-1 stream; round P-1 is the probe (suggests 1) and ends the Decode.
        assert [s.round for s in steps] == list(range(1, PROBE_EVERY))
        assert [s.suggested_draft_len for s in steps] == [0] * (PROBE_EVERY - 2) + [1]
        assert all(s.num_drafted == 0 and s.target_forwards == 1 for s in steps)
        got += [t for s in steps for t in s.token_ids]
        assert got == want[:len(got)]
        # A Decode of 2: exactly two Steps, then the stream takes the next message.
        two = [call.send(decode_message(PROBE_EVERY, 2)).step(), call.step()]
        assert [s.round for s in two] == [PROBE_EVERY, PROBE_EVERY + 1]
        got += [t for s in two for t in s.token_ids]
        # Not stopping for the probes: to the end of the session (its max_new_tokens).
        call.send(decode_message(PROBE_EVERY + 2, 1000))
        rest = []
        while not rest or not rest[-1].finished:
            rest.append(call.step())
        assert any(s.suggested_draft_len for s in rest[:-1])  # the probe at round 2P-1
        got += [t for s in rest for t in s.token_ids]
        assert got == want
        call.close()
        assert call.rest() == []


def test_decode_rejects_bad_requests(stub):
    err = stream_error(stub, open_message(), decode_message(1, 0))
    assert (err.code, err.metadata) == (grpc.StatusCode.INVALID_ARGUMENT,
                                        {"field": "decode.max_tokens"})
    err = stream_error(stub, open_message(drafting=LOOKAHEAD), decode_message(1, 1))
    assert err.reason == errors.OUT_OF_ORDER  # lookahead sessions take no Decode


def test_command_line_checks_its_numbers():
    from cloud_verifier.server import parse_args

    args, config = parse_args(["--threads", "1", "--kv-budget-mb", "2", "--port", "0",
                               "--kv-wait", "2.5"])
    assert args.threads == 1 and config.kv_budget_bytes == 2 * 2**20
    assert config.kv_wait_s == 2.5
    for bad in (["--threads", "0"], ["--verify-token-cost", "-1"], ["--kv-wait", "-1"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_help_and_version_do_not_import_torch():
    script = ("import sys\n"
              "from cloud_verifier.server import main\n"
              "for argv in (['--help'], ['--version']):\n"
              "    try:\n"
              "        main(argv)\n"
              "    except SystemExit as exit:\n"
              "        assert exit.code == 0, exit.code\n"
              "assert 'torch' not in sys.modules, 'torch was imported'\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert "usage: edgespec-verifier" in out.stdout
    assert out.stdout.strip().splitlines()[-1].startswith("edgespec ")


def test_every_uint64_seed_is_accepted_and_the_top_bit_counts(stub):
    """The proto's seed is a uint64: 2**63 and above open like any other seed (a hostile
    probe once got INVALID_ARGUMENT), and a seed differing only in its top bit is another
    stream (20 sampled tokens at T = 1 from the random target)."""
    def sampled(seed: int) -> list[int]:
        sampling = pb.SamplingParams(temperature=1.0, seed=seed)
        with SessionCall(stub, open_message(sampling=sampling, first=[])) as call:
            tokens = list(call.step().token_ids)
            for round_no in range(1, 20):
                tokens += call.send(verify_message(round_no)).step().token_ids
        return tokens

    low, high = sampled(5), sampled(5 + 2**63)
    assert sampled(2**64 - 1) and high == sampled(5 + 2**63)  # accepted, reproducible
    assert low != high
