"""Limits that match the protocol, on an in-process verifier with the tiny target: the q
support cap and the message size limits derived from the caps, undecodable requests,
big requests checked off the event loop, keepalive without GOAWAYs, idle streams (no open,
silent past the TTL, a stalled reader), and the one reopen hint of eviction and expiry."""

from __future__ import annotations

import asyncio
import logging
import threading

import grpc
import pytest
from stream_helpers import (
    PROMPT,
    SessionCall,
    draft,
    error_of,
    open_message,
    stream_error,
    verify_message,
)

from cloud_verifier import service as service_module
from cloud_verifier import wire
from cloud_verifier.config import VerifierConfig, key_digest
from cloud_verifier.errors import SessionEvicted, SessionExpired, StreamIdle
from cloud_verifier.interceptors import status_of
from cloud_verifier.server import EmbeddedVerifier
from cloud_verifier.undecodable import LogSummary
from edge_client.connection import Connection, is_retryable, reopens_at_once
from edge_client.generation_state import ServerLimits
from shared import errors
from shared.message_limits import max_request_bytes
from shared.pb import verifier_pb2 as pb
from shared.pb import verifier_pb2_grpc as pb_grpc

SERVICE = "/edgespec.v1.VerifierService"


def embedded(target, **config):
    return EmbeddedVerifier(target, VerifierConfig(port=0, max_draft_len=8, **config))


@pytest.fixture()
def server(target):
    with embedded(target, max_q_support=8, session_ttl_s=30) as v:
        yield v


@pytest.fixture()
def channel(server):
    with grpc.insecure_channel(server.address) as ch:
        yield ch


@pytest.fixture()
def stub(channel):
    return pb_grpc.VerifierServiceStub(channel)


def live_sessions(server) -> int:
    async def count() -> int:
        return len(server.server.service.store)
    return server.call(count())


def counter(metric, *labels) -> float:
    return (metric.labels(*labels) if labels else metric)._value.get()


# -- q support and message sizes --------------------------------------------------------------

def test_info_advertises_the_q_cap_and_the_client_drafts_within_it(stub):
    info = stub.GetInfo(pb.GetInfoRequest())
    assert info.max_q_support == 8 and info.max_stop_token_ids == wire.Limits(1, 1, 2) \
        .max_stop_token_ids
    limits = ServerLimits.from_info(info)
    assert [limits.q_support(w) for w in (0, 4, 64)] == [8, 4, 8]
    assert ServerLimits(96, 8, 128).q_support(64) == 64  # an older verifier: no cap


def test_a_q_past_the_cap_is_invalid_argument(stub):
    ids = list(range(3, 12))  # 9 entries > 8
    first = draft([5], q=[(ids, [0.1] * 9)])
    err = stream_error(stub, open_message(first=first))
    assert (err.code, err.reason) == (grpc.StatusCode.INVALID_ARGUMENT,
                                      errors.INVALID_ARGUMENT)
    assert err.metadata["field"] == "open.first_draft.q[0]" and "max_q_support" in err.message
    ok = draft([5], q=[(ids[:8], [0.1] * 8)])
    assert SessionCall(stub, open_message(first=ok)).step().committed_length > len(PROMPT)


def test_too_many_stop_ids_are_invalid_argument(stub):
    n = wire.Limits(1, 1, 2).max_stop_token_ids + 1
    err = stream_error(stub, open_message(stop_token_ids=[5] * n))
    assert (err.code, err.metadata["field"]) == (grpc.StatusCode.INVALID_ARGUMENT,
                                                 "open.stop_token_ids")


