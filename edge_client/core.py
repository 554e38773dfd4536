"""The client core: one generation against a verifier, surviving faults on the way.

Both the app API (edge_client.client) and the simulated fleet run this code; only the
drafting (``Propose``) and the network emulation (edge_client.link) are injected.

A generation is a sequence of attempts, each one Session stream (or, cloud-only, one
Generate stream) over everything committed so far:

- rounds: open with round 0's drafts, then one Verify round per reply; when drafting does
  not pay, a Decode has the verifier decode alone, no round trip per token;
- lookahead: open, then the verifier decodes forward after forward while the device streams
  drafts ahead of what it has received;
- cloud: Generate, the target decoding every token (the baseline).

When an attempt fails in a way retrying can fix (edge_client.connection), the generation
waits as the server asks (or backs off with jitter) and reopens with its committed context;
after a lost connection it first checks with GetInfo that the verifier still serves the
same target. The output is unchanged (edge_client.generation_state). Leaving the generation
early, or cancelling its task, cancels the stream, which closes the server's session at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import asdict, dataclass, field

import grpc
import numpy as np

from edge_client.connection import (
    Backoff,
    Connection,
    is_retryable,
    lost_connection,
    new_routing_key,
)
from edge_client.drafter import ModelDrafter, Proposal, Spell
from edge_client.errors import IncompatibleVerifier, VerifierUnavailable
from edge_client.generation_state import (
    CLOUD,
    LOOKAHEAD,
    NO_DRAFTS,
    ROUNDS,
    GenerationState,
    ProtocolError,
)
from edge_client.link import until
from edge_client.rate_chooser import CONTINUE, SPEC
from edge_client.session_streams import AttemptStream, KeptStream, SessionKeeper
from shared.decode_rule import ends_decode
from shared.errors import ErrorDetails, details_of
from shared.pb import verifier_pb2 as pb

log = logging.getLogger(__name__)

# Drafts k tokens after the committed ids (k = 0 only resyncs the draft's cache).
# propose(context, k, spell): k drafts after context; spell (token healing) as ModelDrafter's.
Propose = Callable[[list[int], int, "Spell | None"], Awaitable[Proposal]]
# How long the core waits for the verifier to end a finished stream before cancelling it.
_END_GRACE_S = 2.0
# What a generation does when the verifier is away or too slow: fail (retry, then raise
# VerifierUnavailable), or go on with the draft alone, its tokens marked unverified.
FAIL = "fail"
DRAFT_ONLY = "draft-only"
FALLBACKS = (FAIL, DRAFT_ONLY)


@dataclass
class GenerationStats:
    new_tokens: int = 0
    rounds: int = 0  # steps: target forwards that committed tokens for this generation
    drafted: int = 0
    accepted: int = 0
    round_trips: int = 0
    target_forwards: int = 0
    bytes_up: int = 0  # serialized protobuf bytes sent
    bytes_down: int = 0  # serialized protobuf bytes received
    feature_bytes: int = 0  # of bytes_down: the target features (Step.feature)
    reopens: int = 0
    # Draft-only fallback: tokens the draft proposed alone while the verifier was away,
    # those still unverified at the end, and those the verifier then replaced.
    drafted_alone: int = 0
    unverified_tokens: int = 0
    replaced_tokens: int = 0
    # Positions the verifier's forwards fed for this generation (Step.fed_tokens).
    fed_tokens: int = 0
    # Editing sessions: steps of superseded suggestions that arrived and were dropped.
    stale_steps: int = 0
    # The status of every attempt lost (whether it was retried or ended the generation),
    # by code name: what a load test reports as errors.
    lost_attempts: dict[str, int] = field(default_factory=dict)
    draft_s: float = 0.0
    wait_s: float = 0.0  # waiting for replies (network + the server's queue and forwards)
    verify_s: float = 0.0  # the server's own queue + forward time
    backoff_s: float = 0.0
    wall_s: float = 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_round(self) -> float:
        return self.new_tokens / self.rounds if self.rounds else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["network_s"] = max(0.0, self.wait_s - self.verify_s)
        d["acceptance_rate"] = self.acceptance_rate
        d["tokens_per_round"] = self.tokens_per_round
        d["tokens_per_s"] = self.new_tokens / self.wall_s if self.wall_s else 0.0
        return d


@dataclass(frozen=True)
class Delivery:
    """Tokens the device has, from one target forward, with the costs charged to them."""

    tokens: list[int]
    at: float  # when the device has them (time.perf_counter(), after any emulated delay)
    drafted: int
    accepted: int
    forwards: int
    queue_s: float
    forward_s: float
    round_trips: int  # since the previous delivery, failed attempts included
    bytes_up: int
    bytes_down: int
    decoded: bool = False  # from a Decode: the verifier decoded alone
    # False: drafted on the device alone (draft-only fallback), not verified yet.
    verified: bool = True
    # Unverified tokens at the end of what was delivered before that this delivery takes
    # back (they are verified now: kept ones come again in ``tokens``, the rest replaced).
    replaces: int = 0


class _Wire:
    """One generation's messages through the connection and its link, with accounting."""

    def __init__(self, conn: Connection, stats: GenerationStats, routing_key: str) -> None:
        self.conn = conn
        self.stats = stats
        self.metadata = conn.metadata(routing_key)
        self.pending = [0, 0, 0]  # round trips, bytes up, bytes down not yet delivered

    def session(self):
        return self.conn.stub.Session(timeout=self.conn.deadlines.stream_s,
                                      metadata=self.metadata)

    async def send(self, message, round_trip: bool) -> None:
        """Accounts for a message and lets the (emulated) network carry it."""
        size = message.ByteSize()
        self._count(round_trip, size, 0)
        await self.conn.link.send(size)

    async def write(self, call, message, round_trip: bool) -> None:
        await self.send(message, round_trip)
        try:
            await call.write(message)
        except asyncio.InvalidStateError:
            # The verifier ended the stream first (an eviction while we drafted, a drain):
            # reading raises its status.
            await call.read()
            raise ProtocolError("the verifier ended the stream before the generation "
                                "finished") from None

    async def read(self, call):
        """The next message and when the device has it; None at the stream's end."""
        t0 = time.perf_counter()
        try:
            # asyncio.timeout, not wait_for: wait_for can swallow a cancellation that
            # arrives together with a result (Python 3.11), and cancel() must always win.
            async with asyncio.timeout(self.conn.deadlines.reply_s):
                message = await call.read()
        finally:
            self.stats.wait_s += time.perf_counter() - t0
        if message is grpc.aio.EOF:
            return None, time.perf_counter()
        return message, self.arrived(message)

    def arrived(self, message) -> float:
        size = message.ByteSize()
        self._count(False, 0, size)
        return self.conn.link.arrival(size)

    def _count(self, round_trip: bool, up: int, down: int) -> None:
        s, p = self.stats, self.pending
        s.round_trips += round_trip
        s.bytes_up += up
        s.bytes_down += down
        p[0] += round_trip
        p[1] += up
        p[2] += down

    def deliver(self, state: GenerationState, step: pb.Step, proposal: Proposal | None,
                at: float, decoded: bool = False) -> Delivery:
        shown = state.num_unverified
        new = state.apply(step, proposal)
        s = self.stats
        s.rounds += 1
        s.new_tokens += len(new)
        s.drafted += step.num_drafted
        s.accepted += step.num_accepted
        s.target_forwards += step.target_forwards
        s.fed_tokens += step.fed_tokens
        if step.HasField("feature"):
            s.feature_bytes += step.feature.ByteSize()
        queue_s, forward_s = step.timing.queue_ns / 1e9, step.timing.forward_ns / 1e9
        s.verify_s += queue_s + forward_s
        (rt, up, down), self.pending = self.pending, [0, 0, 0]
        s.replaced_tokens = state.replaced
        return Delivery(new, at, step.num_drafted, step.num_accepted, step.target_forwards,
                        queue_s, forward_s, rt, up, down, decoded, replaces=shown)

    async def end(self, call) -> None:
        """Half-closes a finished stream and lets the verifier end it with its status."""
        with contextlib.suppress(grpc.aio.AioRpcError, TimeoutError):
            await call.done_writing()
            async with asyncio.timeout(_END_GRACE_S):
                while await call.read() is not grpc.aio.EOF:
                    pass


