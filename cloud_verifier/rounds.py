"""Sessions and their rounds: open, run a round through the batcher, close, evict, expire.

Every mode of every stream (rounds, lookahead, Generate) runs its forwards through
``RoundRunner.run_round``, so continuous batching, the KV budget (eviction, preemption), the
prefix cache, the suggested draft length and the metrics work the same for all of them.
Nothing here knows about protobuf or gRPC.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cloud_verifier.batcher import RoundAbandoned, RoundBatcher, Ticket
from cloud_verifier.config import VerifierConfig
from cloud_verifier.draft_policy import (
    PROBE_EVERY,
    VerifyCostModel,
    draft_token_cost,
    suggest_draft_len,
)
from cloud_verifier.errors import (
    Draining,
    InvalidRequest,
    RoundOutOfOrder,
    SessionEvicted,
    SessionExpired,
    VerifierError,
)
from cloud_verifier.metrics import VerifierMetrics
from cloud_verifier.prefix_cache import PrefixCache
from cloud_verifier.quotas import QuotaExceeded, TenantQuotas, fair_share_victim
from cloud_verifier.sessions import Session, SessionStore, short_id
from cloud_verifier.target_engine import DraftRound, RoundOutcome, TargetEngine
from shared.feature_codec import EncodedFeature

if TYPE_CHECKING:
    from cloud_verifier.session_params import EditParams, OpenParams

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RoundResult:
    """Outcome of one round (the wire's Step, minus protobuf)."""

    round: int
    token_ids: list[int]  # committed by this round, cut where the generation finished
    num_drafted: int
    num_accepted: int
    committed_length: int
    finished: bool
    target_forwards: int
    queue_ns: int
    forward_ns: int
    suggested_draft_len: int = 0
    draft_token_cost: float | None = None
    suggestion: int = 0  # editable sessions: the suggestion this round belongs to
    fed_tokens: int = 0  # positions the forward fed for this session
    # Sessions that want features: the one that decided committed[feature_position].
    feature: EncodedFeature | None = None
    feature_position: int = 0


@dataclass
class _Handle:
    """A round's link to its caller: set ``abandoned`` to drop it if not yet started."""

    ticket: Ticket | None = None
    abandoned: bool = False


class RoundRunner:
    """Owns the session table, the batcher and the prefix cache of one verifier."""

    def __init__(self, engine: TargetEngine, config: VerifierConfig,
                 metrics: VerifierMetrics) -> None:
        self.engine = engine
        self.config = config
        self.metrics = metrics
        # An engine that keeps no KV here (vLLM: its own prefix cache) keeps no prefixes here.
        self.prefix_cache = PrefixCache(
            engine.kv, config.prefix_cache_bytes if engine.kv.bytes_per_token else 0,
            config.session_ttl_s)
        self.store = SessionStore(config.max_sessions, config.session_ttl_s,
                                  on_close=self._retire_kv)
        self.draining = False
        self.quotas = TenantQuotas(config.quota)
        self._background: set[asyncio.Task] = set()
        # Rounds of all sessions queue here and share forwards.
        self.batcher = RoundBatcher(engine, metrics, config.max_batch_tokens,
                                    config.gather_window_s, config.max_queued_rounds,
                                    self._evict_idle,
                                    cost_model=VerifyCostModel(config.verify_session_cost,
                                                               config.verify_token_cost,
                                                               fit=config.fit_verify_cost),
                                    holders=self.store.holding_kv, kv_wait_s=config.kv_wait_s)

    # -- sessions ---------------------------------------------------------------------------

    def create_session(self, params: OpenParams, owner: str,
                       routing_key: str | None = None) -> Session:
        """A new session, its KV seeded from the owner's prefix cache."""
        if self.draining:
            raise Draining("the verifier is shutting down; open the session on another one")
        if params.first_draft is not None:  # fail before creating anything
            self.engine.check_room(len(params.prompt), len(params.first_draft.tokens))
        max_new_tokens = self._max_new_tokens(params.max_new_tokens)
        self.expire()
        with self._counting_quota():
            self.quotas.check_session(owner, self.store.held()[owner])
        if self.store.full:
            self._evict_for(owner)
        session = self.store.create(owner, params.sampling, params.prompt,
                                    max_new_tokens, params.stop_token_ids)
        session.editable = params.editable
        session.want_feature = params.want_feature
        session.continue_with = params.continue_with
        self.metrics.active_sessions.set(len(self.store))
        session.kv = self.prefix_cache.restore(owner, params.prompt)
        self.metrics.prefix_cache_queries.inc(len(params.prompt) - 1)
        if session.kv is not None:
            self.metrics.prefix_cache_hits.inc(session.kv.length)
        self.metrics.prefix_cache_bytes.set(self.prefix_cache.nbytes)
        log.info("session %s opened: prompt %d tokens (%d cached), %s, routing key %s",
                 short_id(session.id), len(params.prompt), session.cache_len,
                 "greedy" if params.sampling.is_greedy else "sampling", routing_key or "-")
        return session

    def _max_new_tokens(self, asked: int) -> int:
        """A session's max_new_tokens under the server's cap (0 asks for the cap)."""
        cap = self.config.max_new_tokens_cap
        if cap is None:
            return asked
        if asked > cap:
            raise InvalidRequest(f"max_new_tokens {asked} is above this verifier's cap of "
                                 f"{cap}; ask for at most {cap} (0 means {cap})",
                                 field="max_new_tokens")
        return asked or cap

    def _evict_for(self, owner: str) -> None:
        """In a full table: evicts an idle session of the tenant holding the most, if that is
        fair to ``owner`` (quotas.fair_share_victim)."""
        victim = fair_share_victim(self.store.idle_lru(), self.store.held(), owner,
                                   time.monotonic())
        if victim is None:
            return
        log.info("evicting idle session %s for another tenant's new one (fair share)",
                 short_id(victim.id))
        victim.evicted = True
        self.close(victim)
        self.metrics.evictions.labels("fair_share").inc()

    @contextlib.contextmanager
    def _counting_quota(self):
        try:
            yield
        except QuotaExceeded as exc:
            self.metrics.quota_rejections.labels(exc.quota).inc()
            raise

    def close(self, session: Session) -> None:
        session.finished = True
        self.store.close(session.id)
        self.metrics.active_sessions.set(len(self.store))

    def close_soon(self, session: Session) -> None:
        """Closes a session whose stream ended: now if no round of it is running, else right
        after that round."""
        if session.lock.locked():
            self._spawn(self.close_when_idle(session))
        else:
            self.close(session)

    async def close_when_idle(self, session: Session) -> None:
        """Closes a session once its round in flight (if any) is done."""
        async with session.lock:
            self.close(session)

    def _retire_kv(self, session: Session) -> None:
        """A closing session leaves the not-speculating gauge, and its KV buffer goes to the
        prefix cache, unless the session was closed to free memory (evicted, expired)."""
        if not session.speculating:  # however it closes, it no longer counts
            session.speculating = True
            self.metrics.sessions_not_speculating.dec()
        kv, session.kv = session.kv, None
        if kv is None:
            return
        if session.evicted or session.expired:
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
            self.close(session)
            self.metrics.evictions.labels("kv_budget").inc()

    def expire(self) -> int:
        """Closes sessions idle past the TTL and drops expired prefixes."""
        expired = self.store.expire_idle()
        if self.prefix_cache.expire():
            self.metrics.prefix_cache_bytes.set(self.prefix_cache.nbytes)
        if expired:
            self.metrics.evictions.labels("ttl").inc(expired)
            self.metrics.active_sessions.set(len(self.store))
        return expired

    async def expire_forever(self, period_s: float) -> None:
        """Background sweep that frees idle sessions' KV caches."""
        while True:
            await asyncio.sleep(period_s)
            self.expire()

    # -- rounds -----------------------------------------------------------------------------

    def draft_token_cost(self, load: int) -> float:
        session_cost, token_cost = self.batcher.cost_model.relative_costs()
        return draft_token_cost(load, token_cost, session_cost)

    async def run_round(self, session: Session, round_no: int, draft: DraftRound,
                        follow_up: bool = False, edit: EditParams | None = None) -> RoundResult:
        """Runs one round of a session, shielded from the caller going away.

        The round (checks, forward, bookkeeping) runs as its own task holding the session
        lock, so a caller that goes away cannot leave the session half updated. If the
        caller goes away before the forward starts, the round is dropped unapplied (its
        ``edit``, if any, is applied all the same, first: later edits build on it).
        ``follow_up``: the caller submits the session's next round as soon as this one is
        answered (the batcher waits briefly for it).
        """
        handle = _Handle()
        task = self._spawn(self._locked_round(session, round_no, draft, handle, follow_up,
                                              edit))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            handle.abandoned = True
            if handle.ticket is not None:
                handle.ticket.abandoned = True
            raise
        except RoundAbandoned:  # not by us: the batcher stopped, the server is going down
            raise Draining("the verifier is shutting down; reopen the session on another "
                           "one") from None

    async def _locked_round(self, session: Session, round_no: int, draft: DraftRound,
                            handle: _Handle, follow_up: bool,
                            edit: EditParams | None) -> RoundResult:
        async with session.lock:
            with self._counting_quota():
                await self.quotas.pace(session.owner)
            if edit is not None:
                self._check_alive(session)
                self.apply_edit(session, edit)
            if handle.abandoned:
                self.metrics.cancelled_rounds.inc()
                raise RoundAbandoned()
            self._check_open(session, round_no)
            with self._counting_quota():
                self.quotas.check_round(session.owner, self.batcher.queued_for(session.owner))
            ticket = self.batcher.submit(session, draft, follow_up)
            handle.ticket = ticket
            self.quotas.charge(session.owner, ticket.num_tokens)
            try:
                outcome = await ticket.future
            except (VerifierError, RoundAbandoned):
                raise
            except Exception:
                self.close(session)  # a bug: only this session goes (the caller logs it)
                raise
            result = self._account(session, round_no, draft, outcome, ticket.queue_ns)
            if outcome.finished and not session.editable:
                self.close(session)
            return result

    def apply_edit(self, session: Session, edit: EditParams) -> None:
        """Starts the suggestion ``edit`` opens, over the edited text."""
        sid = short_id(session.id)
        if not session.editable:
            raise RoundOutOfOrder(f"session {sid}... was not opened editable; it takes no edits")
        if edit.suggestion <= session.suggestion:
            raise RoundOutOfOrder(f"edit starts suggestion {edit.suggestion}; the session is "
                                  f"at suggestion {session.suggestion} already")
        if edit.keep > len(session.committed):
            raise InvalidRequest(f"verify.edit.keep_length {edit.keep} is beyond the "
                                 f"{len(session.committed)} committed tokens",
                                 field="verify.edit.keep_length")
        self.engine.apply_edit(session, edit.keep, edit.append)
        session.prompt_len = len(session.committed)
        session.max_new_tokens = edit.max_new_tokens
        session.continue_with = edit.continue_with
        session.suggestion = edit.suggestion
        session.next_round = 0
        session.finished = False
        self.metrics.edits.inc()
        self.metrics.edit_kept_tokens.inc(edit.keep)

    def _check_open(self, session: Session, round_no: int) -> None:
        self._check_alive(session)
        sid = short_id(session.id)
        if session.finished:
            raise RoundOutOfOrder(f"session {sid}... has finished; " + (
                "start the next suggestion with an edit" if session.editable
                else "half-close the stream"))
        if round_no != session.next_round:
            raise RoundOutOfOrder(f"round {round_no} is out of order: the session expects "
                                  f"round {session.next_round}")

    def _check_alive(self, session: Session) -> None:
        sid = short_id(session.id)
        if session.expired:
            raise SessionExpired(f"session {sid}... sat idle past its TTL of "
                                 f"{self.config.session_ttl_s:g} s and was closed; reopen it "
                                 "with its full committed context as the prompt")
        if session.evicted:
            raise SessionEvicted(f"session {sid}... was evicted to free memory; reopen it "
                                 "with its full committed context as the prompt")

    def _account(self, session: Session, round_no: int, draft: DraftRound,
                 outcome: RoundOutcome, queue_ns: int) -> RoundResult:
        """Applies a round's outcome to the session's bookkeeping and the metrics."""
        session.acceptance.update(len(draft.tokens), outcome.num_accepted)
        load = max(outcome.batch_sessions, len(self.batcher) + 1)
        session_cost, token_cost = self.batcher.cost_model.relative_costs()
        suggested = suggest_draft_len(session.acceptance.alpha, load,
                                      self.config.max_draft_len, token_cost, session_cost)
        self._track_speculation(session, suggested > 0)
        if suggested == 0 and round_no % PROBE_EVERY == PROBE_EVERY - 1:
            suggested = 1  # keep measuring acceptance
        self.store.touch(session)
        session.next_round = round_no + 1
        self._observe(draft, outcome, queue_ns)
        return RoundResult(
            round=round_no, token_ids=list(outcome.committed), num_drafted=len(draft.tokens),
            num_accepted=outcome.num_accepted, committed_length=len(session.committed),
            finished=outcome.finished, target_forwards=1, queue_ns=queue_ns,
            forward_ns=outcome.forward_ns, suggested_draft_len=suggested,
            draft_token_cost=draft_token_cost(load, token_cost, session_cost),
            suggestion=session.suggestion, fed_tokens=outcome.fed_tokens,
            feature=outcome.feature, feature_position=outcome.feature_position)

    def _track_speculation(self, session: Session, pays: bool) -> None:
        """Counts acceptance collapses: the suggestion drops to 0 (both sides stop
        speculating; the probes every PROBE_EVERY rounds do not count) or comes back."""
        if session.speculating == pays:
            return
        session.speculating = pays
        self.metrics.speculation_changes.labels("resumed" if pays else "collapsed").inc()
        self.metrics.sessions_not_speculating.inc(-1 if pays else 1)

    def _observe(self, draft: DraftRound, outcome: RoundOutcome, queue_ns: int) -> None:
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

    # -- background tasks -------------------------------------------------------------------

    def _spawn(self, coro) -> asyncio.Task:
        """A task the runner owns: tracked until done, its outcome always consumed (the
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
