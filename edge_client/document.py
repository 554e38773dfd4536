"""Editing sessions, for keyboards and on-device assistants: one verifier session per text
field, serving one suggestion after another.

    async with client.document(GenerationConfig(draft_len=4)) as doc:
        s = await doc.suggest("The quick brown", max_new_tokens=8, budget_ms=120)
        print(s.text, "|", s.unverified_text)

or, synchronously, ``with edge_client.document(config) as doc: doc.suggest(...)``.

- **Edits.** ``suggest`` takes the field's whole current text (or its token ids). The
  document diffs it against what its session has committed (the text, plus the previous
  suggestion) and sends the edit, "keep the first n tokens, then append these", in the same
  message as the suggestion's first drafts. The verifier keeps its KV cache for the n kept
  tokens and the draft its own (``ModelDrafter.resync``), so a keystroke costs forwards over
  the tokens after n, not over the whole text (``SuggestionStats.fed_tokens``).
- **Token healing and type-through** (``GenerationConfig.heal``, on by default where the
  tokenizer is byte-level and the verifier takes ``continue_with``). A text that ends inside
  a word or with a space is backed up to the word's start, and the suggestion must begin
  with the bytes backed over (``shared.token_spelling``): the target spells the word
  itself. A key that types along the suggestion shown keeps it: its verified tokens that
  still spell the new text stand (``stats.reused_tokens``); with enough of them no RPC is
  sent at all, else the verifier goes on from them. They are exactly what a fresh session
  over the new text commits, greedy (each was the target's choice among a set of tokens
  that holds the new allowed set: ``TokenSpelling.narrows``), and a sample of the same law,
  sampled without top-k or top-p (with them nothing is kept: a draw from the old set's
  head is not one from the new set's head; tests/test_type_through_law.py).
- **Cancel.** A new ``suggest`` while one is in flight, or ``cancel()`` from any thread,
  stops the one in flight at once: its ``suggest`` *returns* a Suggestion with
  ``cancelled=True`` and the verified tokens it had (it does not raise). The verifier drops
  the suggestion's work that has not reached a forward; the session stays open.
- **Budget.** With ``budget_ms`` (per call, or ``GenerationConfig.budget_ms``), counted from
  the ``suggest`` call (stopping the suggestion in flight included), a suggestion returns
  when the budget is spent with the verified tokens it has, plus, as ``unverified_ids``, the
  drafts that were on their way to the verifier; the draft does not go on past the budget
  (it drafts one round alone only when the suggestion would otherwise be empty).
- **Streaming.** ``suggest(..., on_update=show)`` calls ``show`` with the suggestion so far
  each time tokens arrive, so the first verified tokens can be shown a round or more before
  the whole suggestion; ``suggest`` still returns the whole one.
- **Settle.** A suggestion first waits for the typing to settle: ``settle_ms`` (per call,
  or ``GenerationConfig.settle_ms``) after any key, and while the text ends inside a word a
  little longer than this typist's usual gap between keys inside a word
  (``edge_client.typing_pace``; ``GenerationConfig.word_settle_ms``, 150 ms, until it is
  known). A newer ``suggest`` (the next key) or ``cancel()`` in that time ends it,
  cancelled, before any RPC, so keys typed in a burst cost the verifier nothing, and a key
  after a space or punctuation, where the user looks for the suggestion, is sent at once.
  A per-call ``settle_ms`` is the whole wait.
- **Fallback.** With ``GenerationConfig.fallback="draft-only"``, a suggestion whose verifier
  is unreachable is completed by the draft alone, marked unverified. The next suggestion
  over the same text (or a text that took some of those tokens) sends the rest of them
  first, as drafts: the verifier verifies them, and ``stats.replaced_tokens`` says how many
  it replaced. A client made with ``fallback="draft-only"`` comes up without a verifier it
  cannot reach: its documents suggest with the draft alone, and the first suggestion that
  reaches one checks its tokenizer (IncompatibleVerifier) before verifying them.
- **Acceptance collapse.** A document follows the verifier's ``suggested_draft_len`` unless
  ``follow_suggested_draft_len=False``: when its drafts keep being rejected it sends a
  Decode instead of drafts, until drafting pays again.

Faults (eviction, expiry, a verifier restart, back-off) are handled by the one client core
(edge_client.core): a document whose session was lost reopens with its committed text.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from functools import partial
from typing import TYPE_CHECKING

import numpy as np

from edge_client.combined_drafter import FEATURE, make_drafter
from edge_client.core import (
    DRAFT_ONLY,
    GenerationStats,
    cut_at_stop,
    draft_alone,
    generate,
    model_proposer,
    unverified_delivery,
)
from edge_client.generation_state import ROUNDS, GenerationState
from edge_client.offline_start import offline_wait_s
from edge_client.session_streams import SessionKeeper
from edge_client.typing_pace import TypingPace
from shared.token_spelling import TokenSpelling

if TYPE_CHECKING:
    from edge_client.document_client import DocumentClient, SyncDocumentClient
    from edge_client.generation_config import GenerationConfig


@dataclass(frozen=True)
class SuggestionStats:
    target_forwards: int = 0  # forwards whose steps this suggestion committed
    kept_tokens: int = 0  # committed tokens the edit kept (their KV caches were reused)
    reused_tokens: int = 0  # verified tokens of the last suggestion the typing kept
    fed_tokens: int = 0  # positions the verifier's forwards fed for it (Step.fed_tokens)
    drafted: int = 0
    accepted: int = 0
    draft_ms: float = 0.0
    network_ms: float = 0.0  # waiting for replies, less the verifier's own time
    verify_ms: float = 0.0  # the verifier's queue and forward time
    unverified_tokens: int = 0
    replaced_tokens: int = 0  # earlier unverified tokens the verifier replaced
    stale_steps: int = 0  # steps of superseded suggestions dropped on arrival
    reopens: int = 0
    wall_ms: float = 0.0  # from suggest() to its return


@dataclass(frozen=True)
class Suggestion:
    token_ids: list[int]  # verified: what the target itself would have produced
    unverified_ids: list[int]  # after them: drafted, not verified
    text: str
    unverified_text: str
    cancelled: bool
    stats: SuggestionStats = field(default_factory=SuggestionStats)
    # A preview: the draft's own continuation, shown through on_update while the suggestion
    # waits for the typing to settle (its tokens are all in unverified_ids after the kept
    # ones); the verified suggestion replaces it.
    preview: bool = False


class AsyncDocument:
    """One text field's editing session. No RPC until the first ``suggest``."""

    def __init__(self, client: DocumentClient, config: GenerationConfig) -> None:
        if client.info is None and client.fallback != DRAFT_ONLY:
            raise RuntimeError("call connect() (or use `async with`) before document()")
        if client.protocol != ROUNDS:
            raise ValueError("a document needs the rounds protocol")
        self.client = client
        self.config = config
        self._keeper = SessionKeeper()
        self._state: GenerationState | None = None
        # One drafter for the document's life: its KV cache (or the latest target feature,
        # kept by the state) follows the text across edits.
        self._features = config.drafter == FEATURE
        self._drafter = make_drafter(config.drafter, client.model,
                                     config.draft_sampling(config.max_support),
                                     np.random.default_rng(config.seed),
                                     head=client.feature_head() if self._features else None,
                                     latest=lambda: self._state and self._state.feature)
        self._drafting = threading.Lock()  # the drafter's cache: one proposal at a time
        self._rng = np.random.default_rng()  # back-off jitter only
        self._task: asyncio.Task | None = None
        self._calls = 0  # suggest() calls so far: the newest one wins
        self._pace = TypingPace(config.word_settle_ms)  # the wait inside a word
        self._cancelled: asyncio.Task | None = None  # the task cancel() stopped, if any
        self._loop: asyncio.AbstractEventLoop | None = None
        self._offline = False  # the state's limits are the draft's own, not the verifier's
        # The text (bytes) of the last edit sent: the state's generated tokens spell a
        # continuation of it (the bar for type-through).
        self._edited_text = b""

    async def __aenter__(self) -> AsyncDocument:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    @property
    def _stop(self) -> frozenset[int]:
        return frozenset(self.config.stop_token_ids or (
            () if self.config.ignore_eos else self.client.eos_token_ids))

    @property
    def committed_ids(self) -> list[int]:
        """What the session has committed: the text, then the last suggestion's tokens."""
        return [] if self._state is None else list(self._state.committed)

    def cancel(self) -> None:
        """Stops the suggestion in flight (its ``suggest`` returns ``cancelled=True``); safe
        from any thread."""
        loop = self._loop
        if loop is None:
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            self._cancel_now()
        else:
            loop.call_soon_threadsafe(self._cancel_now)

    def _cancel_now(self) -> None:
        task = self._task
        if task is not None and not task.done():
            self._cancelled = task
            task.cancel()

    async def close(self) -> None:
        """Stops what is in flight and closes the verifier's session."""
        self._calls += 1  # a suggest() waiting for the one in flight returns cancelled
        self._cancel_now()
        if self._task is not None:
            await asyncio.wait([self._task])
        self._keeper.drop()

    async def suggest(self, text_or_ids: str | list[int], max_new_tokens: int = 8,
                      budget_ms: float | None = None, settle_ms: float | None = None,
                      on_update: Callable[[Suggestion], None] | None = None) -> Suggestion:
        """A suggestion after ``text_or_ids``, the field's whole current text.

        ``on_update``, if given, is called with the suggestion so far (``cancelled`` False)
        each time tokens arrive, verified or not, on the document's event loop, so an IME can
        show the first verified tokens a round or two before the whole suggestion."""
        t0 = time.perf_counter()
        self._loop = asyncio.get_running_loop()
        tok = self.client.tokenizer
        ids = tok.encode(text_or_ids) if isinstance(text_or_ids, str) else list(text_or_ids)
        typed = text_or_ids if isinstance(text_or_ids, str) else tok.decode(ids)
        if not ids:
            raise ValueError("the text is empty; a suggestion needs at least one token")
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        # Per-call values override the config's, and are checked where the config's are.
        timing = replace(self.config,
                         budget_ms=self.config.budget_ms if budget_ms is None else budget_ms,
                         settle_ms=self.config.settle_ms if settle_ms is None else settle_ms)
        tail = text_or_ids if isinstance(text_or_ids, str) else \
            self.client.tokenizer.decode(ids[-1:])
        word_wait = self._pace.key(tail, t0)
        if settle_ms is None:  # the config's: longer while the text ends inside a word
            timing = replace(timing, settle_ms=max(timing.settle_ms, word_wait))
        budget_ms, settle_ms = timing.budget_ms, timing.settle_ms
        self._calls += 1
        call = self._calls
        # A keystroke: the suggestion in flight stops first.
        while self._task is not None and not self._task.done():
            self._cancel_now()
            await asyncio.wait([self._task])
        if call != self._calls:
            return _nothing(t0)
        plan = self._plan(ids, max_new_tokens)
        if plan.reused:  # typed along the suggestion: the rest of it stands
            run = _Run(plan.ctx, max_new_tokens, plan.reused[:max_new_tokens])
            kept = self._suggestion(run, False, len(plan.ctx), GenerationStats(), t0, typed,
                                    len(run.verified))
            if plan.whole:  # and is the whole suggestion: no RPC
                return kept
            if on_update is not None:  # shown at once, before any wait
                on_update(kept)
        preview = partial(self._preview, plan, max_new_tokens, on_update, t0, typed) \
            if on_update is not None and self._previews else None
        if settle_ms and call == self._calls and not await self._settled(settle_ms, preview):
            return _nothing(t0)  # the next key (or cancel()) came first: no work was sent
        online = call == self._calls and await self._reach_verifier()
        if call != self._calls:  # a newer suggest() came while we waited: it goes instead
            return _nothing(t0)
        plan = self._plan(ids, max_new_tokens)  # again: the wait may have let the state move
        state, kept = self._edit(plan, max_new_tokens)
        stats = GenerationStats()
        run = _Run(plan.ctx, max_new_tokens, plan.reused, state)
        reused = len(plan.reused)
        if on_update is not None:
            run.listener = lambda: on_update(self._suggestion(run, False, kept, stats, t0,
                                                              typed, reused))
            if plan.reused:
                run.listener()
        deadline = None if budget_ms is None else t0 + budget_ms / 1000
        spent = False
        if online:
            cancelled, spent = await self._verified(state, stats, run, deadline)
        else:  # the client came up without its verifier: the draft suggests alone
            cancelled = False
        # Past the budget the draft fills only a suggestion that would be empty, one round;
        # otherwise only with the draft-only fallback (the verifier unreachable).
        fill = (not (run.verified or run.unverified)) if spent else \
            self.config.fallback == DRAFT_ONLY
        if fill and not cancelled and not run.complete:
            # Unreachable (or an empty suggestion past its budget): the draft completes the
            # suggestion alone. It is the suggestion in flight until it returns, so that a
            # newer suggest() stops it before editing the state it is drafting on.
            task = await self._in_flight(self._draft_rest(state, stats, run, one_round=spent))
            cancelled = task is self._cancelled
            if not task.cancelled() and task.exception() is not None:
                raise task.exception()
        return self._suggestion(run, cancelled, kept, stats, t0, typed, reused)

    async def _in_flight(self, work, timeout: float | None = None) -> asyncio.Task:
        """Runs ``work`` as the suggestion in flight (what a newer ``suggest`` or
        ``cancel()`` stops) until it ends or ``timeout`` seconds pass; its task. If our own
        caller goes away, so does the work."""
        task = self._task = asyncio.ensure_future(work)
        try:
            await asyncio.wait([task], timeout=timeout)
        except asyncio.CancelledError:
            task.cancel()
            raise
        return task

    async def _settled(self, settle_ms: float,
                       preview: Callable[[], Awaitable[None]] | None = None) -> bool:
        """Waits ``settle_ms`` as the suggestion in flight, so that a newer ``suggest`` or
        ``cancel()`` ends the wait, first awaiting ``preview()`` if given; whether it ran out
        undisturbed."""
        async def wait() -> None:
            end = time.perf_counter() + settle_ms / 1000
            if preview is not None:
                await preview()
            await asyncio.sleep(max(0.0, end - time.perf_counter()))

        task = await self._in_flight(wait())
        if not task.cancelled() and task.exception() is not None:
            raise task.exception()
        return not task.cancelled()

    @property
    def _previews(self) -> bool:
        """Whether waits show the draft's own continuation (GenerationConfig.preview):
        greedy documents with any drafter but the feature head, which has no target feature
        before a round (a sampled preview would use the draft's random stream, and the
        verified drafts after it would differ from a document's without previews)."""
        cfg = self.config
        return cfg.preview and cfg.temperature == 0 and not self._features

    async def _preview(self, plan: _Plan, max_new_tokens: int,
                       on_update: Callable[[Suggestion], None], t0: float, typed: str) -> None:
        """Shows, through ``on_update``, the draft's own continuation of the healed text
        (one round's worth, unverified, ``Suggestion.preview``) after the tokens the typing
        kept: no RPC and no forward, so every key inside a word gets a suggestion at once,
        and the verified one replaces it if the typing settles."""
        k = min(max_new_tokens - len(plan.reused), max(1, self.config.draft_len))
        if k < 1:
            return
        spelling, stats = self._spelling(), GenerationStats()
        spell = (spelling, plan.rest) if plan.rest else None
        proposal = await model_proposer(self._drafter, stats, self._drafting)(
            plan.ctx + plan.reused, k, spell)
        tokens = cut_at_stop(proposal, self._stop).tokens
        if spell is not None:  # drafters that cannot mask are cut where they stop spelling
            tokens = tokens[:spelling.advance_all(plan.rest, tokens)[0]]
        if not tokens:
            return
        run = _Run(plan.ctx, max_new_tokens, plan.reused)
        run.add(unverified_delivery(tokens))
        on_update(replace(self._suggestion(run, False, 0, stats, t0, typed, len(plan.reused)),
                          preview=True))

    async def _reach_verifier(self) -> bool:
        """Whether the client has its verifier. One that came up without it asks again, once
        per suggestion (draft-only: through its background probe); when it answers, its
        tokenizer is checked (IncompatibleVerifier) and the document's state takes its
        limits. Unreachable: False with the draft-only fallback, else VerifierUnavailable."""
        client = self.client
        if self.config.fallback == DRAFT_ONLY:
            # The client's probe asks in the background; a suggestion waits for it at most
            # the offline wait (edge_client.offline_start), never a GetInfo deadline.
            reached = await client.probe.wait(offline_wait_s(self.config.budget_ms))
        else:
            reached = await client.reach_verifier(required=True)
        if not reached:
            return False
        if self._offline and self._state is not None:
            self._state.limits = client.limits(self.config.draft_len)
            self._offline = False
        return True

    async def _verified(self, state: GenerationState, stats: GenerationStats, run: _Run,
                        deadline: float | None) -> tuple[bool, bool]:
        """Runs the suggestion against the verifier until ``deadline`` (perf_counter time;
        None: none); whether it was cancelled, and whether the budget was spent."""
        task = await self._in_flight(self._run(state, stats, run), None if deadline is None
                                     else max(0.0, deadline - time.perf_counter()))
        spent = not task.done()
        if spent:  # the budget is spent: the drafts on their way come unverified
            in_flight = state.pending
            task.cancel()
            await asyncio.wait([task])
            if in_flight is not None and in_flight.tokens and state.unverified is None:
                state.add_unverified(in_flight.prefix(state.remaining))
                run.add(unverified_delivery(state.unverified.tokens))
        elif not task.cancelled() and task.exception() is not None:
            raise task.exception()
        return task is self._cancelled, spent  # cancelled also by a newer suggest()

    def _spelling(self) -> TokenSpelling | None:
        """The tokenizer's spelling when this document heals its texts, else None."""
        info = self.client.info
        if not self.config.heal or (info is not None and info.max_continue_with == 0):
            return None
        return self.client.tokenizer.spelling

    def _plan(self, ids: list[int], max_new_tokens: int) -> _Plan:
        """The healed text, and what of the last suggestion the typing keeps. Changes
        nothing."""
        spelling = self._spelling()
        ctx, rest = spelling.heal(ids) if spelling is not None else (list(ids), b"")
        info, state = self.client.info, self._state
        if rest and info is not None and len(rest) > info.max_continue_with:
            ctx, rest = list(ids), b""
        reused: list[int] = []
        text = spelling.spell(ids) if spelling is not None else b""
        # Type-through: the new text (healed) keeps the old text and ends inside the tokens
        # generated after it, and spells a text that goes on from the one they continue.
        if spelling is not None and state is not None and self._draws_stand \
                and len(ctx) >= state.prompt_len \
                and state.committed[:len(ctx)] == ctx and text.startswith(self._edited_text):
            reused, rest = self._typed_through(spelling, state, ctx, rest, max_new_tokens)
        whole = bool(reused) and (len(reused) >= max_new_tokens or reused[-1] in self._stop)
        return _Plan(ctx, rest, reused, whole, text)

    @property
    def _draws_stand(self) -> bool:
        """Whether a token drawn under the old text's mask is a draw under the new one when
        the new allowed set lies inside the old: greedy, or sampling without truncation. With
        top-k or top-p the old draw came from the old set's head, not the new set's (a token
        the new set would keep may have been cut), so nothing is kept
        (tests/test_type_through_law.py measures the difference)."""
        cfg = self.config
        return cfg.temperature == 0 or (cfg.top_k == 0 and cfg.top_p >= 1)

    def _typed_through(self, spelling: TokenSpelling, state: GenerationState,
                       ctx: list[int], rest: bytes, max_new_tokens: int
                       ) -> tuple[list[int], bytes]:
        """The generated tokens after ``ctx`` that a fresh session over the new text (``ctx``
        and ``rest`` to spell) would commit too, and what they leave to spell. Each was the
        target's choice among the tokens its own suggestion allowed (``old``); it stands
        while it is allowed now and the new allowed set is inside the old one
        (``TokenSpelling.narrows``): the argmax of a set is the argmax of any subset that
        holds it, and a sample drawn from a set, kept when it falls in a subset, is a draw
        from that subset."""
        spelled = spelling.spell(state.committed[:state.prompt_len])
        old = self._edited_text[len(spelled):] if self._edited_text.startswith(spelled) \
            else b""
        for token in state.committed[state.prompt_len:len(ctx)]:
            old = spelling.advance(old, token) or b""
        reused: list[int] = []
        for token in state.committed[len(ctx):]:
            after = spelling.advance(rest, token)
            if len(reused) == max_new_tokens or after is None \
                    or not spelling.narrows(old, rest):
                break
            reused.append(token)
            rest, old = after, spelling.advance(old, token) or b""
            if token in self._stop:
                break
        return reused, rest

    def _edit(self, plan: _Plan, max_new_tokens: int) -> tuple[GenerationState, int]:
        """The state for the next suggestion, and how many committed tokens it keeps."""
        cfg, client = self.config, self.client
        self._edited_text = plan.text
        if self._state is None:
            # A document follows the server's K unless told not to (GenerationConfig).
            follow = cfg.follow_suggested_draft_len is not False
            adaptive = cfg.follow_suggested_draft_len is True
            self._offline = client.info is None
            self._state = GenerationState(
                plan.ctx, replace(cfg.session_params(), max_new_tokens=max_new_tokens),
                client.limits(cfg.draft_len), cfg.draft_len, ROUNDS,
                follow_suggestion=follow, chooser=client.chooser if adaptive else None,
                editable=True, want_feature=self._features, spelling=self._spelling(),
                continue_with=plan.rest)
            return self._state, 0
        state = self._state
        text = plan.ctx + plan.reused
        keep = 0
        limit = min(len(state.committed), len(text))
        while keep < limit and state.committed[keep] == text[keep]:
            keep += 1
        state.edit(keep, text[keep:], max_new_tokens - len(plan.reused), plan.rest)
        return state, keep

    async def _run(self, state: GenerationState, stats: GenerationStats, run: _Run) -> None:
        async with contextlib.aclosing(generate(
                self.client.conn, state, model_proposer(self._drafter, stats, self._drafting),
                stats,
                self.client.info, self._rng, keeper=self._keeper,
                fallback=self.config.fallback)) as deliveries:
            async for delivery in deliveries:
                run.add(delivery)
                if not delivery.verified and run.complete:
                    return  # a whole suggestion from the draft alone: the user has it now

    async def _draft_rest(self, state: GenerationState, stats: GenerationStats,
                          run: _Run, one_round: bool = False) -> None:
        async for delivery in draft_alone(
                state, model_proposer(self._drafter, stats, self._drafting), self._stop,
                stats):
            run.add(delivery)
            if one_round:
                return

    def _suggestion(self, run: _Run, cancelled: bool, kept: int, stats: GenerationStats,
                    t0: float, typed: str, reused: int = 0) -> Suggestion:
        tok = self.client.tokenizer
        base = run.base
        verified, unverified = list(run.verified), list(run.unverified)  # run goes on growing
        # After the user's own text: a healed suggestion's first token re-spells its end.
        whole = tok.decode(base + verified)
        text = whole[len(typed):] if whole.startswith(typed) else _tail(tok, base, verified)
        unverified_text = _tail(tok, base + verified, unverified)
        network_s = max(0.0, stats.wait_s - stats.verify_s)
        return Suggestion(
            verified, unverified, text, unverified_text, cancelled,
            SuggestionStats(
                target_forwards=stats.target_forwards, kept_tokens=kept, reused_tokens=reused,
                fed_tokens=stats.fed_tokens, drafted=stats.drafted, accepted=stats.accepted,
                draft_ms=stats.draft_s * 1000, network_ms=network_s * 1000,
                verify_ms=stats.verify_s * 1000, unverified_tokens=len(unverified),
                replaced_tokens=stats.replaced_tokens, stale_steps=stats.stale_steps,
                reopens=stats.reopens, wall_ms=(time.perf_counter() - t0) * 1000))


