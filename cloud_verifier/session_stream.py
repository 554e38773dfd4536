"""What both drafting modes of a Session stream share: reading the client's messages one
ahead of the handler, so that a half-close is seen while a round waits for the model, and
ending a finished stream.

A half-close (or a cancel) closes the session at once: a round whose forward has started
runs to its end (the session stays consistent), a round still queued is dropped unapplied
and unanswered, and the stream ends OK.

A finished stream ends only once the client half-closes, or after ``HALF_CLOSE_GRACE_S``:
a grpc.aio client whose write meets an RPC the server already ended gets INTERNAL instead of
the stream's last Step and status (grpc/grpc#36066), and lookahead clients write after
every Step.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")

HALF_CLOSE_GRACE_S = 5.0


class RequestReader:
    """The requests of one stream, read by at most one task at a time."""

    def __init__(self, requests) -> None:
        self._requests = aiter(requests)
        self._next: asyncio.Task | None = None
        # Set once the client has half-closed its side.
        self.half_closed = asyncio.Event()
        # get() waits at most idle_s, then raises idle_error(): see limit_idle.
        self.idle_s: float | None = None
        self.idle_error: Callable[[], Exception] | None = None

    def limit_idle(self, idle_s: float | None, idle_error: Callable[[], Exception]) -> None:
        """From now on a get() that waits past ``idle_s`` raises ``idle_error()`` (which may
        close the session first); None lifts the limit."""
        self.idle_s, self.idle_error = idle_s, idle_error

    def read_ahead(self) -> asyncio.Task:
        """The task reading the next message (its result None at the half-close), started
        if none is running."""
        if self._next is None:
            self._next = asyncio.ensure_future(self._read())
        return self._next

    async def _read(self):
        if self.half_closed.is_set():
            return None
        message = await anext(self._requests, None)
        if message is None:
            self.half_closed.set()
        return message

    async def get(self):
        """The next message, None once the client has half-closed."""
        task = self.read_ahead()
        if self.idle_s is not None and self.idle_error is not None:
            done, _ = await asyncio.wait([task], timeout=self.idle_s)
            if not done:
                raise self.idle_error()
        self._next = None
        return await task

    def close(self) -> None:
        if self._next is not None:
            self._next.cancel()
            self._next = None


def _consume(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()


async def unless_stopped(work: Awaitable[T], stop: asyncio.Future) -> T | None:
    """``work``'s result, or None, with ``work`` cancelled, if ``stop`` completes first
    (a round cancelled so is dropped if its forward has not started: RoundRunner.run_round)."""
    task = asyncio.ensure_future(work)
    task.add_done_callback(_consume)
    try:
        await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
    return task.result() if task.done() else None
