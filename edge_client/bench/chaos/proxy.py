"""A TCP proxy between a client and a verifier that injects faults at chosen gRPC messages.

Every fault is count-based and fires at most once: "after the N-th message of connection C
in direction D", counted by ``http2.GrpcMessageScanner`` on the bytes the proxy forwards
unchanged. So a plan is reproducible and bounded; only timing-free facts place a fault.

Kinds (``Fault.kind``):

- ``delay``: message N reaches the other end ``delay_s`` late (and, TCP being in order,
  everything after it on that direction too). A delay past the client's reply deadline is
  a stall the client must notice by itself.
- ``close``: message N is forwarded, then both sides are closed cleanly (FIN).
- ``reset``: half of message N is forwarded, then both sides are reset (RST).
- ``blackhole``: message N is forwarded, then nothing more in either direction while the
  sockets stay open: a silent partition, which only keepalive can detect.
- ``lose-reply``: client message N (a round) reaches the verifier; everything the verifier
  sends afterwards is swallowed until its next whole message (the round's answer) has been
  received, then both sides are reset. The client's retry thus re-sends a round the verifier
  has already verified.
- ``call``: message N is forwarded, then ``action()`` runs (the chaos run kills or stops the
  verifier this way).
- ``hold``: connection C's first bytes from the verifier (its HTTP/2 SETTINGS) reach the
  client ``delay_s`` late: a slow link's handshake.
- ``refuse``: connection C is reset as soon as it is accepted, before any byte.
- ``mute``: connection C is accepted and never answered (the verifier is not dialled).

A connection whose verifier cannot be dialled is reset, as a refused connection would be.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from edge_client.bench.chaos.http2 import GrpcMessageScanner

log = logging.getLogger(__name__)

UP, DOWN = "up", "down"  # client -> verifier, verifier -> client
DELAY, CLOSE, RESET, BLACKHOLE, LOSE_REPLY, CALL = (
    "delay", "close", "reset", "blackhole", "lose-reply", "call")
REFUSE, MUTE, HOLD = "refuse", "mute", "hold"
MESSAGE_KINDS = frozenset({DELAY, CLOSE, RESET, BLACKHOLE, LOSE_REPLY, CALL})
ACCEPT_KINDS = frozenset({REFUSE, MUTE})
CONNECTION_KINDS = ACCEPT_KINDS | {HOLD}
CHUNK_BYTES = 64 * 1024
# A lose-reply fault resets the connection at the latest this long after the round passed,
# should the verifier never answer it.
LOSE_REPLY_LIMIT_S = 10.0


@dataclass(frozen=True)
class Fault:
    kind: str
    connection: int = 0  # the proxy's accepted connections, numbered from 0
    direction: str = DOWN  # whose messages are counted (message kinds only)
    message: int = 0  # fires at this message, numbered from 0 per connection and direction
    delay_s: float = 0.0  # delay only
    action: Callable[[], None] | None = field(default=None, compare=False)  # call only

    def __post_init__(self) -> None:
        if self.kind not in MESSAGE_KINDS | CONNECTION_KINDS:
            raise ValueError(f"unknown fault kind {self.kind!r}")
        if self.direction not in (UP, DOWN):
            raise ValueError(f"direction must be {UP!r} or {DOWN!r}")
        if self.kind == LOSE_REPLY and self.direction != UP:
            raise ValueError("lose-reply counts the client's messages (direction 'up')")
        if self.kind == CALL and self.action is None:
            raise ValueError("a call fault needs an action")
        if self.connection < 0 or self.message < 0 or self.delay_s < 0:
            raise ValueError("connection, message and delay_s must be >= 0")

    def describe(self) -> str:
        if self.kind in CONNECTION_KINDS:
            extra = f" {self.delay_s:g} s" if self.kind == HOLD else ""
            return f"{self.kind}{extra} connection {self.connection}"
        extra = f" {self.delay_s:g} s" if self.kind == DELAY else ""
        return (f"{self.kind}{extra} at {self.direction} message {self.message} of connection "
                f"{self.connection}")


@dataclass(frozen=True)
class Fired:
    fault: str  # Fault.describe()
    at_s: float  # seconds since the proxy started


def _reset(writer: asyncio.StreamWriter | None) -> None:
    """Closes with RST: SO_LINGER 0 makes the kernel reset instead of a FIN."""
    if writer is None or writer.transport.is_closing():
        return
    sock = writer.get_extra_info("socket")
    with contextlib.suppress(OSError):
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


class _Connection:
    def __init__(self, index: int, client: asyncio.StreamWriter) -> None:
        self.index = index
        self.writers: dict[str, asyncio.StreamWriter | None] = {DOWN: client, UP: None}
        self.scanners = {UP: GrpcMessageScanner(client_side=True),
                         DOWN: GrpcMessageScanner(client_side=False)}
        self.silent = False  # blackholed: read and discard, forward nothing
        self.swallow_reply = False  # lose-reply: drop the verifier's bytes until a message
        self.ended = False
        self.done = asyncio.Event()  # set once the proxy has ended the connection

    def reset(self) -> None:
        self.ended = True
        self.done.set()
        for writer in self.writers.values():
            _reset(writer)

    def close(self) -> None:
        self.ended = True
        self.done.set()
        for writer in self.writers.values():
            if writer is not None and not writer.transport.is_closing():
                writer.close()


class FaultProxy:
    """Listens on a free loopback port and relays each connection to ``upstream``."""

    def __init__(self, upstream: str, faults: Sequence[Fault] = ()) -> None:
        host, _, port = upstream.rpartition(":")
        self.upstream = (host, int(port))
        self.faults = tuple(faults)
        self.fired: list[Fired] = []
        self.connections = 0
        self.swallowed_replies = 0  # verifier messages a lose-reply fault kept from the client
        self._server: asyncio.AbstractServer | None = None
        self._live: set[_Connection] = set()
        self._tasks: set[asyncio.Task] = set()
        self._t0 = time.perf_counter()

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self._t0 = time.perf_counter()
        return f"127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def close(self) -> None:
        """Stops listening and resets the connections still open."""
        if self._server is not None:
            self._server.close()
        for conn in list(self._live):
            conn.reset()  # their pumps then see their ends and return
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=5)
        for task in list(self._tasks):
            task.cancel()
        if self._server is not None:
            await self._server.wait_closed()

    def _fire(self, fault: Fault) -> None:
        self.fired.append(Fired(fault.describe(), round(time.perf_counter() - self._t0, 3)))
        log.info("fault: %s", fault.describe())

    def _faults(self, conn: _Connection, direction: str) -> dict[int, Fault]:
        return {f.message: f for f in self.faults if f.kind in MESSAGE_KINDS
                and f.connection == conn.index and f.direction == direction}

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._tasks.add(task)
        conn = _Connection(self.connections, writer)
        self.connections += 1
        self._live.add(conn)
        try:
            await self._relay(conn, reader)
        except asyncio.CancelledError:
            conn.reset()  # the proxy is closing; asyncio's server awaits no result
        finally:
            self._live.discard(conn)
            self._tasks.discard(task)

    async def _relay(self, conn: _Connection, client_reader: asyncio.StreamReader) -> None:
        at_accept = [f for f in self.faults if f.kind in ACCEPT_KINDS
                     and f.connection == conn.index]
        if at_accept and at_accept[0].kind == REFUSE:
            self._fire(at_accept[0])
            conn.reset()
            return
        if at_accept:  # mute: read and drop until the client gives up
            self._fire(at_accept[0])
            with contextlib.suppress(ConnectionError):
                while await client_reader.read(CHUNK_BYTES):
                    pass
            conn.reset()
            return
        try:
            up_reader, conn.writers[UP] = await asyncio.open_connection(*self.upstream)
        except OSError:
            conn.reset()  # the verifier is down: the client sees its connection refused
            return
        try:
            await asyncio.gather(self._pump(conn, UP, client_reader),
                                 self._pump(conn, DOWN, up_reader))
        finally:
            conn.close()

    async def _pump(self, conn: _Connection, direction: str,
                    reader: asyncio.StreamReader) -> None:
        """Relays one direction until its end, applying that direction's faults."""
        faults = self._faults(conn, direction)
        writer = conn.writers[UP if direction == UP else DOWN]
        scanner = conn.scanners[direction]
        hold = [f for f in self.faults if f.kind == HOLD and f.connection == conn.index
                and direction == DOWN]
        while True:
            try:
                data = await reader.read(CHUNK_BYTES)
            except ConnectionError:  # reset by one side: reset the other too
                conn.reset()
                return
            if not data:
                if conn.silent and direction == DOWN:
                    await conn.done.wait()  # the verifier's end is not passed on either
                    return
                if conn.silent or conn.ended:
                    conn.reset()
                    return
                with contextlib.suppress(OSError, RuntimeError):
                    if writer.can_write_eof():
                        writer.write_eof()
                return
            if conn.ended:
                return
            if hold:
                fault = hold.pop()
                self._fire(fault)
                await asyncio.sleep(fault.delay_s)
            base = scanner.offset
            messages = scanner.feed(data)
            if conn.silent:
                continue
            if direction == DOWN and conn.swallow_reply:
                self.swallowed_replies += len(messages)
                if messages:
                    conn.reset()
                    return
                continue
            sent = 0
            for message in messages:
                fault = faults.get(message.index)
                if fault is None:
                    continue
                cut = message.end - base
                if fault.kind == RESET:
                    cut = max(sent, (message.start + message.end) // 2 - base)
                elif fault.kind == DELAY:
                    cut -= 1  # the message's last byte waits
                elif fault.kind == LOSE_REPLY:
                    conn.swallow_reply = True  # before the round can be answered
                    asyncio.get_running_loop().call_later(LOSE_REPLY_LIMIT_S, conn.reset)
                if not await self._write(conn, writer, data[sent:cut]):
                    return
                sent = cut
                self._fire(fault)
                if fault.kind == DELAY:
                    await asyncio.sleep(fault.delay_s)
                elif fault.kind == RESET:
                    conn.reset()
                    return
                elif fault.kind == CLOSE:
                    conn.close()
                    return
                elif fault.kind == BLACKHOLE:
                    conn.silent = True
                    break
                elif fault.kind == CALL:
                    fault.action()
            if not conn.silent and not await self._write(conn, writer, data[sent:]):
                return

    @staticmethod
    async def _write(conn: _Connection, writer: asyncio.StreamWriter, data: bytes) -> bool:
        """False when the other side is gone (the connection is then reset)."""
        if not data:
            return True
        try:
            writer.write(data)
            await writer.drain()
            return True
        except (ConnectionError, RuntimeError):
            conn.reset()
            return False