@dataclass(frozen=True)
class _Plan:
    """A suggestion's text, healed, and what of the last suggestion the typing kept."""

    ctx: list[int]  # the text's tokens, up to the word that is healed
    rest: bytes  # what the new tokens must still spell after ctx + reused
    reused: list[int]  # verified tokens after ctx that still stand
    whole: bool  # they make the whole suggestion: nothing to send
    text: bytes  # the whole text's bytes (b"" without healing)


class _Run:
    """What one suggestion has: verified tokens, then unverified ones."""

    def __init__(self, base: list[int], max_new_tokens: int, reused: list[int],
                 state: GenerationState | None = None) -> None:
        self.state = state
        self.base = list(base)  # the text the suggestion continues (healed)
        self.max_new_tokens = max_new_tokens
        self.verified: list[int] = list(reused)
        self.unverified: list[int] = []
        self.listener: Callable[[], None] | None = None

    def add(self, delivery) -> None:
        if delivery.replaces:
            del self.unverified[len(self.unverified) - delivery.replaces:]
        (self.verified if delivery.verified else self.unverified).extend(delivery.tokens)
        if self.listener is not None and (delivery.tokens or delivery.replaces):
            self.listener()

    @property
    def complete(self) -> bool:
        tokens = self.verified + self.unverified
        return len(tokens) >= self.max_new_tokens or (
            self.state is not None and self.state.finished)


