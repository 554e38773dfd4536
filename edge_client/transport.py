"""The client side of the gRPC protocol: one channel, per-call deadlines, byte and time
accounting, and an optional injected network delay (to measure a WAN on loopback).

Three ways to carry a session: ``UnaryRounds`` (OpenSession / Verify calls, where a lost
reply is retried with the same round number and answered idempotently), ``StreamRounds``
(one bidirectional Session stream, no per-round call set-up), and ``LookaheadStream`` (one
Lookahead stream: the server decodes back to back and the client streams drafts ahead, no
round trip per round).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import grpc

from shared.continue_stream import ends_stream
from shared.pb import verifier_pb2 as pb
from shared.pb import verifier_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 16 * 1024 * 1024
RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


@dataclass
class WireStats:
    round_trips: int = 0
    bytes_up: int = 0  # serialized protobuf bytes sent
    bytes_down: int = 0  # serialized protobuf bytes received
    call_s: float = 0.0  # wall time inside calls, injected delay included


class Transport:
    def __init__(self, address: str, api_key: str | None = None, rtt_ms: float = 0.0,
                 timeout_s: float = 60.0, retries: int = 2) -> None:
        self.address = address
        self.rtt_s = rtt_ms / 1000.0
        self.timeout_s = timeout_s
        self.retries = retries
        self.metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        self.channel = grpc.insecure_channel(address, options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ])
        self.stub = pb_grpc.VerifierStub(self.channel)

    def close(self) -> None:
        self.channel.close()

    def info(self) -> pb.GetInfoResponse:
        return self.stub.GetInfo(pb.GetInfoRequest(), timeout=self.timeout_s,
                                 metadata=self.metadata)

    def delay(self) -> None:
        """Half the injected round-trip time; called once each way."""
        if self.rtt_s:
            time.sleep(self.rtt_s / 2)

    def unary(self, stats: WireStats, method, request, retry: bool):
        attempts = 1 + (self.retries if retry else 0)
        for attempt in range(attempts):
            t0 = time.perf_counter()
            self.delay()
            stats.bytes_up += request.ByteSize()
            try:
                reply = method(request, timeout=self.timeout_s, metadata=self.metadata)
            except grpc.RpcError as err:
                stats.call_s += time.perf_counter() - t0
                if err.code() in RETRYABLE and attempt + 1 < attempts:
                    log.warning("retrying after %s: %s", err.code().name, err.details())
                    time.sleep(0.05 * 2**attempt)
                    continue
                raise
            self.delay()
            stats.round_trips += 1
            stats.bytes_down += reply.ByteSize()
            stats.call_s += time.perf_counter() - t0
            return reply
        raise AssertionError("unreachable")


class UnaryRounds:
    """A session as OpenSession + Verify calls."""

    def __init__(self, transport: Transport, stats: WireStats) -> None:
        self._t = transport
        self._stats = stats

    def open(self, request: pb.OpenSessionRequest) -> pb.OpenSessionResponse:
        # Not retried: a lost reply would leave an orphan session until its TTL.
        return self._t.unary(self._stats, self._t.stub.OpenSession, request, retry=False)

    def verify(self, request: pb.VerifyRequest) -> pb.VerifyResponse:
        return self._t.unary(self._stats, self._t.stub.Verify, request, retry=True)

    def continue_(self, request: pb.ContinueRequest) -> Iterator[pb.RoundResult]:
        """K = 0 rounds decoded by the server back to back: one round trip in all."""
        t0 = time.perf_counter()
        self._t.delay()
        self._stats.bytes_up += request.ByteSize()
        self._stats.round_trips += 1
        try:
            for i, result in enumerate(self._t.stub.Continue(
                    request, timeout=self._t.timeout_s, metadata=self._t.metadata)):
                if i == 0:
                    self._t.delay()
                self._stats.bytes_down += result.ByteSize()
                yield result
        finally:
            self._stats.call_s += time.perf_counter() - t0

    def close(self, session_id: str) -> None:
        self._t.unary(self._stats, self._t.stub.CloseSession,
                      pb.CloseSessionRequest(session_id=session_id), retry=True)

    def end(self) -> None:
        pass


class StreamRounds:
    """A session as one bidirectional Session stream."""

    def __init__(self, transport: Transport, stats: WireStats) -> None:
        self._t = transport
        self._stats = stats
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._replies = transport.stub.Session(iter(self._requests.get, None),
                                               metadata=transport.metadata)

    def _exchange(self, request: pb.SessionRequest) -> pb.SessionResponse:
        t0 = time.perf_counter()
        self._t.delay()
        self._stats.bytes_up += request.ByteSize()
        self._requests.put(request)
        reply = next(self._replies)
        self._t.delay()
        self._stats.round_trips += 1
        self._stats.bytes_down += reply.ByteSize()
        self._stats.call_s += time.perf_counter() - t0
        return reply

    def open(self, request: pb.OpenSessionRequest) -> pb.OpenSessionResponse:
        return self._exchange(pb.SessionRequest(open=request)).opened

    def verify(self, request: pb.VerifyRequest) -> pb.VerifyResponse:
        return self._exchange(pb.SessionRequest(verify=request)).verified

    def continue_(self, request: pb.ContinueRequest) -> Iterator[pb.RoundResult]:
        """K = 0 rounds decoded by the server back to back: one round trip in all. The
        server ends by Continue's rules, which the client applies to know the last one."""
        t0 = time.perf_counter()
        self._t.delay()
        msg = pb.SessionRequest(continue_decoding=request)
        self._stats.bytes_up += msg.ByteSize()
        self._requests.put(msg)
        self._stats.round_trips += 1
        try:
            for i in range(request.max_tokens):
                reply = next(self._replies)
                if i == 0:
                    self._t.delay()
                self._stats.bytes_down += reply.ByteSize()
                result = reply.continued
                yield result
                if ends_stream(request, result):
                    return
        finally:
            self._stats.call_s += time.perf_counter() - t0

    def close(self, session_id: str) -> None:
        self.end()  # ending the request stream closes the session

    def end(self) -> None:
        self._requests.put(None)
        self._replies.cancel()