async def generate(conn: Connection, state: GenerationState, propose: Propose,
                   stats: GenerationStats, info: pb.GetInfoResponse,
                   rng: np.random.Generator,
                   routing_key: str | None = None,
                   keeper: SessionKeeper | None = None,
                   fallback: str = FAIL) -> AsyncIterator[Delivery]:
    """Runs one generation to its end, yielding each forward's tokens as the device has them.
    With ``keeper`` (an editable ``state``), one suggestion of a document, on its kept
    session; cancelling it stops the suggestion on the verifier and keeps the session.

    ``fallback=DRAFT_ONLY``: when an attempt is lost (the verifier unreachable, or no reply
    within the reply deadline), the draft goes on alone and its tokens are delivered marked
    unverified while the generation retries; the first attempt that gets through verifies
    them as its first drafts, and its delivery ``replaces`` them (what the verifier did not
    accept is replaced, ``GenerationStats.replaced_tokens``). Past the retry budget the
    generation ends with them unverified instead of raising VerifierUnavailable.

    ``routing_key`` goes with every call of the generation (a gateway hashes it to pick a
    replica); None draws a fresh one. An app passes one key for all the generations over one
    document (``connection.document_routing_key``) so that they meet their prefix cache.

    Raises RequestRejected (a refusal retrying cannot fix), VerifierUnavailable (no progress
    within the retry budget), IncompatibleVerifier (a restarted verifier serves another
    target) or ProtocolError (a reply inconsistent with the request).
    """
    if keeper is not None:
        if not state.editable:
            raise ValueError("a kept session needs an editable generation state")
        wire = keeper.stream.wire if keeper.stream is not None else _Wire(
            conn, stats, keeper.routing_key)
        wire.stats = stats
        wire.pending = [0, 0, 0]

        def attempt_of(wire, state, propose):
            return _rounds(wire, state, propose, keeper)
    else:
        wire = _Wire(conn, stats, routing_key or new_routing_key())
        attempt_of = {CLOUD: _cloud, LOOKAHEAD: _lookahead}.get(state.protocol, _rounds)
    if fallback not in FALLBACKS:
        raise ValueError(f"fallback must be one of {', '.join(FALLBACKS)}")
    draft_only = fallback == DRAFT_ONLY and state.protocol == ROUNDS
    stop_ids = frozenset(state.params.stop_token_ids or (
        () if state.params.ignore_eos else info.eos_token_ids))
    backoff = Backoff(conn.retry, rng)
    recheck = False
    started = time.perf_counter()
    try:
        while not state.finished:
            before = len(state.committed)
            try:
                if recheck:
                    await _check_same_target(wire, info, state.want_feature)
                    recheck = False
                async with contextlib.aclosing(attempt_of(wire, state, propose)) as attempt:
                    async for delivery in attempt:
                        backoff.progress()
                        yield delivery
                        if delivery.replaces and state.unverified is not None:
                            # What is still unverified after the resync, shown again.
                            yield unverified_delivery(state.unverified.tokens)
                continue
            except grpc.aio.AioRpcError as err:
                details = details_of(err)
            except TimeoutError:
                details = ErrorDetails(grpc.StatusCode.DEADLINE_EXCEEDED, None, None,
                                       f"no reply within {conn.deadlines.reply_s} s", {})
            name = details.code.name
            stats.lost_attempts[name] = stats.lost_attempts.get(name, 0) + 1
            if len(state.committed) > before:
                backoff.progress()
            log.info("generation interrupted after %d tokens (%s %s: %s); reopening",
                     len(state.generated), details.code.name, details.reason or "-",
                     details.message)
            if draft_only and is_retryable(details):
                async for delivery in draft_alone(state, propose, stop_ids, stats):
                    yield delivery
            try:
                await backoff.wait(details)
            except VerifierUnavailable:
                if not (draft_only and state.unverified is not None):
                    raise
                log.warning("the verifier stayed away; %d tokens stay unverified",
                            state.num_unverified)
                return
            recheck = recheck or lost_connection(details)
            state.reopens += 1
            stats.reopens += 1
    finally:
        stats.backoff_s += backoff.waited_s
        stats.wall_s = time.perf_counter() - started
        stats.unverified_tokens = state.num_unverified


