"""A document's kept Session stream (edge_client.session_streams.KeptStream) when its call
ends under it: a write then raises the call's status, not a reply left unread."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import grpc
import pytest

from edge_client.generation_state import ProtocolError
from edge_client.session_streams import KeptStream
from shared.pb import verifier_pb2 as pb


class EndedCall:
    """A Session call that delivers ``replies`` and then ends with ``status`` (None: OK);
    writes fail as grpc.aio's do on a finished call."""

    def __init__(self, replies: list, status: grpc.StatusCode | None) -> None:
        self.replies, self.status = list(replies), status
        self.ended = asyncio.Event()

    async def read(self):
        if self.replies:
            return self.replies.pop(0)
        self.ended.set()
        if self.status is None:
            return grpc.aio.EOF
        raise grpc.aio.AioRpcError(self.status, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                   details="the verifier went away")

    async def write(self, message) -> None:
        await self.ended.wait()
        raise asyncio.InvalidStateError("RPC already finished")

    def cancel(self) -> None:
        pass


def fake_wire(call: EndedCall):
    async def send(message, round_trip: bool) -> None:
        pass

    return SimpleNamespace(session=lambda: call, send=send, arrived=lambda message: 0.0,
                           conn=SimpleNamespace(deadlines=SimpleNamespace(reply_s=5.0)),
                           stats=SimpleNamespace(wait_s=0.0, stale_steps=0))


def stale_steps(n: int) -> list:
    """Replies of cancelled suggestions that nobody read."""
    return [pb.SessionResponse(step=pb.Step(round=i, token_ids=[7])) for i in range(n)]


@pytest.mark.parametrize("unread", [0, 3])
def test_a_write_on_an_ended_call_raises_its_status_past_unread_replies(unread):
    async def run():
        stream = KeptStream(fake_wire(EndedCall(stale_steps(unread),
                                                grpc.StatusCode.UNAVAILABLE)))
        try:
            await stream.write(pb.SessionRequest())
        finally:
            stream.close()

    with pytest.raises(grpc.aio.AioRpcError) as err:
        asyncio.run(run())
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_a_write_on_a_cleanly_ended_call_is_a_protocol_error():
    async def run():
        stream = KeptStream(fake_wire(EndedCall(stale_steps(2), None)))
        try:
            await stream.write(pb.SessionRequest())
        finally:
            stream.close()

    with pytest.raises(ProtocolError, match="ended the stream"):
        asyncio.run(run())