class LookaheadStream:
    """A generation on one Lookahead stream: iterate it for the steps the server commits,
    and ``send`` each new lookahead (it goes out at once; nothing waits for a reply).

    With an injected RTT, each message up and each step down is delayed by half of it
    without holding up the others (a step is yielded half an RTT after it arrived)."""

    def __init__(self, transport: Transport, stats: WireStats,
                 opening: pb.OpenSessionRequest) -> None:
        self._t = transport
        self._stats = stats
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._started = time.perf_counter()
        stats.round_trips += 1
        self.send(pb.LookaheadRequest(open=opening))
        self._steps = transport.stub.Lookahead(iter(self._requests.get, None),
                                               timeout=transport.timeout_s,
                                               metadata=transport.metadata)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._reader = threading.Thread(target=self._read, name="lookahead-reader",
                                        daemon=True)
        self._reader.start()

    def send(self, request: pb.LookaheadRequest) -> None:
        self._stats.bytes_up += request.ByteSize()
        if self._t.rtt_s:
            threading.Timer(self._t.rtt_s / 2, self._requests.put, (request,)).start()
        else:
            self._requests.put(request)

    def _read(self) -> None:
        try:
            for step in self._steps:
                self._inbox.put((time.perf_counter() + self._t.rtt_s / 2, step))
            self._inbox.put(None)
        except grpc.RpcError as err:
            self._inbox.put(err)

    def __iter__(self) -> Iterator[pb.LookaheadStep]:
        try:
            while (item := self._inbox.get()) is not None:
                if isinstance(item, grpc.RpcError):
                    raise item
                at, step = item
                if (wait := at - time.perf_counter()) > 0:
                    time.sleep(wait)
                self._stats.bytes_down += step.ByteSize()
                yield step
        finally:
            self._stats.call_s += time.perf_counter() - self._started

    def end(self) -> None:
        self._requests.put(None)
        self._steps.cancel()
