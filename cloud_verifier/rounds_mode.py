"""A Session stream in DRAFTING_ROUNDS: Verify rounds and Decodes, answered in order.

The open's first draft is round 0; each ``verify`` is the next round, and a ``decode`` runs
K = 0 rounds back to back, one Step each, until ``shared.decode_rule.ends_decode`` says it
is done (the client applies the same rule to know which Step was its last). A message that
arrives while a round runs waits for it; a half-close is seen at once (session_stream).

An editable session (``OpenSession.editable``) serves one suggestion after another: a
finished suggestion leaves the stream open for the next ``verify`` with an edit, and a
message that arrives while a round or a Decode is in flight supersedes it (a keystroke):
the round is dropped if its forward has not started (else it runs to its end unanswered),
then the message is handled: an edit starts the next suggestion, a ``cancel`` just stops.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from cloud_verifier.errors import InvalidRequest, RoundOutOfOrder
from cloud_verifier.rounds import RoundResult, RoundRunner
from cloud_verifier.session_stream import HALF_CLOSE_GRACE_S, RequestReader, unless_stopped
from cloud_verifier.sessions import Session
from cloud_verifier.target_engine import NO_DRAFT, DraftRound
from cloud_verifier.wire import (
    EditParams,
    Limits,
    check_decode,
    parse_draft,
    parse_edit,
    step_to_pb,
)
from shared.decode_rule import ends_decode
from shared.pb import verifier_pb2 as pb


class _Superseded(Exception):
    """An editable session's next message arrived while a round was in flight."""


class RoundsMode:
    def __init__(self, runner: RoundRunner, limits: Limits, session: Session,
                 reader: RequestReader, first_draft: DraftRound) -> None:
        self.runner = runner
        self.limits = limits
        self.session = session
        self.reader = reader
        self.first_draft = first_draft
        # Editable sessions: set once the suggestion in flight was superseded or cancelled;
        # the next verify must then carry an edit.
        self.interrupted = False

    async def run(self) -> AsyncIterator[pb.SessionResponse]:
        """The stream's replies; returns early (the caller closes the session) when the
        client half-closes."""
        editable = self.session.editable
        try:
            result = await self._round(0, self.first_draft)
        except _Superseded:
            result = None
            self.interrupted = True
        else:
            if result is None:
                return
        yield pb.SessionResponse(session_id=self.session.id,
                                 step=step_to_pb(result) if result is not None else None)
        while editable or not result.finished:
            request = await self.reader.get()
            if request is None:  # half-closed
                return
            kind = request.WhichOneof("kind")
            try:
                if kind == "verify":
                    result = await self._verify(request.verify)
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
                elif kind == "cancel" and editable:
                    self._cancel(request.cancel)
                elif kind is None:
                    raise InvalidRequest("empty SessionRequest: set verify or decode",
                                         field="kind")
                else:
                    raise RoundOutOfOrder(f"a DRAFTING_ROUNDS session takes verify and decode "
                                          f"messages after its open, not {kind}")
            except _Superseded:
                self.interrupted = True
        await self._await_half_close()

    async def _verify(self, verify: pb.VerifyRound) -> RoundResult | None:
        draft = parse_draft(verify.draft, self.limits, "verify.draft")
        edit: EditParams | None = None
        if verify.HasField("edit"):
            edit = parse_edit(verify.edit, self.limits)
            self.interrupted = False
        elif self.interrupted:
            raise RoundOutOfOrder("the suggestion in flight was superseded or cancelled; the "
                                  "next verify must carry an edit")
        return await self._round(verify.round, draft, edit=edit)

    def _cancel(self, cancel: pb.CancelSuggestion) -> None:
        """The round the cancel stopped (if any) is already dropped. An older suggestion's
        cancel came too late to matter; a newer one's edit never left the client (it was
        cancelled on its way), so it stops the current one."""
        if cancel.suggestion >= self.session.suggestion:
            self.interrupted = True

    async def _round(self, round_no: int, draft: DraftRound, follow_up: bool = False,
                     edit: EditParams | None = None) -> RoundResult | None:
        """The round's result, or None if the client half-closed before it was answered (the
        session is then closed, after the round's forward if it had started). Editable
        sessions: raises _Superseded when the client's next message arrives first (it is
        read next)."""
        next_message = self.reader.read_ahead()  # so that a half-close is seen meanwhile
        stop = next_message if self.session.editable else asyncio.ensure_future(
            self.reader.half_closed.wait())
        try:
            result = await unless_stopped(
                self.runner.run_round(self.session, round_no, draft, follow_up, edit), stop)
        finally:
            if stop is not next_message:
                stop.cancel()
        if result is None:
            if stop is next_message and next_message.result() is not None:
                raise _Superseded()
            await self.runner.close_when_idle(self.session)
        return result

    async def _await_half_close(self) -> None:
        """After the finishing Step: the client half-closes; a message instead is refused."""
        next_message = self.reader.read_ahead()
        done, _ = await asyncio.wait([next_message], timeout=HALF_CLOSE_GRACE_S)
        if done and next_message.result() is not None:
            raise RoundOutOfOrder(f"the session finished at round {self.session.next_round - 1}"
                                  "; half-close the stream")
