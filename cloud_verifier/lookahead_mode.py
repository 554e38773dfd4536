"""A Session stream in DRAFTING_LOOKAHEAD: the verifier decodes forward after forward, as
Generate does, while the client's lookahead drafts stream in; each forward verifies what of
the latest lookahead is still fresh (cloud_verifier.lookahead), cut by its confidences.

The client's messages are read concurrently with the forwards. A half-close before the
generation finished closes the session and ends the stream OK: that is how a client stops
early. Lookaheads that arrive after the finishing Step are ignored.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator

from cloud_verifier.errors import InvalidRequest, RoundOutOfOrder
from cloud_verifier.lookahead import Lookahead, fresh_drafts
from cloud_verifier.metrics import VerifierMetrics
from cloud_verifier.rounds import RoundRunner
from cloud_verifier.session_stream import HALF_CLOSE_GRACE_S, RequestReader, unless_stopped
from cloud_verifier.sessions import Session
from cloud_verifier.target_engine import DraftRound
from cloud_verifier.wire import Limits, parse_lookahead, step_to_pb
from shared.draft_length import worth_verifying
from shared.pb import verifier_pb2 as pb


class LookaheadMode:
    def __init__(self, runner: RoundRunner, limits: Limits, session: Session,
                 reader: RequestReader, first_draft: DraftRound | None) -> None:
        self.runner = runner
        self.limits = limits
        self.session = session
        self.reader = reader
        # The latest lookahead; the open's first_draft is the first one.
        self.latest: Lookahead | None = (None if first_draft is None
                                         else Lookahead(session.prompt_len, first_draft))

    async def _read(self) -> None:
        """Takes lookaheads until the client half-closes."""
        while (request := await self.reader.get()) is not None:
            kind = request.WhichOneof("kind")
            if kind is None:
                raise InvalidRequest("empty SessionRequest: set lookahead", field="kind")
            if kind != "lookahead":
                raise RoundOutOfOrder("a DRAFTING_LOOKAHEAD session takes only lookahead "
                                      f"messages after its open, not {kind}")
            if not self.session.finished:
                self.latest = parse_lookahead(request.lookahead, self.limits,
                                              self.session.prompt_len,
                                              len(self.session.committed))

    async def run(self) -> AsyncIterator[pb.SessionResponse]:
        session, runner = self.session, self.runner
        session.streamed = True
        reader = asyncio.ensure_future(self._read())
        try:
            k = self.limits.max_draft_len
            token_price = runner.draft_token_cost(len(runner.batcher) + 1)
            for forward in itertools.count():
                if reader.done():  # half-closed (stop early) or a bad message
                    if reader.exception() is not None:
                        raise reader.exception()
                    await runner.close_when_idle(session)  # after a round in flight
                    return
                draft = self._draft(k, token_price, runner.metrics)
                result = await unless_stopped(
                    runner.run_round(session, forward, draft, follow_up=True), reader)
                if result is None:
                    continue  # the reader ended: the loop's top says how
                k, token_price = result.suggested_draft_len, result.draft_token_cost
                yield pb.SessionResponse(session_id=session.id if forward == 0 else "",
                                         step=step_to_pb(result))
                if result.finished:
                    break
            await asyncio.wait([reader], timeout=HALF_CLOSE_GRACE_S)
            if reader.done() and reader.exception() is not None:
                raise reader.exception()
        finally:
            reader.cancel()

    def _draft(self, k: int, token_price: float, metrics: VerifierMetrics) -> DraftRound:
        """What of the latest lookahead the next forward verifies."""
        session, latest = self.session, self.latest
        room = self.runner.engine.max_context - len(session.committed) - 1
        # A lookahead with confidences is cut by their worth, not by k.
        confident = latest is not None and latest.draft.confidence is not None
        cap = min(self.limits.max_draft_len if confident else k, room)
        draft = fresh_drafts(latest, session.committed, cap)
        label = "fresh" if draft.tokens else "none" if latest is None or cap <= 0 else "stale"
        if draft.confidence is not None:
            draft = draft.window(0, worth_verifying(draft.confidence, token_price))
            if not draft.tokens:
                label = "unsure"
        metrics.lookahead_forwards.labels(label).inc()
        return draft
