"""The Session stream a rounds attempt talks on (edge_client.core).

- ``AttemptStream``: one attempt's stream, cancelled when the attempt ends.
- ``KeptStream``: an editable session's stream, kept open across the suggestions of one
  document (edge_client.document) and held by its ``SessionKeeper``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import TYPE_CHECKING

import grpc

from edge_client.connection import new_routing_key
from edge_client.generation_state import GenerationState, ProtocolError

if TYPE_CHECKING:
    from edge_client.wire import Wire


class AttemptStream:
    """The Session stream of one attempt: it ends with the attempt."""

    def __init__(self, wire: Wire) -> None:
        self.wire = wire
        self.call = wire.session()

    async def write(self, message) -> None:
        await self.wire.write(self.call, message, round_trip=True)

    async def read(self, state: GenerationState):
        return await self.wire.read(self.call)

    async def finish(self) -> None:
        await self.wire.end(self.call)

    def close(self) -> None:
        self.call.cancel()


class KeptStream:
    """An editable session's Session stream, kept open across the suggestions of one
    document (edge_client.document). A reader task takes every message off the call as it
    arrives and writes are shielded, because grpc.aio cancels the whole call when a read or
    a write is cancelled, and cancelling a suggestion (a keystroke) must not end the session.
    """

    def __init__(self, wire: Wire) -> None:
        self.wire = wire
        self.call = wire.session()
        self.inbox: asyncio.Queue = asyncio.Queue()
        self.reader = asyncio.ensure_future(self._receive())
        self._last_write: asyncio.Future | None = None
        # Whether a message was handed to the call: until then the verifier has no session
        # on this stream (an open cancelled on its way), and it must not be kept.
        self.started = False

    async def _receive(self) -> None:
        try:
            while (message := await self.call.read()) is not grpc.aio.EOF:
                self.inbox.put_nowait((self.wire.arrived(message), message))
            self.inbox.put_nowait(None)
        except grpc.aio.AioRpcError as err:
            self.inbox.put_nowait(err)

    def _queue_write(self, message) -> asyncio.Future:
        """Writes ``message`` after the writes before it (gRPC takes one at a time)."""
        before = self._last_write

        async def write() -> None:
            if before is not None:
                with contextlib.suppress(Exception):
                    await before
            await self.call.write(message)

        task = self._last_write = asyncio.ensure_future(write())
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        return task

    async def write(self, message) -> None:
        await self.wire.send(message, round_trip=True)
        queued = self._queue_write(message)
        self.started = True
        try:
            await asyncio.shield(queued)
        except asyncio.InvalidStateError:
            # The call ended first (the verifier went away, an eviction while idle, a
            # drain): the reader has its status, after any replies nobody read (those of
            # cancelled suggestions), which no longer matter.
            await self._status()
            raise ProtocolError("the verifier ended the stream before the suggestion "
                                "finished") from None

    async def _status(self) -> None:
        """Raises the ended call's error status, once the reader has it; returns if the
        call ended cleanly."""
        async with asyncio.timeout(self.wire.conn.deadlines.reply_s):
            while (item := await self.inbox.get()) is not None:
                if isinstance(item, grpc.aio.AioRpcError):
                    raise item

    def write_soon(self, message) -> None:
        """For a cancel, from a task being cancelled: sent without waiting."""
        self.wire._count(False, message.ByteSize(), 0)
        self._queue_write(message)

    async def read(self, state: GenerationState):
        """The next step of the current suggestion and when the device has it (None at the
        stream's end); steps of superseded suggestions are dropped."""
        while True:
            t0 = time.perf_counter()
            try:
                async with asyncio.timeout(self.wire.conn.deadlines.reply_s):
                    item = await self.inbox.get()
            finally:
                self.wire.stats.wait_s += time.perf_counter() - t0
            if isinstance(item, grpc.aio.AioRpcError):
                raise item
            if item is None:
                return None, time.perf_counter()
            at, reply = item
            if not reply.HasField("step"):  # the open's round was superseded
                continue
            if state.is_stale(reply.step):
                self.wire.stats.stale_steps += 1
                continue
            return reply, at

    async def finish(self) -> None:
        """A suggestion finished; the session stays open for the next edit."""

    def close(self) -> None:
        self.call.cancel()
        self.reader.cancel()


class SessionKeeper:
    """One editable session across the suggestions of a document: its routing key, and its
    stream while one is open."""

    def __init__(self) -> None:
        self.routing_key = new_routing_key()
        self.stream: KeptStream | None = None

    def drop(self) -> None:
        """Ends the stream (its session closes); the next suggestion reopens."""
        if self.stream is not None:
            self.stream.close()
            self.stream = None
