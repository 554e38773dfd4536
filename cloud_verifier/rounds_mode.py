"""A Session stream in DRAFTING_ROUNDS: Verify rounds and Decodes, answered in order.

The open's first draft is round 0; each ``verify`` is the next round, and a ``decode`` runs
K = 0 rounds back to back, one Step each, until ``shared.decode_rule.ends_decode`` says it
is done (the client applies the same rule to know which Step was its last). A message that
arrives while a round runs waits for it; a half-close is seen at once (session_stream).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from cloud_verifier.engine import NO_DRAFT, DraftRound
from cloud_verifier.errors import InvalidRequest, RoundOutOfOrder
from cloud_verifier.rounds import RoundResult, RoundRunner
from cloud_verifier.session_stream import HALF_CLOSE_GRACE_S, RequestReader, unless_stopped
from cloud_verifier.sessions import Session
from cloud_verifier.wire import Limits, check_decode, parse_draft, step_to_pb
from shared.decode_rule import ends_decode
from shared.pb import verifier_pb2 as pb


class RoundsMode:
    def __init__(self, runner: RoundRunner, limits: Limits, session: Session,
                 reader: RequestReader, first_draft: DraftRound) -> None:
        self.runner = runner
        self.limits = limits
        self.session = session
        self.reader = reader
        self.first_draft = first_draft

    async def run(self) -> AsyncIterator[pb.SessionResponse]:
        """The stream's replies; returns early (the caller closes the session) when the
        client half-closes."""
        result = await self._round(0, self.first_draft)
        if result is None:
            return
        yield pb.SessionResponse(session_id=self.session.id, step=step_to_pb(result))
        while not result.finished:
            request = await self.reader.get()
            if request is None:  # half-closed
                return
            kind = request.WhichOneof("kind")
            if kind == "verify":
                draft = parse_draft(request.verify.draft, self.limits, "verify.draft")
                result = await self._round(request.verify.round, draft)
                if result is None:
                    return
                yield pb.SessionResponse(step=step_to_pb(result))
            elif kind == "decode":
                decode = check_decode(request.decode)
                round_no = decode.round
                while True:
                    result = await self._round(round_no, NO_DRAFT, follow_up=True)
                    if result is None:
                        return
                    step = step_to_pb(result)
                    yield pb.SessionResponse(step=step)
                    if ends_decode(decode, step):
                        break
                    round_no += 1
            elif kind is None:
                raise InvalidRequest("empty SessionRequest: set verify or decode", field="kind")
            else:
                raise RoundOutOfOrder(f"a DRAFTING_ROUNDS session takes verify and decode "
                                      f"messages after its open, not {kind}")
        await self._await_half_close()

    async def _round(self, round_no: int, draft: DraftRound,
                     follow_up: bool = False) -> RoundResult | None:
        """The round's result, or None if the client half-closed before it was answered (the
        session is then closed, after the round's forward if it had started)."""
        self.reader.read_ahead()  # so that a half-close is seen meanwhile
        half_closed = asyncio.ensure_future(self.reader.half_closed.wait())
        try:
            result = await unless_stopped(
                self.runner.run_round(self.session, round_no, draft, follow_up), half_closed)
        finally:
            half_closed.cancel()
        if result is None:
            await self.runner.close_when_idle(self.session)
        return result

    async def _await_half_close(self) -> None:
        """After the finishing Step: the client half-closes; a message instead is refused."""
        next_message = self.reader.read_ahead()
        done, _ = await asyncio.wait([next_message], timeout=HALF_CLOSE_GRACE_S)
        if done and next_message.result() is not None:
            raise RoundOutOfOrder(f"the session finished at round {self.session.next_round - 1}"
                                  "; half-close the stream")