def unverified_delivery(tokens: list[int]) -> Delivery:
    return Delivery(list(tokens), time.perf_counter(), 0, 0, 0, 0.0, 0.0, 0, 0, 0,
                    verified=False)


async def draft_alone(state: GenerationState, propose: Propose, stop_ids: frozenset[int],
                       stats: GenerationStats,
                       until: Callable[[], bool] | None = None) -> AsyncIterator[Delivery]:
    """The draft-only fallback: the round that was lost becomes unverified (it was drafted
    after the committed text), then the draft proposes alone, a round's worth at a time,
    until the generation's room is used, it proposes a stop token, or ``until()`` (checked
    between proposals: the verifier is back) is true."""
    lost, state.pending = state.pending, None
    if lost is not None and lost.tokens and state.unverified is None:
        state.add_unverified(cut_at_stop(lost, stop_ids))
        stats.drafted_alone += len(state.unverified.tokens)
        yield unverified_delivery(state.unverified.tokens)
    while (room := state.unverified_room()) > 0 and not (until is not None and until()):
        shown = state.unverified.tokens if state.unverified is not None else []
        if shown and shown[-1] in stop_ids:
            return
        k = min(room, max(1, state.limits.max_draft_len))
        proposal = cut_at_stop(await propose(state.committed + shown, k, state.spell(shown)),
                                stop_ids)
        if not proposal.tokens:
            return
        state.add_unverified(proposal)
        stats.drafted_alone += len(proposal.tokens)
        yield unverified_delivery(proposal.tokens)


