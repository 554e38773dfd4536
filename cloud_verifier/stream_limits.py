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
        self.evacuate = asyncio.Event()

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


async def guarded(replies: AsyncIterator[T], streams: LiveStreams, stall_s: float,
                  on_stall: Callable[[], None],
                  draining_error: Callable[[], Exception]) -> AsyncIterator[T]:
    """``replies``, ended by ``draining_error()`` once ``streams.evacuate`` is set, with
    ``on_stall`` called when a reply sits unwritten for ``stall_s``."""
    loop = asyncio.get_running_loop()
    evacuate = asyncio.ensure_future(streams.evacuate.wait())
    upcoming: asyncio.Future | None = None
    try:
        while True:
            upcoming = asyncio.ensure_future(anext(replies))
            await asyncio.wait({upcoming, evacuate}, return_when=asyncio.FIRST_COMPLETED)
            if not upcoming.done():
                upcoming.cancel()
                await asyncio.wait({upcoming})  # let the handler unwind first
                raise draining_error()
            try:
                reply = upcoming.result()
            except StopAsyncIteration:
                return
            timer = loop.call_later(stall_s, on_stall)
            try:
                yield reply
            finally:
                timer.cancel()
    finally:
        evacuate.cancel()
        if upcoming is not None and not upcoming.done():
            # The call is going away (cancelled, or closed from outside): the handler's own
            # clean-up runs before the caller closes ``replies``.
            upcoming.cancel()
            await asyncio.wait({upcoming})