def test_the_largest_valid_request_fits_the_size_limit_and_a_16_mib_one_does_not(
        server, stub, target):
    limits = server.server.service.limits
    assert max_request_bytes(limits.caps()) < 64 * 1024  # was 16 MiB
    top = target.vocab_size - 1
    k, support = limits.max_draft_len, limits.max_q_support
    # Every field at its largest valid value: the verifier parses it (and answers a Step).
    biggest = draft([top] * k, q=[([top - i for i in range(support)], [1 / support] * support)
                                  for _ in range(k)], confidence=[1.0] * k)
    prompt = [top] * (limits.max_context - k - 1)
    message = open_message(prompt=prompt, first=biggest,
                           stop_token_ids=[top] * limits.max_stop_token_ids)
    with SessionCall(stub, message) as call:
        assert call.step().committed_length > len(prompt)
    # A 16 MiB prompt is refused by gRPC before it is parsed, and others go on.
    with SessionCall(stub, open_message()) as honest:
        first = honest.step()
        huge = pb.GenerateRequest(prompt_token_ids=[5] * (16 * 2**20), max_new_tokens=1)
        err = error_of(lambda: list(stub.Generate(huge, timeout=30)))
        assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        step = honest.send(verify_message(1)).step()
        assert step.committed_length == first.committed_length + 1


# -- undecodable requests ---------------------------------------------------------------------

def raw_calls(channel):
    """GetInfo, Generate and Session with bytes that are not their request types."""
    junk = b"\x0a\x05\xff"  # field 1, length 5, then the message ends
    unary = channel.unary_unary(f"{SERVICE}/GetInfo")
    server_stream = channel.unary_stream(f"{SERVICE}/Generate")
    bidi = channel.stream_stream(f"{SERVICE}/Session")
    return {"GetInfo": lambda **kw: unary(b"\xff\xff\xff", timeout=10, **kw),
            "Generate": lambda **kw: list(server_stream(junk, timeout=10, **kw)),
            "Session": lambda **kw: list(bidi(iter([junk]), timeout=10, **kw))}


def test_undecodable_requests_are_invalid_argument_with_one_log_line(server, channel, caplog):
    caplog.set_level(logging.WARNING)
    for name, call in raw_calls(channel).items():
        for _ in range(3):
            err = error_of(call)
            assert (err.code, err.reason) == (grpc.StatusCode.INVALID_ARGUMENT,
                                              errors.INVALID_ARGUMENT), name
            assert "class" not in err.message and err.metadata["field"] == "message"
        assert counter(server.server.metrics.undecodable_messages, name) == 3
    # 9 undecodable requests, no traceback, one line (the rest go into the next summary).
    lines = [r for r in caplog.records if "undecodable" in r.getMessage()]
    assert len(lines) == 1 and not any(r.exc_info for r in caplog.records)
    assert stub_works(channel)


def stub_works(channel) -> bool:
    return pb_grpc.VerifierServiceStub(channel).GetInfo(pb.GetInfoRequest()).vocab_size > 0


def test_undecodable_unary_requests_are_authenticated_first(target):
    config = VerifierConfig(port=0, api_key_digests=frozenset({key_digest("k1")}))
    with EmbeddedVerifier(target, config) as v, grpc.insecure_channel(v.address) as channel:
        calls = raw_calls(channel)
        for name, call in calls.items():
            assert error_of(call).code == grpc.StatusCode.UNAUTHENTICATED, name
            err = error_of(call, metadata=(("authorization", "Bearer k1"),))
            assert err.code == grpc.StatusCode.INVALID_ARGUMENT, name


def test_the_log_summary_reports_every_event_once_per_interval(caplog):
    """1 event, then 5 within the interval: two lines, the second counting 5."""
    caplog.set_level(logging.WARNING, logger="cloud_verifier.undecodable")

    async def run() -> None:
        summary = LogSummary(interval_s=0.05)
        for i in range(6):
            summary.event(f"event {i}")
        await asyncio.sleep(0.2)  # the timer flushes; no events after it, no more lines
    asyncio.run(run())
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert "event 0" in lines[0] and lines[1].startswith("5 undecodable") and "event 5" in lines[1]


# -- big requests off the event loop ----------------------------------------------------------