def cut_at_stop(proposal: Proposal, stop_ids: frozenset[int]) -> Proposal:
    """The proposal up to and with its first stop token."""
    for i, token in enumerate(proposal.tokens):
        if token in stop_ids:
            return proposal.prefix(i + 1)
    return proposal


async def _check_same_target(wire: _Wire, info: pb.GetInfoResponse, features: bool) -> None:
    """After a lost connection: the verifier still serves the same tokenizer, and, for a
    generation drafting from its features, the same features (a restart may have brought
    another target, or none)."""
    now = await wire.conn.stub.GetInfo(pb.GetInfoRequest(), timeout=wire.conn.deadlines.call_s,
                                       metadata=wire.metadata)
    if (now.tokenizer_fingerprint, now.vocab_size) != (info.tokenizer_fingerprint,
                                                       info.vocab_size):
        raise IncompatibleVerifier(f"the verifier at {wire.conn.address} now serves "
                                   f"{now.target_model!r}, whose tokenizer differs from the "
                                   "one this generation started with")
    if features and now.feature != info.feature:
        raise IncompatibleVerifier(f"the verifier at {wire.conn.address} now serves other "
                                   f"target features ({now.feature or 'none'}) than this "
                                   "generation's feature head reads")


async def _rounds(wire: _Wire, state: GenerationState, propose: Propose,
                  keeper: SessionKeeper | None = None) -> AsyncIterator[Delivery]:
    """One Session stream of Verify rounds (and Decodes); with ``keeper``, one suggestion of
    an editable session, on the kept stream if one is open."""
    reuse = keeper is not None and keeper.stream is not None
    if keeper is None:
        io = AttemptStream(wire)
    elif reuse:
        io = keeper.stream
    else:
        io = keeper.stream = KeptStream(wire)
    keep = False
    try:
        first = state.resync_proposal() if reuse else state.reopen_first()
        if first is None:
            first = state.worth_sending(await propose(state.committed, state.next_k(),
                                                      state.spell()))
        await io.write(state.verify_message(first) if reuse else state.open_message(first))
        yield await _answer(io, state, first)
        while not state.finished:
            t0 = time.perf_counter()
            before = len(state.committed)
            if state.wants_decode():
                message = state.decode_message()
                await io.write(message)
                while True:
                    reply, at = await io.read(state)
                    step = _step_of(reply)
                    await until(at)
                    yield wire.deliver(state, step, NO_DRAFTS, at, decoded=True)
                    if ends_decode(message.decode, step):
                        break
                state.observe(CONTINUE, len(state.committed) - before, time.perf_counter() - t0)
                continue
            proposal = state.resync_proposal()
            if proposal is None:
                proposal = state.worth_sending(await propose(state.committed, state.next_k(),
                                                             state.spell()))
            t0 = time.perf_counter()
            await io.write(state.verify_message(proposal))
            yield await _answer(io, state, proposal)
            state.observe(SPEC, len(state.committed) - before, time.perf_counter() - t0)
        await io.finish()
        keep = True
    except (asyncio.CancelledError, GeneratorExit):
        if isinstance(io, KeptStream) and io.started:
            # A keystroke: stop the suggestion, keep the session.
            io.write_soon(state.cancel_message())
            keep = True
        raise
    finally:
        if not keep:
            io.close()
            if keeper is not None and keeper.stream is io:
                keeper.stream = None
        elif keeper is None:
            io.close()


async def _answer(io, state: GenerationState, proposal: Proposal) -> Delivery:
    reply, at = await io.read(state)
    step = _step_of(reply)
    await until(at)
    return io.wire.deliver(state, step, proposal, at)


