"""The gRPC Verifier service: authenticate, validate, run the round, convert the reply.

Protobuf stops here: handlers turn requests into domain objects (cloud_verifier.wire), run
them against the session store and the engine, and turn the result back. Every domain error
becomes a status code with the error's message; anything unexpected becomes INTERNAL and
closes only the session it happened in.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import hmac
import itertools
import logging
from dataclasses import dataclass

import grpc

from cloud_verifier.batcher import RoundAbandoned, RoundBatcher, Ticket
from cloud_verifier.config import VerifierConfig, key_digest
from cloud_verifier.draft_policy import (
    PROBE_EVERY,
    VerifyCostModel,
    draft_token_cost,
    suggest_draft_len,
)
from cloud_verifier.engine import NO_DRAFT, DraftRound, VerifierEngine
from cloud_verifier.errors import (
    ContextTooLong,
    Draining,
    InvalidRequest,
    KVCacheFull,
    Overloaded,
    RoundOutOfOrder,
    SessionNotFound,
    TooManySessions,
    Unauthenticated,
    VerifierError,
)
from cloud_verifier.lookahead import Lookahead, fresh_drafts
from cloud_verifier.metrics import VerifierMetrics
from cloud_verifier.prefix_cache import PrefixCache
from cloud_verifier.sessions import RoundResult, Session, SessionStore, short_id
from cloud_verifier.wire import (
    Limits,
    OpenParams,
    draft_digest,
    parse_draft,
    parse_generate,
    parse_lookahead,
    parse_open,
    parse_session_id,
    result_to_pb,
)
from shared.continue_stream import ends_stream
from shared.draft_length import worth_verifying
from shared.pb import verifier_pb2 as pb
from shared.pb import verifier_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

PROTOCOL_VERSION = "edgespec.v1"
# Back-off hint sent with RESOURCE_EXHAUSTED.
RETRY_AFTER_MS = 200
# After a Lookahead stream's last step, how long the server waits for the client to end it.
HALF_CLOSE_GRACE_S = 5.0
# A K = 0 round (Generate, Continue) is identified like an empty Verify draft so that a
# client may retry a missed one either way.
_NO_DRAFT_DIGEST = draft_digest(pb.Draft())

_STATUS = {
    InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,
    ContextTooLong: grpc.StatusCode.OUT_OF_RANGE,
    SessionNotFound: grpc.StatusCode.NOT_FOUND,
    RoundOutOfOrder: grpc.StatusCode.FAILED_PRECONDITION,
    TooManySessions: grpc.StatusCode.RESOURCE_EXHAUSTED,
    KVCacheFull: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Overloaded: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Draining: grpc.StatusCode.UNAVAILABLE,
    Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
}


@dataclass(frozen=True)
class ModelInfo:
    name: str
    vocab_size: int
    tokenizer_fingerprint: str
    eos_token_ids: tuple[int, ...]


class _Aborted(Exception):
    """Carries a status out of a handler body."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def _to_status(exc: Exception) -> _Aborted:
    if isinstance(exc, VerifierError):
        return _Aborted(_STATUS[type(exc)], str(exc))
    log.exception("internal error")
    return _Aborted(grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}")


@contextlib.asynccontextmanager
async def _statuses(service: VerifierService, context):
    """Turns any failure inside into a status on ``context`` (and a metric)."""
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - every failure becomes a status
        aborted = _to_status(exc)
        service.metrics.rejected_requests.labels(aborted.code.name).inc()
        if aborted.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            context.set_trailing_metadata((("retry-after-ms", str(RETRY_AFTER_MS)),))
        await context.abort(aborted.code, str(aborted))


def _unary(handler):
    @functools.wraps(handler)
    async def wrapper(self: VerifierService, request, context: grpc.aio.ServicerContext):
        async with _statuses(self, context):
            return await handler(self, request, context)
    return wrapper


def _on_stream(message, kind: str, session_id: str):
    """A verify / continue_decoding message on a Session stream, bound to its session."""
    if not session_id:
        raise InvalidRequest("the first message on a stream must be open")
    if message.session_id and message.session_id != session_id:
        raise InvalidRequest(f"{kind}.session_id differs from the stream's session; leave "
                             "it empty on a stream")
    message.session_id = session_id
    return message


