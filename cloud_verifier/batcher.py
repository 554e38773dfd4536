"""Continuous batching of verification rounds across sessions.

Rounds queue here. While one forward runs (on the torch thread, ``torch_thread``), new rounds
keep arriving; when it finishes, everything queued (up to ``max_batch_tokens`` new tokens)
goes into the next forward, after an optional short gather window. A round whose caller gave
up before its forward started is dropped without running.

Under KV memory pressure (``_admit``) idle sessions are evicted first, least recently used
first; then sessions are served in admission order: an older session's round may take the KV
memory of younger sessions (preemption: their cache is dropped and recomputed from their
committed tokens when they next run, which their clients cannot see), and a round that still
does not fit waits in the queue for memory, for at most ``kv_wait_s``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from cloud_verifier import torch_thread
from cloud_verifier.draft_policy import VerifyCostModel
from cloud_verifier.errors import ContextTooLong, KVCacheFull, Overloaded
from cloud_verifier.metrics import VerifierMetrics
from cloud_verifier.sessions import Session, short_id
from cloud_verifier.target_engine import DraftRound, RoundOutcome, TargetEngine

log = logging.getLogger(__name__)


class RoundAbandoned(Exception):
    """The caller went away before the round's forward started; nothing was applied."""


@dataclass
class Ticket:
    """A queued round. ``abandoned`` is set by the caller to drop it if not yet started."""

    session: Session
    draft: DraftRound
    future: asyncio.Future
    # The caller will submit this session's next round as soon as this one is answered
    # (Generate, Decode, lookahead): the batcher waits briefly for it before the next forward.
    follow_up: bool = False
    enqueued_ns: int = field(default_factory=time.perf_counter_ns)
    abandoned: bool = False
    queue_ns: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.session.committed) - self.session.cache_len + len(self.draft.tokens)