def test_a_big_request_is_checked_off_the_event_loop(server, stub, monkeypatch):
    """The check of a big open is held on its worker thread until a GetInfo has been answered:
    were it on the event loop, GetInfo could not be. Then the open gets its error."""
    monkeypatch.setattr(wire, "LARGE_REQUEST_ENTRIES", 16)
    started, release = threading.Event(), threading.Event()
    parse_open = service_module.parse_open

    def held(msg, limits, eos):
        started.set()
        assert release.wait(30)
        return parse_open(msg, limits, eos)
    monkeypatch.setattr(service_module, "parse_open", held)
    order: list[str] = []
    bad = open_message(prompt=PROMPT * 5 + [10_000])  # 31 ids, the last out of range
    outcome: list = []
    worker = threading.Thread(target=lambda: outcome.append(stream_error(stub, bad)))
    worker.start()
    assert started.wait(30)
    stub.GetInfo(pb.GetInfoRequest(), timeout=30)
    order.append("GetInfo")
    release.set()
    worker.join(30)
    order.append("open")
    assert order == ["GetInfo", "open"]
    assert (outcome[0].code, outcome[0].metadata["field"]) == (
        grpc.StatusCode.INVALID_ARGUMENT, "open.prompt_token_ids")
    assert "[30] = 10000" in outcome[0].message  # the first bad index, found by numpy


# -- keepalive --------------------------------------------------------------------------------

async def quiet_stream(address: str, keepalive_s: float,
                       quiet_s: float) -> tuple[grpc.StatusCode | None, int | None]:
    """A Session stream that opens, stays quiet while the client pings, then sends a round:
    (the status the stream ended with meanwhile or None, the round answered or None)."""
    conn = Connection(address, keepalive_s=keepalive_s)
    try:
        call = conn.stub.Session(timeout=30, metadata=conn.metadata())
        await call.write(open_message())
        await call.read()
        await asyncio.sleep(quiet_s)
        try:
            await call.write(verify_message(1))
        except asyncio.InvalidStateError:  # the call has already ended
            return await call.code(), None
        return None, (await call.read()).step.round
    finally:
        await conn.close()


def test_client_pings_on_a_quiet_stream_are_permitted(target):
    """A client asking for pings every 0.1 s (gRPC sends at most one a second) on a stream
    quiet for 5 s: no GOAWAY when the server permits pings every 0.5 s."""
    with embedded(target, min_client_ping_s=0.5) as v:
        assert asyncio.run(quiet_stream(v.address, keepalive_s=0.1, quiet_s=5.0)) == (None, 1)


def test_pings_faster_than_permitted_get_goaway(target):
    """The control: the same client against a server that permits one ping a minute has its
    connection closed (too_many_pings after gRPC's two strikes), so the test above can
    fail."""
    with embedded(target, min_client_ping_s=60) as v:
        code, _ = asyncio.run(quiet_stream(v.address, keepalive_s=0.1, quiet_s=5.0))
        assert code == grpc.StatusCode.UNAVAILABLE


# -- idle streams -----------------------------------------------------------------------------

def test_a_stream_that_never_opens_is_closed_and_others_go_on(target):
    with embedded(target, open_timeout_s=0.3) as v, grpc.insecure_channel(v.address) as ch:
        stub = pb_grpc.VerifierServiceStub(ch)
        honest = SessionCall(stub, open_message())
        honest.step()
        silent = [SessionCall(stub) for _ in range(5)]
        for call in silent:
            err = error_of(call.rest)
            assert (err.code, err.reason) == (grpc.StatusCode.DEADLINE_EXCEEDED,
                                              errors.STREAM_IDLE)
        assert counter(v.server.metrics.idle_streams, "open") == 5
        assert v.server.service.streams.count == 1  # only the honest one is left
        assert honest.send(verify_message(1)).step().round == 1
        honest.cancel()


def test_a_rounds_session_silent_past_its_ttl_is_expired_without_a_message(target):
    """The stream ends by itself with SESSION_EXPIRED and the reopen hint."""
    with embedded(target, session_ttl_s=0.3) as v, grpc.insecure_channel(v.address) as ch:
        call = SessionCall(pb_grpc.VerifierServiceStub(ch), open_message())
        call.step()
        err = error_of(call.rest)  # sends nothing more
        assert (err.code, err.reason) == (grpc.StatusCode.NOT_FOUND, errors.SESSION_EXPIRED)
        assert err.metadata[errors.REOPEN] == errors.REOPEN_WITH_CONTEXT
        assert live_sessions(v) == 0
        call.cancel()