def _step_of(reply) -> pb.Step:
    if reply is None:
        raise ProtocolError("the verifier ended the stream before the generation finished")
    return reply.step


class _Outbox:
    """The next lookahead to send: a newer one replaces one not yet sent."""

    def __init__(self) -> None:
        self._message = None
        self._ready = asyncio.Event()

    def put(self, message) -> None:
        self._message = message
        self._ready.set()

    async def get(self):
        await self._ready.wait()
        self._ready.clear()
        message, self._message = self._message, None
        return message


async def _lookahead(wire: _Wire, state: GenerationState,
                     propose: Propose) -> AsyncIterator[Delivery]:
    """One Session stream in lookahead mode: the verifier decodes back to back; after each
    step the device drafts ahead of what it has and sends that lookahead, without waiting."""
    first = await propose(state.committed, state.lookahead_len(opening=True), None)
    call = wire.session()
    outbox, inbox = _Outbox(), asyncio.Queue()

    async def send() -> None:
        while (message := await outbox.get()) is not None:
            await wire.write(call, message, round_trip=False)

    async def receive() -> None:
        # Read as soon as gRPC has a message, so that emulated delivery times are exact.
        try:
            while (message := await call.read()) is not grpc.aio.EOF:
                inbox.put_nowait((wire.arrived(message), message))
            inbox.put_nowait(None)
        except grpc.aio.AioRpcError as err:
            inbox.put_nowait(err)

    tasks: list[asyncio.Task] = []
    try:
        await wire.write(call, state.open_message(first), round_trip=True)
        tasks = [asyncio.ensure_future(send()), asyncio.ensure_future(receive())]
        while not state.finished:
            t0 = time.perf_counter()
            try:
                async with asyncio.timeout(wire.conn.deadlines.reply_s):
                    item = await inbox.get()
            finally:
                wire.stats.wait_s += time.perf_counter() - t0
            if isinstance(item, grpc.aio.AioRpcError):
                raise item
            if item is None:
                raise ProtocolError("the verifier ended the stream before the generation "
                                    "finished")
            at, reply = item
            await until(at)
            yield wire.deliver(state, reply.step, None, at)
            if not state.finished and (k := state.lookahead_len()):
                outbox.put(state.lookahead_message(await propose(state.committed, k, None)))
        outbox.put(None)
        with contextlib.suppress(TimeoutError, grpc.aio.AioRpcError, asyncio.InvalidStateError):
            async with asyncio.timeout(_END_GRACE_S):
                await tasks[0]
        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
            await call.done_writing()
        await asyncio.wait([tasks[1]], timeout=_END_GRACE_S)
    finally:
        call.cancel()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _cloud(wire: _Wire, state: GenerationState,
                 propose: Propose) -> AsyncIterator[Delivery]:
    """One Generate stream: the target decodes every token (no drafts)."""
    request = state.generate_request()
    wire._count(True, request.ByteSize(), 0)
    await wire.conn.link.send(request.ByteSize())
    call = wire.conn.stub.Generate(request, timeout=wire.conn.deadlines.stream_s,
                                   metadata=wire.metadata)
    try:
        while not state.finished:
            reply, at = await wire.read(call)
            step = _step_of(reply)
            await until(at)
            yield wire.deliver(state, step, None, at)
    finally:
        call.cancel()


def model_proposer(drafter, stats: GenerationStats,
                   lock: threading.Lock | None = None) -> Propose:
    """Drafts with ``drafter`` (edge_client.combined_drafter.Drafter) in a worker thread, so
    that the event loop keeps reading the stream (onnxruntime releases the GIL).

    A cancelled await leaves its thread running; ``lock`` (one per drafter, for proposers
    that share it) makes the next proposal wait for it, so that the draft's cache is used by
    one proposal at a time."""
    lock = lock or threading.Lock()

    spells = isinstance(drafter, ModelDrafter)  # others are cut by the state (spellable)

    def locked(committed: list[int], k: int, spell: Spell | None) -> Proposal:
        with lock:
            return drafter.propose(committed, k, spell) if spells and spell is not None \
                else drafter.propose(committed, k)

    async def propose(committed: list[int], k: int, spell: Spell | None = None) -> Proposal:
        t0 = time.perf_counter()
        try:
            return await asyncio.to_thread(locked, list(committed), k, spell)
        finally:
            stats.draft_s += time.perf_counter() - t0

    return propose
