"""The gRPC VerifierService: GetInfo, Generate, and the Session stream's open and dispatch.

Protobuf stops here: handlers turn requests into domain objects (cloud_verifier.wire), run
them on the RoundRunner, and turn the results back. Authentication and the mapping of
errors to statuses happen around every handler (cloud_verifier.interceptors), so a handler
only raises.

Limits on a stream's life live here too: an open must come within ``open_timeout_s``; a
Verify-rounds session that sends nothing for its TTL expires; a reply left unread for
``stalled_reader_s`` closes the stream; a drain evacuates what is left at its grace's end
(cloud_verifier.stream_limits). Each ends with a reason the client acts on.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from dataclasses import dataclass

import grpc

from cloud_verifier.config import VerifierConfig
from cloud_verifier.errors import (
    Draining,
    InvalidRequest,
    SessionExpired,
    StreamIdle,
    VerifierError,
)
from cloud_verifier.interceptors import current_caller, current_routing_key, status_of
from cloud_verifier.lookahead_mode import LookaheadMode
from cloud_verifier.metrics import VerifierMetrics
from cloud_verifier.rounds import RoundRunner
from cloud_verifier.rounds_mode import RoundsMode
from cloud_verifier.session_stream import RequestReader
from cloud_verifier.sessions import Session, short_id
from cloud_verifier.stream_limits import LiveStreams, guarded
from cloud_verifier.target_engine import NO_DRAFT, TargetEngine
from cloud_verifier.wire import (
    ROUNDS,
    Limits,
    is_large,
    parse_generate,
    parse_open,
    step_to_pb,
)
from shared.pb import verifier_pb2 as pb
from shared.pb import verifier_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

PROTOCOL_VERSION = "edgespec.v1"


@dataclass(frozen=True)
class ModelInfo:
    name: str
    vocab_size: int
    tokenizer_fingerprint: str
    eos_token_ids: tuple[int, ...]


class VerifierService(pb_grpc.VerifierServiceServicer):
    def __init__(self, engine: TargetEngine, config: VerifierConfig, info: ModelInfo,
                 metrics: VerifierMetrics) -> None:
        self.engine = engine
        self.config = config
        self.info = info
        self.metrics = metrics
        self.runner = RoundRunner(engine, config, metrics)
        self.limits = Limits(info.vocab_size, config.max_draft_len, engine.max_context,
                             config.max_q_support,
                             serves_features=engine.features is not None,
                             spelling=engine.spelling)
        self._eos = frozenset(info.eos_token_ids)
        self.streams = LiveStreams()
        self._aborts: set[asyncio.Task] = set()

    # What operators and tests look at.
    @property
    def store(self):
        return self.runner.store

    @property
    def batcher(self):
        return self.runner.batcher

    @property
    def prefix_cache(self):
        return self.runner.prefix_cache

    @property
    def draining(self) -> bool:
        return self.runner.draining

    @draining.setter
    def draining(self, value: bool) -> None:
        self.runner.draining = value

    # -- handlers ---------------------------------------------------------------------------

    async def GetInfo(self, request: pb.GetInfoRequest, context) -> pb.GetInfoResponse:
        return pb.GetInfoResponse(
            protocol_version=PROTOCOL_VERSION, target_model=self.info.name,
            vocab_size=self.info.vocab_size,
            tokenizer_fingerprint=self.info.tokenizer_fingerprint,
            max_draft_len=self.config.max_draft_len, max_context=self.engine.max_context,
            modes=["greedy", "sampling"], eos_token_ids=list(self.info.eos_token_ids),
            max_q_support=self.limits.max_q_support,
            max_stop_token_ids=self.limits.max_stop_token_ids,
            max_continue_with=self.limits.max_continue_with,
            feature=None if self.engine.features is None
            else self.engine.features.capability_pb())

    async def Session(self, request_iterator, context):
        """One session per stream: the open's drafting mode runs it; the stream's end
        closes it."""
        reader = RequestReader(request_iterator)
        reader.limit_idle(self.config.open_timeout_s, self._no_open)
        try:
            with self.streams.track():
                first = await reader.get()
                if first is None or first.WhichOneof("kind") != "open":
                    raise InvalidRequest("the first message of a Session stream must be open",
                                         field="open")
                params = await self._parse(parse_open, first.open)
                session = self.runner.create_session(params, current_caller(),
                                                     current_routing_key())
                if params.drafting == ROUNDS:  # the client drives: silence is idleness
                    mode = RoundsMode
                    reader.limit_idle(self.config.session_ttl_s,
                                      lambda: self._silent_past_ttl(session))
                else:
                    mode = LookaheadMode
                    reader.limit_idle(None, self._no_open)
                try:
                    run = mode(self.runner, self.limits, session, reader,
                               params.first_draft).run()
                    async for reply in self._relay(run, session, context):
                        yield reply
                finally:
                    self.runner.close_soon(session)
        finally:
            reader.close()

    async def Generate(self, request: pb.GenerateRequest, context):
        """Cloud-only decoding: K = 0 rounds through the same batcher, one token each."""
        with self.streams.track():
            params = await self._parse(parse_generate, request)
            session = self.runner.create_session(params, current_caller(),
                                                 current_routing_key())
            session.streamed = True
            try:
                async for reply in self._relay(self._decode(session), session, context):
                    yield reply
            finally:
                self.runner.close_soon(session)

    async def _decode(self, session: Session):
        for forward in itertools.count():
            result = await self.runner.run_round(session, forward, NO_DRAFT, follow_up=True)
            yield pb.GenerateResponse(step=step_to_pb(result, suggestion=False))
            if result.finished:
                return

    # -- limits -----------------------------------------------------------------------------

    async def _parse(self, parse, msg):
        """``parse(msg)``, on a worker thread when the message is big enough that checking
        it would hold up every other call on the event loop."""
        if is_large(msg):
            return await asyncio.to_thread(parse, msg, self.limits, self._eos)
        return parse(msg, self.limits, self._eos)

    def _no_open(self) -> VerifierError:
        self.metrics.idle_streams.labels("open").inc()
        return StreamIdle(f"no open message within {self.config.open_timeout_s:g} s of the "
                          "stream's start")

    def _silent_past_ttl(self, session: Session) -> VerifierError:
        """A Verify-rounds session whose client sent nothing for its TTL: expired, as the
        sweep would have it (the same reason and reopen hint)."""
        if not session.finished:
            session.expired = True
            self.runner.close(session)
            self.metrics.evictions.labels("ttl").inc()
        self.metrics.idle_streams.labels("send").inc()
        return SessionExpired(f"session {short_id(session.id)}... sent nothing for its TTL of "
                              f"{self.config.session_ttl_s:g} s and was closed; reopen it "
                              "with its full committed context as the prompt")

    async def _relay(self, replies, session: Session, context):
        """``replies`` through the stream guard (stalled readers, drain), both closed with
        the stream."""
        async with contextlib.aclosing(replies) as replies, \
                contextlib.aclosing(self._guarded(replies, session, context)) as checked:
            async for reply in checked:
                yield reply

    def _guarded(self, replies, session: Session, context):
        def on_stall() -> None:
            self.metrics.idle_streams.labels("read").inc()
            log.info("session %s: a reply sat unread for %g s; closing its stream",
                     short_id(session.id), self.config.stalled_reader_s)
            self.runner.close_soon(session)  # its memory now, not when gRPC lets go
            self._abort(context, StreamIdle(
                f"a reply sat unread for {self.config.stalled_reader_s:g} s; the session "
                "is closed: reopen it with the committed context"))

        def draining() -> VerifierError:
            self.metrics.drained_streams.inc()
            return Draining("the verifier is shutting down; reopen the session on another "
                            "replica with its committed context")

        return guarded(replies, self.streams, self.config.stalled_reader_s, on_stall,
                       draining)

    def _abort(self, context, error: VerifierError) -> None:
        """Ends a call from outside its handler (which is stuck in gRPC's write)."""
        status = status_of(error)
        self.metrics.rejected_requests.labels(status.code.name).inc()

        async def abort() -> None:
            with contextlib.suppress(grpc.aio.AbortError, grpc.RpcError):
                await context.abort(status.code, status.details, status.trailing_metadata)

        task = asyncio.ensure_future(abort())
        self._aborts.add(task)
        task.add_done_callback(self._aborts.discard)

    # -- lifecycle --------------------------------------------------------------------------

    async def expire_forever(self, period_s: float) -> None:
        await self.runner.expire_forever(period_s)

    async def finish_background(self) -> None:
        await self.runner.finish_background()