class VerifierService(pb_grpc.VerifierServicer):
    def __init__(self, engine: VerifierEngine, config: VerifierConfig, info: ModelInfo,
                 metrics: VerifierMetrics) -> None:
        self.engine = engine
        self.config = config
        self.info = info
        self.metrics = metrics
        self.prefix_cache = PrefixCache(engine.kv, config.prefix_cache_bytes,
                                        config.session_ttl_s)
        self.store = SessionStore(config.max_sessions, config.session_ttl_s,
                                  on_close=self._retire_kv)
        self.limits = Limits(info.vocab_size, config.max_draft_len, engine.max_context)
        self.draining = False
        self._background: set[asyncio.Task] = set()
        # Rounds of all sessions queue here and share forwards.
        self.batcher = RoundBatcher(engine, metrics, config.max_batch_tokens,
                                    config.gather_window_s, config.max_queued_rounds,
                                    self._evict_idle,
                                    cost_model=VerifyCostModel(config.verify_session_cost,
                                                               config.verify_token_cost,
                                                               fit=config.fit_verify_cost),
                                    holders=self.store.holding_kv, kv_wait_s=config.kv_wait_s)

    # -- handlers ---------------------------------------------------------------------------

    @_unary
    async def GetInfo(self, request: pb.GetInfoRequest, context) -> pb.GetInfoResponse:
        self._caller(context)
        return pb.GetInfoResponse(
            protocol_version=PROTOCOL_VERSION, target_model=self.info.name,
            vocab_size=self.info.vocab_size,
            tokenizer_fingerprint=self.info.tokenizer_fingerprint,
            max_draft_len=self.config.max_draft_len, max_context=self.engine.max_context,
            modes=["greedy", "sampling"], eos_token_ids=list(self.info.eos_token_ids))

    @_unary
    async def OpenSession(self, request: pb.OpenSessionRequest,
                          context) -> pb.OpenSessionResponse:
        return await self._open(request, self._caller(context))

    @_unary
    async def Verify(self, request: pb.VerifyRequest, context) -> pb.VerifyResponse:
        return await self._verify(request, self._caller(context))

    @_unary
    async def CloseSession(self, request: pb.CloseSessionRequest,
                           context) -> pb.CloseSessionResponse:
        session = self.store.get(parse_session_id(request.session_id), self._caller(context))
        async with session.lock:
            self._close(session)
        return pb.CloseSessionResponse(committed_length=len(session.committed))

    async def Session(self, request_iterator, context):
        """One session per stream; the stream's end closes the session."""
        session_id = owner = ""
        try:
            async with _statuses(self, context):
                owner = self._caller(context)
                async for request in request_iterator:
                    kind = request.WhichOneof("kind")
                    if kind == "open":
                        if session_id:
                            raise InvalidRequest("this stream already has a session; "
                                                 "send verify messages or open a new stream")
                        opened = await self._open(request.open, owner)
                        session_id = opened.session_id
                        yield pb.SessionResponse(opened=opened)
                    elif kind == "verify":
                        verify = _on_stream(request.verify, kind, session_id)
                        verified = await self._verify(verify, owner)
                        yield pb.SessionResponse(verified=verified)
                        if verified.result.finished or verify.close:
                            session_id = ""
                    elif kind == "continue_decoding":
                        cont = _on_stream(request.continue_decoding, kind, session_id)
                        session = self.store.get(session_id, owner)
                        async for result in self._continue(session, cont):
                            yield pb.SessionResponse(continued=result)
                            if result.finished:
                                session_id = ""
                    else:
                        raise InvalidRequest("empty SessionRequest: set open or verify")
        finally:
            if session_id:  # the stream ended first: close once no round is running
                self._spawn(self._close_when_idle(session_id, owner))

    async def Generate(self, request: pb.GenerateRequest, context):
        """Cloud-only decoding: K = 0 rounds through the same batcher, one token each."""
        session = None
        try:
            async with _statuses(self, context):
                owner = self._caller(context)
                session = self._create_session(parse_generate(
                    request, self.limits, frozenset(self.info.eos_token_ids)), owner)
                session.streamed = True
                for round_no in itertools.count():
                    result = await self._round(session, round_no, NO_DRAFT, _NO_DRAFT_DIGEST,
                                               False, follow_up=True)
                    yield pb.GenerateResponse(
                        token_ids=[result.next_token], committed_length=result.committed_length,
                        finished=result.finished,
                        timing=pb.Timing(queue_ns=result.queue_ns, forward_ns=result.forward_ns))
                    if result.finished:
                        break
        finally:
            if session is not None and not session.finished:
                self._spawn(self._close_when_idle(session.id, session.owner))

    async def Continue(self, request: pb.ContinueRequest, context):
        """K = 0 rounds of a speculative session back to back, streamed as they commit."""
        async with _statuses(self, context):
            session = self.store.get(parse_session_id(request.session_id),
                                     self._caller(context))
            async for result in self._continue(session, request):
                yield result

    async def _continue(self, session: Session, request: pb.ContinueRequest):
        if request.max_tokens < 1:
            raise InvalidRequest("max_tokens must be at least 1")
        for round_no in range(request.round, request.round + request.max_tokens):
            result = result_to_pb(await self._round(session, round_no, NO_DRAFT,
                                                    _NO_DRAFT_DIGEST, False, follow_up=True))
            yield result
            if ends_stream(request, result):
                return

    async def Lookahead(self, request_iterator, context):
        """A speculative session decoded back to back, as Generate does, while the client's
        lookahead drafts stream in; each forward verifies what of the latest is still fresh."""
        session: Session | None = None
        reader: asyncio.Task | None = None
        try:
            async with _statuses(self, context):
                owner = self._caller(context)
                requests = aiter(request_iterator)
                first = await anext(requests, None)
                if first is None or first.WhichOneof("kind") != "open":
                    raise InvalidRequest("the first message on a Lookahead stream must be open")
                params = parse_open(first.open, self.limits, frozenset(self.info.eos_token_ids))
                session = self._create_session(params, owner)
                session.streamed = True
                # The latest lookahead; an open's first_draft is the first one.
                latest: list[Lookahead | None] = [
                    None if params.first_draft is None
                    else Lookahead(len(params.prompt), params.first_draft)]
                reader = self._spawn(self._read_lookaheads(requests, session, latest))
                k = self.config.max_draft_len
                token_price = self._draft_token_cost(len(self.batcher) + 1)
                for round_no in itertools.count():
                    if reader.done() and reader.exception() is not None:
                        raise reader.exception()
                    room = self.engine.max_context - len(session.committed) - 1
                    # A lookahead with confidences is cut by their worth, not by k.
                    confident = latest[0] is not None and latest[0].draft.confidence is not None
                    cap = min(self.config.max_draft_len if confident else k, room)
                    draft = fresh_drafts(latest[0], session.committed, cap)
                    label = ("fresh" if draft.tokens else
                             "none" if latest[0] is None or cap <= 0 else "stale")
                    if draft.confidence is not None:
                        draft = draft.window(0, worth_verifying(draft.confidence, token_price))
                        if not draft.tokens:
                            label = "unsure"
                    self.metrics.lookahead_forwards.labels(label).inc()
                    before = len(session.committed)
                    # No round of this stream is ever retried, so no digest identifies one.
                    result = await self._round(session, round_no, draft, b"", False,
                                               follow_up=True)
                    k = result.suggested_draft_len
                    token_price = result.draft_token_cost
                    tokens = draft.tokens[:result.num_accepted] + [result.next_token]
                    yield pb.LookaheadStep(
                        token_ids=tokens[:result.committed_length - before],
                        num_drafted=len(draft.tokens), num_accepted=result.num_accepted,
                        committed_length=result.committed_length, finished=result.finished,
                        timing=pb.Timing(queue_ns=result.queue_ns, forward_ns=result.forward_ns),
                        suggested_draft_len=result.suggested_draft_len,
                        draft_token_cost=token_price)
                    if result.finished:
                        break
                # The RPC ends once the client half-closes or hangs up (or after a grace):
                # a grpc.aio client whose lookahead write meets an RPC that already ended
                # reports INTERNAL instead of the stream's steps and status (grpc/grpc#36066).
                await asyncio.wait([reader], timeout=HALF_CLOSE_GRACE_S)
        finally:
            if reader is not None:
                reader.cancel()
            if session is not None and not session.finished:
                self._spawn(self._close_when_idle(session.id, session.owner))

    def _draft_token_cost(self, load: int) -> float:
        session_cost, token_cost = self.batcher.cost_model.relative_costs()
        return draft_token_cost(load, token_cost, session_cost)

    async def _read_lookaheads(self, requests, session: Session,
                               latest: list[Lookahead | None]) -> None:
        async for request in requests:
            if request.WhichOneof("kind") != "lookahead":
                raise InvalidRequest("a Lookahead stream carries one open message, then only "
                                     "lookahead messages")
            latest[0] = parse_lookahead(request.lookahead, self.limits, session.prompt_len,
                                        len(session.committed))

    # -- shared bodies ----------------------------------------------------------------------

    def _create_session(self, params: OpenParams, owner: str) -> Session:
        if self.draining:
            raise Draining("the verifier is shutting down; open the session on another one")
        if params.first_draft is not None:  # fail before creating anything
            self.engine.check_room(len(params.prompt), len(params.first_draft.tokens))
        session = self.store.create(owner, params.sampling, params.prompt,
                                    params.max_new_tokens, params.stop_token_ids)
        self.metrics.active_sessions.set(len(self.store))
        session.kv = self.prefix_cache.restore(owner, params.prompt)
        self.metrics.prefix_cache_queries.inc(len(params.prompt) - 1)
        if session.kv is not None:
            self.metrics.prefix_cache_hits.inc(session.kv.length)
        self.metrics.prefix_cache_bytes.set(self.prefix_cache.nbytes)
        return session

    async def _open(self, request: pb.OpenSessionRequest, owner: str) -> pb.OpenSessionResponse:
        params = parse_open(request, self.limits, frozenset(self.info.eos_token_ids))
        session = self._create_session(params, owner)
        reply = pb.OpenSessionResponse(session_id=session.id,
                                       committed_length=len(session.committed))
        if params.first_draft is not None:
            try:
                result = await self._round(session, 0, params.first_draft,
                                           params.first_draft_digest, False)
            except VerifierError:
                # The caller never learns the id of a session whose open failed: free it.
                self._spawn(self._close_when_idle(session.id, owner))
                raise
            reply.first_round.CopyFrom(result_to_pb(result))
            reply.committed_length = result.committed_length
        return reply

    async def _verify(self, request: pb.VerifyRequest, owner: str) -> pb.VerifyResponse:
        session = self.store.get(parse_session_id(request.session_id), owner)
        draft = parse_draft(request.draft, self.limits)
        result = await self._round(session, request.round, draft,
                                   draft_digest(request.draft), request.close)
        return pb.VerifyResponse(result=result_to_pb(result))

    async def _round(self, session: Session, round_no: int, draft: DraftRound, digest: bytes,
                     close: bool, follow_up: bool = False) -> RoundResult:
        """Runs one round of a session, shielded from the caller hanging up.

        The round (checks, forward, bookkeeping) runs as its own task holding the session
        lock, so a caller that goes away cannot leave the session half updated. If the
        caller goes away before the forward starts, the round is dropped unapplied.
        """
        ticket: list[Ticket] = []
        task = self._spawn(self._locked_round(session, round_no, draft, digest, close, ticket,
                                              follow_up))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if ticket:
                ticket[0].abandoned = True
            raise

    async def _locked_round(self, session: Session, round_no: int, draft: DraftRound,
                            digest: bytes, close: bool, ticket_out: list,
                            follow_up: bool) -> RoundResult:
        async with session.lock:
            last = session.last_result
            if last is not None and round_no == last.round \
                    and digest == session.last_draft_digest:
                # A retried round: the same answer, applied once.
                return dataclasses.replace(last, target_forwards=0, queue_ns=0, forward_ns=0)
            if session.evicted:
                raise SessionNotFound(
                    f"session {short_id(session.id)}... was evicted to free memory; reopen it "
                    "with its full committed context as the prompt")
            if session.finished:
                raise SessionNotFound(f"session {short_id(session.id)}... already finished")
            if round_no != session.next_round:
                raise RoundOutOfOrder(
                    f"round {round_no} is out of order: the session expects round "
                    f"{session.next_round}" + (" (a retry must resend the same draft)"
                                               if last is not None and round_no == last.round
                                               else ""))
            ticket = self.batcher.submit(session, draft, follow_up)
            ticket_out.append(ticket)
            try:
                outcome = await ticket.future
            except (VerifierError, RoundAbandoned):
                raise
            except Exception:
                log.exception("round %d of session %s failed; closing it", round_no,
                              short_id(session.id))
                self._close(session)
                raise
            session.acceptance.update(len(draft.tokens), outcome.num_accepted)
            load = max(outcome.batch_sessions, len(self.batcher) + 1)
            session_cost, token_cost = self.batcher.cost_model.relative_costs()
            suggested = suggest_draft_len(session.acceptance.alpha, load,
                                          self.config.max_draft_len, token_cost, session_cost)
            token_price = draft_token_cost(load, token_cost, session_cost)
            if suggested == 0 and round_no % PROBE_EVERY == PROBE_EVERY - 1:
                suggested = 1  # keep measuring acceptance
            result = RoundResult(
                round=round_no, num_accepted=outcome.num_accepted,
                next_token=outcome.next_token, committed_length=len(session.committed),
                finished=outcome.finished, target_forwards=1, queue_ns=ticket.queue_ns,
                forward_ns=outcome.forward_ns, suggested_draft_len=suggested,
                draft_token_cost=token_price)
            session.last_result = result
            session.last_draft_digest = digest
            self.store.touch(session)
            session.next_round = round_no + 1
            self._observe(draft, outcome, ticket.queue_ns)
            if outcome.finished or close:
                self._close(session)
            return result

    def _observe(self, draft: DraftRound, outcome, queue_ns: int) -> None:
        m = self.metrics
        m.rounds.inc()
        m.target_forwards.inc()
        m.draft_tokens.inc(len(draft.tokens))
        m.accepted_tokens.inc(outcome.num_accepted)
        for position in range(len(draft.tokens)):
            m.accepted_by_position.labels(str(position + 1)).inc(
                1 if position < outcome.num_accepted else 0)
            m.drafted_by_position.labels(str(position + 1)).inc()
        m.tokens_per_round.observe(len(outcome.committed))
        m.emitted_tokens.inc(len(outcome.committed))
        m.queue_seconds.observe(queue_ns / 1e9)
        m.forward_seconds.observe(outcome.forward_ns / 1e9)

    def _retire_kv(self, session: Session) -> None:
        """A closing session's KV buffer goes to the prefix cache, unless the session was
        evicted to free memory."""
        kv, session.kv = session.kv, None
        if kv is None:
            return
        if session.evicted:
            self.engine.kv.release(kv)
        else:
            self.prefix_cache.keep(session.owner, session.committed, kv)
        self.metrics.prefix_cache_bytes.set(self.prefix_cache.nbytes)

    def _evict_idle(self, needed: int, keep: set[str]) -> None:
        """Frees kept prefixes, then least recently used idle sessions, until ``needed`` KV
        bytes fit."""
        self.prefix_cache.free(lambda: self.engine.kv.fits(needed))
        self.metrics.prefix_cache_bytes.set(self.prefix_cache.nbytes)
        for session in self.store.idle_lru():
            if self.engine.kv.fits(needed):
                return
            if session.id in keep or session.kv is None:
                continue
            log.info("evicting session %s (%d tokens) to free KV memory",
                     short_id(session.id), len(session.committed))
            session.evicted = True
            self._close(session)
            self.metrics.evictions.labels("kv_budget").inc()

    def _spawn(self, coro) -> asyncio.Task:
        """A task the service owns: tracked until done, its outcome always consumed (the
        caller that would have awaited it may be gone), awaited at shutdown."""
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        return task

    async def finish_background(self) -> None:
        """Lets tracked tasks (rounds in flight, pending closes) end; for shutdown."""
        if self._background:
            await asyncio.wait(list(self._background), timeout=5)

    async def _close_when_idle(self, session_id: str, owner: str) -> None:
        try:
            session = self.store.get(session_id, owner)
        except SessionNotFound:
            return
        async with session.lock:
            self._close(session)

    def _close(self, session: Session) -> None:
        session.finished = True
        self.store.close(session.id)
        self.metrics.active_sessions.set(len(self.store))

    def _caller(self, context) -> str:
        """The identity sessions are bound to: an API key digest, or 'anonymous'."""
        digests = self.config.api_key_digests
        if not digests:
            return "anonymous"
        metadata = dict(context.invocation_metadata() or ())
        header = metadata.get("authorization", "")
        if not header.startswith("Bearer "):
            raise Unauthenticated("missing 'authorization: Bearer <api key>' metadata")
        digest = key_digest(header[len("Bearer "):])
        if not any(hmac.compare_digest(digest, d) for d in digests):
            raise Unauthenticated("unknown API key")
        return digest

    async def expire_forever(self, period_s: float) -> None:
        """Background sweep that frees idle sessions' KV caches."""
        while True:
            await asyncio.sleep(period_s)
            expired = self.store.expire_idle()
            if self.prefix_cache.expire():
                self.metrics.prefix_cache_bytes.set(self.prefix_cache.nbytes)
            if expired:
                self.metrics.evictions.labels("ttl").inc(expired)
                self.metrics.active_sessions.set(len(self.store))