class RoundBatcher:
    def __init__(self, engine: TargetEngine, metrics: VerifierMetrics,
                 max_batch_tokens: int = 512, gather_window_s: float = 0.0,
                 max_queued_rounds: int = 256,
                 evict: Callable[[int, set[str]], None] = lambda nbytes, keep: None,
                 regather_s: float = 0.005,
                 cost_model: VerifyCostModel | None = None,
                 holders: Callable[[], list[Session]] = list,
                 kv_wait_s: float = 10.0, kv_poll_s: float = 0.01) -> None:
        self.engine = engine
        # Learns what a forward of a given shape costs from the forwards run here.
        self.cost_model = cost_model or VerifyCostModel(fit=False)
        self.metrics = metrics
        self.max_queued_rounds = max_queued_rounds
        # Frees idle sessions' KV memory: evict(bytes needed, ids of sessions to keep).
        self._evict = evict
        # Live sessions holding KV memory (candidates for preemption).
        self._holders = holders
        self.kv_wait_s = kv_wait_s
        self.kv_poll_s = kv_poll_s
        self.max_batch_tokens = max_batch_tokens
        self.gather_window_s = gather_window_s
        self.regather_s = regather_s
        self._queue: deque[Ticket] = deque()
        self._wakeup = asyncio.Event()

    def __len__(self) -> int:
        return len(self._queue)

    def queued_for(self, owner: str) -> int:
        """Rounds of ``owner``'s sessions waiting for the model (its quota)."""
        return sum(1 for ticket in self._queue if ticket.session.owner == owner)

    def submit(self, session: Session, draft: DraftRound, follow_up: bool = False) -> Ticket:
        if len(self._queue) >= self.max_queued_rounds:
            raise Overloaded(f"{len(self._queue)} rounds are queued for the model; back off "
                             "and retry")
        ticket = Ticket(session, draft, asyncio.get_running_loop().create_future(), follow_up)
        self._queue.append(ticket)
        self._wakeup.set()
        return ticket

    async def run_forever(self) -> None:
        try:
            await self._serve()
        finally:  # shutting down: rounds still queued will not run
            while self._queue:
                ticket = self._queue.popleft()
                if not ticket.future.done():
                    ticket.future.set_exception(RoundAbandoned())

    async def _serve(self) -> None:
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            while self._queue:
                if self.gather_window_s:
                    await asyncio.sleep(self.gather_window_s)
                batch = self._take()
                if batch:
                    ran = await self._run(batch)
                    if ran:
                        await self._regather(ran)
                    else:  # every round waits for KV memory: let sessions finish first
                        await self._pause(self.kv_poll_s)

    async def _pause(self, seconds: float) -> None:
        """Sleeps until a round is submitted, or ``seconds`` pass."""
        self._wakeup.clear()
        try:
            await asyncio.wait_for(self._wakeup.wait(), seconds)
        except asyncio.TimeoutError:  # noqa: UP041 - not TimeoutError on Python 3.10
            pass

    async def _regather(self, ran: list[Ticket]) -> None:
        """Waits up to ``regather_s`` for the follow-up rounds of streamed sessions that were
        just answered. Their handlers resubmit within a few event-loop turns; without this
        wait the next forward would start with whichever came back first, and streamed
        sessions would alternate between forwards instead of sharing them (measured: two
        Generate streams got no batching at all)."""
        expected = {t.session.id for t in ran if t.follow_up and not t.session.finished}
        if not expected or not self.regather_s:
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.regather_s
        while not expected <= {t.session.id for t in self._queue}:
            left = deadline - loop.time()
            if left <= 0:
                return
            self._wakeup.clear()
            try:
                await asyncio.wait_for(self._wakeup.wait(), left)
            except asyncio.TimeoutError:  # noqa: UP041 - not TimeoutError on Python 3.10
                return

    def _take(self) -> list[Ticket]:
        """Queued rounds in arrival order, within the token budget (always at least one)."""
        batch: list[Ticket] = []
        tokens = 0
        while self._queue:
            ticket = self._queue[0]
            if ticket.abandoned:
                self._queue.popleft()
                self.metrics.cancelled_rounds.inc()
                ticket.future.set_exception(RoundAbandoned())
                continue
            if batch and tokens + ticket.num_tokens > self.max_batch_tokens:
                break
            self._queue.popleft()
            batch.append(ticket)
            tokens += ticket.num_tokens
        return batch

    def _admit(self, batch: list[Ticket]) -> list[Ticket]:
        """The rounds of ``batch`` that the KV budget holds now (see the module docstring);
        the others go back to the front of the queue, or fail if they waited too long or
        could never fit."""
        engine = self.engine
        rounds = [(t.session, t.draft) for t in batch]
        needed = engine.kv_growth_bytes(rounds)
        if engine.kv.fits(needed):
            return batch
        self._evict(needed, {t.session.id for t in batch})
        if engine.kv.fits(engine.kv_growth_bytes(rounds)):
            return batch
        admitted: list[Ticket] = []
        waiting: list[Ticket] = []
        now = time.perf_counter_ns()
        for ticket in sorted(batch, key=lambda t: t.session.seq):
            if self._make_room(ticket, admitted):
                admitted.append(ticket)
                continue
            alone = engine.round_bytes(ticket.session, ticket.draft)
            if alone > engine.kv.budget_bytes:
                ticket.future.set_exception(KVCacheFull(
                    f"this round needs {alone} bytes of KV cache, more than the whole budget "
                    f"of {engine.kv.budget_bytes} bytes"))
            elif now - ticket.enqueued_ns > self.kv_wait_s * 1e9:
                ticket.future.set_exception(KVCacheFull(
                    f"the KV cache budget of {engine.kv.budget_bytes} bytes stayed in use by "
                    f"older sessions for {self.kv_wait_s:g} s; retry later"))
            else:
                waiting.append(ticket)
        # Both keep the batch's (arrival) order; waiting rounds stay ahead of newer ones.
        waits, runs = set(map(id, waiting)), set(map(id, admitted))
        self._queue.extendleft(reversed([t for t in batch if id(t) in waits]))
        return [t for t in batch if id(t) in runs]

    def _make_room(self, ticket: Ticket, admitted: list[Ticket]) -> bool:
        """Reserves the round's KV memory, preempting younger sessions (youngest first) that
        are not in ``admitted`` if that is what it takes; False, preempting no one, if even
        that would not be enough."""
        session, engine = ticket.session, self.engine
        try:
            engine.reserve(session, ticket.draft)
            return True
        except ContextTooLong:
            return True  # the forward answers it with this error
        except KVCacheFull:
            pass
        keep = {t.session.id for t in admitted} | {session.id}
        victims = sorted((v for v in self._holders()
                          if v.seq > session.seq and v.id not in keep), key=lambda v: -v.seq)
        held = session.kv.nbytes if session.kv is not None else 0
        freeable = sum(v.kv.nbytes for v in victims)
        need = engine.round_bytes(session, ticket.draft) - held
        if not engine.kv.fits(need - freeable):
            return False
        for victim in victims:
            log.info("preempting session %s (%d tokens): its KV cache goes to an older "
                     "session and is recomputed when it runs again", short_id(victim.id),
                     len(victim.committed))
            engine.release(victim)
            self.metrics.preemptions.inc()
            try:
                engine.reserve(session, ticket.draft)
                return True
            except KVCacheFull:
                continue
        return False

    async def _run(self, batch: list[Ticket]) -> list[Ticket]:
        """Runs what of ``batch`` fits in memory in one forward; returns what ran."""
        batch = self._admit(batch)
        if not batch:
            return batch
        rounds = [(t.session, t.draft) for t in batch]
        started = time.perf_counter_ns()
        for ticket in batch:
            ticket.queue_ns = started - ticket.enqueued_ns
        tokens = sum(t.num_tokens for t in batch)
        self.metrics.batch_sessions.observe(len(batch))
        self.metrics.batch_tokens.observe(tokens)
        try:
            outcomes: list[RoundOutcome | Exception] = await torch_thread.call(
                self.engine.run_batch, rounds)
        except Exception as exc:  # noqa: BLE001 - the forward failed for the whole batch
            log.exception("batched forward of %d rounds failed", len(batch))
            outcomes = [exc] * len(batch)
        else:
            self._learn_cost(len(batch), tokens, time.perf_counter_ns() - started)
        self.metrics.kv_bytes.set(self.engine.kv.bytes_in_use)
        for ticket, outcome in zip(batch, outcomes, strict=True):
            if isinstance(outcome, Exception):
                ticket.future.set_exception(outcome)
            else:
                ticket.future.set_result(outcome)
        return batch

    def _learn_cost(self, sessions: int, tokens: int, elapsed_ns: int) -> None:
        model = self.cost_model
        if model.observe(sessions, tokens, elapsed_ns / 1e9) and model.fixed_ms is not None:
            session_cost, token_cost = model.relative_costs()
            self.metrics.verify_fixed_seconds.set(model.fixed_ms / 1000)
            self.metrics.verify_session_cost.set(session_cost)
            self.metrics.verify_token_cost.set(token_cost)