def test_a_stalled_generate_reader_is_closed_as_idle_not_evicted(target):
    """A client that stops reading: once HTTP/2 flow control is full (a 1 KiB window here),
    the reply waits for longer than the limit and the stream ends STREAM_IDLE; the session is
    closed, and neither evicted nor expired, although the TTL is shorter than the stall."""
    with embedded(target, stalled_reader_s=0.5, session_ttl_s=0.2) as v, \
            grpc.insecure_channel(v.address, options=[("grpc.http2.bdp_probe", 0),
                                                     ("grpc.http2.lookahead_bytes", 1024)]) as ch:
        stub = pb_grpc.VerifierServiceStub(ch)
        replies = stub.Generate(pb.GenerateRequest(prompt_token_ids=[1], ignore_eos=True),
                                timeout=30)
        first = next(replies)
        deadline = threading.Event()
        while counter(v.server.metrics.idle_streams, "read") == 0:  # we are not reading
            assert not deadline.wait(0.05) and first.step.round == 0
        got = 1
        with pytest.raises(grpc.RpcError) as info:
            for _ in replies:
                got += 1
        details = errors.details_of(info.value)
        assert (details.code, details.reason) == (grpc.StatusCode.DEADLINE_EXCEEDED,
                                                  errors.STREAM_IDLE)
        assert details.reopen_with_context
        assert 1 < got < v.server.service.engine.max_context  # stalled before the end
        assert live_sessions(v) == 0
        assert counter(v.server.metrics.evictions, "ttl") == 0
        assert counter(v.server.metrics.evictions, "kv_budget") == 0


# -- one reopen hint --------------------------------------------------------------------------

def test_eviction_expiry_and_idling_carry_the_same_reopen_hint_and_the_client_reopens():
    for error in (SessionEvicted("x"), SessionExpired("x"), StreamIdle("x")):
        status = status_of(error)
        trailer = dict(status.trailing_metadata)["grpc-status-details-bin"]
        from google.rpc import error_details_pb2, status_pb2
        info = error_details_pb2.ErrorInfo()
        status_pb2.Status.FromString(trailer).details[0].Unpack(info)
        assert info.metadata[errors.REOPEN] == errors.REOPEN_WITH_CONTEXT, error
        details = errors.ErrorDetails(status.code, info.reason, None, "x", dict(info.metadata))
        assert is_retryable(details) and reopens_at_once(details), error
    # A reason this client does not know, with the hint, is reopened at once too.
    unknown = errors.ErrorDetails(grpc.StatusCode.ABORTED, "SOMETHING_NEW", None, "x",
                                  {errors.REOPEN: errors.REOPEN_WITH_CONTEXT})
    assert is_retryable(unknown) and reopens_at_once(unknown)


# -- evacuation (the drain's end) ----------------------------------------------------------

def test_evacuation_ends_a_waiting_stream_and_a_writing_one_with_draining():
    """One stream awaits its next reply (its await is cancelled), the other is between
    replies (it ends before asking for the next); both end with the draining error, the
    replies already yielded kept."""
    from cloud_verifier.stream_limits import LiveStreams, guarded

    async def run():
        streams, gate = LiveStreams(), asyncio.Event()
        cleaned: list[str] = []

        async def replies(name):
            try:
                yield 1
                await gate.wait()
                yield 2
            finally:
                cleaned.append(name)

        async def consume(name, pause: asyncio.Event | None):
            got = []
            try:
                async for reply in guarded(replies(name), streams, 60, lambda: None,
                                           lambda: RuntimeError("DRAINING")):
                    got.append(reply)
                    if pause is not None:
                        await pause.wait()  # as if gRPC were still writing the reply
            except RuntimeError as err:
                return got, str(err)
            return got, None

        writing = asyncio.Event()
        tasks = [asyncio.ensure_future(consume("waiting", None)),
                 asyncio.ensure_future(consume("writing", writing))]
        await asyncio.sleep(0.05)
        streams.evacuate()
        writing.set()
        return await asyncio.gather(*tasks), cleaned

    results, cleaned = asyncio.run(run())
    assert results == [([1], "DRAINING"), ([1], "DRAINING")]
    assert "waiting" in cleaned  # its handler unwound before the error
