"""What bounds a running stream from outside its mode: the drain and the stalled-reader limit.

``LiveStreams`` counts the Session and Generate streams in progress, so that a drain can wait
for them to end (an event, not a poll) and then evacuate the rest: every stream still running
ends at its next await with DRAINING, its round in flight dropped unapplied if its forward
has not started (RoundRunner.run_round), so the client reopens elsewhere losing nothing.

``guarded`` re-yields a stream's replies. Each reply that gRPC has not taken within the
stalled-reader limit (the client stopped reading and HTTP/2 flow control filled up) fires
``on_stall``, which ends the call from outside: the handler is stuck in gRPC's write, where
nothing of its own runs.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

T = TypeVar("T")


class LiveStreams:
    def __init__(self) -> None:
        self.count = 0
        self._none = asyncio.Event()
        self._none.set()
        # Set when a drain's grace period is over: running streams end with DRAINING.
        self.evacuating = False
        # Handler tasks awaiting their next reply (where a cancel lands in edgespec code).
        self._waiting: set[asyncio.Task] = set()
        self._evacuated: set[asyncio.Task] = set()

    @contextlib.contextmanager
    def track(self):
        self.count += 1
        self._none.clear()
        try:
            yield
        finally:
            self.count -= 1
            if self.count == 0:
                self._none.set()

    async def wait_none(self, timeout_s: float) -> bool:
        """Whether every stream ended within ``timeout_s``."""
        try:
            async with asyncio.timeout(max(0.0, timeout_s)):
                await self._none.wait()
            return True
        except TimeoutError:
            return False

    def evacuate(self) -> None:
        """Ends every running stream with DRAINING: those awaiting a reply now (their await
        is cancelled), the others before their next one."""
        self.evacuating = True
        for task in self._waiting:
            self._evacuated.add(task)
            task.cancel()


async def guarded(replies: AsyncIterator[T], streams: LiveStreams, stall_s: float,
                  on_stall: Callable[[], None],
                  draining_error: Callable[[], Exception]) -> AsyncIterator[T]:
    """``replies``, ended by ``draining_error()`` once ``streams`` evacuates, with
    ``on_stall`` called when a reply sits unwritten for ``stall_s``."""
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None
    while True:
        if streams.evacuating:
            raise draining_error()
        streams._waiting.add(task)
        try:
            reply = await anext(replies)
        except StopAsyncIteration:
            return
        except asyncio.CancelledError:
            if task not in streams._evacuated:
                raise
            streams._evacuated.discard(task)
            task.uncancel()
            raise draining_error() from None
        finally:
            streams._waiting.discard(task)
        timer = loop.call_later(stall_s, on_stall)
        try:
            yield reply
        finally:
            timer.cancel()