def _nothing(t0: float) -> Suggestion:
    """A suggestion a newer keystroke superseded before it sent anything."""
    return Suggestion([], [], "", "", True,
                      SuggestionStats(wall_ms=(time.perf_counter() - t0) * 1000))


def _tail(tokenizer, before: list[int], ids: list[int]) -> str:
    """The text ``ids`` add after ``before`` (decoding them alone can lose a leading space)."""
    if not ids:
        return ""
    head = tokenizer.decode(before)
    whole = tokenizer.decode(before + ids)
    return whole[len(head):] if whole.startswith(head) else tokenizer.decode(ids)


class Document:
    """The synchronous facade of an AsyncDocument, on its EdgeClient's event-loop thread."""

    def __init__(self, client: SyncDocumentClient, inner: AsyncDocument) -> None:
        self._client = client
        self._inner = inner

    def suggest(self, text_or_ids: str | list[int], max_new_tokens: int = 8,
                budget_ms: float | None = None, settle_ms: float | None = None,
                on_update: Callable[[Suggestion], None] | None = None) -> Suggestion:
        """As AsyncDocument.suggest; ``on_update`` runs on the client's event-loop thread."""
        return self._client._call(self._inner.suggest(text_or_ids, max_new_tokens, budget_ms,
                                                      settle_ms, on_update))

    def cancel(self) -> None:
        self._inner.cancel()

    def close(self) -> None:
        self._client._call(self._inner.close())

    def __enter__(self) -> Document:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
