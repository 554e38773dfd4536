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
from edge_client.wire import END_GRACE_S, Delivery, GenerationStats, Wire
from shared.decode_rule import ends_decode
from shared.errors import ErrorDetails, details_of
from shared.pb import verifier_pb2 as pb

log = logging.getLogger(__name__)

# Drafts k tokens after the committed ids (k = 0 only resyncs the draft's cache).
# propose(context, k, spell): k drafts after context; spell (token healing) as ModelDrafter's.
Propose = Callable[[list[int], int, "Spell | None"], Awaitable[Proposal]]
# What a generation does when the verifier is away or too slow: fail (retry, then raise
# VerifierUnavailable), or go on with the draft alone, its tokens marked unverified.
FAIL = "fail"
DRAFT_ONLY = "draft-only"
FALLBACKS = (FAIL, DRAFT_ONLY)


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
        wire = keeper.stream.wire if keeper.stream is not None else Wire(
            conn, stats, keeper.routing_key)
        wire.stats = stats
        wire.pending = [0, 0, 0]

        def attempt_of(wire, state, propose):
            return _rounds(wire, state, propose, keeper)
    else:
        wire = Wire(conn, stats, routing_key or new_routing_key())
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


async def _check_same_target(wire: Wire, info: pb.GetInfoResponse, features: bool) -> None:
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


async def _rounds(wire: Wire, state: GenerationState, propose: Propose,
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


async def _lookahead(wire: Wire, state: GenerationState,
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
            async with asyncio.timeout(END_GRACE_S):
                await tasks[0]
        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
            await call.done_writing()
        await asyncio.wait([tasks[1]], timeout=END_GRACE_S)
    finally:
        call.cancel()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _cloud(wire: Wire, state: GenerationState,
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
