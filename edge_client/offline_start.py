"""Draft-only generations that do not wait for an absent verifier.

With ``fallback="draft-only"`` the device suggests with its draft alone, marked unverified,
while the verifier is away. Waiting for the verifier to be declared away (a refused
connection is quick, but an unroutable host or a frozen one costs the GetInfo deadline, and
a retry loop costs its whole budget) would make the fallback useless for a UI: the user
waits as if there were no fallback. So:

- one ``VerifierProbe`` per client asks the verifier for GetInfo in the background, with the
  retry policy's back-off, until it answers or the retry budget passes;
- ``connect()``, each generation and each document suggestion ask it for a try at once
  (cutting its back-off short) and wait for that try at most ``OFFLINE_AFTER_S`` (and at
  most half their latency budget). A refused connection fails the try at once, so the draft
  starts at once; a try that hangs (a silent verifier) is waited for once, not by every
  later request while it is out;
- ``draft_until_reached`` then drafts alone, stopping between proposals as soon as the probe
  has an answer, so that the core (edge_client.core.generate) verifies the unverified tokens
  as its first drafts and replaces what the target does not accept.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import grpc
import numpy as np

from edge_client.connection import Backoff
from edge_client.core import Delivery, GenerationStats, Propose, draft_alone
from edge_client.errors import VerifierUnavailable
from edge_client.generation_state import GenerationState
from shared.errors import ErrorDetails

log = logging.getLogger(__name__)

# The longest a draft-only generation waits for a verifier that has not answered yet before
# its draft starts alone: the first token must come within ~1 s of the request, and the
# draft's own first proposal costs tens of milliseconds on top.
OFFLINE_AFTER_S = 0.5


class VerifierProbe:
    """Reaches the client's verifier in the background: GetInfo (``client.refresh_info``,
    which sets ``client.info``) until it answers, with back-off between tries. A caller that
    waits (``wait``) cuts the back-off short: its try starts at once, as a GetInfo of its
    own did before the probe. Past the retry budget the probe ends with VerifierUnavailable;
    ``start()`` then begins a new one."""

    def __init__(self, client) -> None:
        self.client = client
        self._task: asyncio.Task | None = None
        self._wake = asyncio.Event()  # a waiter wants a try now, not after the back-off
        self._changed = asyncio.Event()  # set (and replaced) when a try ends
        self.tries = 0  # tries started
        self.tries_done = 0
        # The try whose wait already ran out (a silent verifier's try hangs for gRPC's
        # connection attempt): later waits for that same try do not wait again.
        self._waited_out_try = 0

    @property
    def reached(self) -> bool:
        return self.client.info is not None

    def start(self) -> None:
        if self.reached or (self._task is not None and not self._task.done()):
            return
        self._task = asyncio.get_running_loop().create_task(self._run(),
                                                            name="edgespec-verifier-probe")

    async def _run(self) -> None:
        client = self.client
        # Back-off jitter only: it never touches the output.
        backoff = Backoff(client.conn.retry, np.random.default_rng())
        away = ErrorDetails(grpc.StatusCode.UNAVAILABLE, None, None,
                            f"the verifier at {client.conn.address} is unreachable", {})
        first = True
        try:
            while True:
                self.tries += 1
                self._wake.clear()
                try:
                    await client.refresh_info()
                    log.info("the verifier at %s answered after %d tries",
                             client.conn.address, self.tries)
                    return
                except VerifierUnavailable as err:
                    if first:
                        log.warning("%s; the draft suggests alone until it answers", err)
                    first = False
                finally:
                    self.tries_done += 1
                    self._signal()
                await self._pause(backoff, away)
        finally:
            self._signal()

    def _signal(self) -> None:
        """Wakes the waiters of the try that ended. The event is replaced, never left set:
        a set one would return at once from every later ``wait`` loop, which then spins
        without yielding, so no task (the next probe's included) and no timeout runs."""
        self._changed.set()
        self._changed = asyncio.Event()

    async def _pause(self, backoff: Backoff, away: ErrorDetails) -> None:
        """The back-off before the next try, cut short by a waiter; VerifierUnavailable
        past the retry budget."""
        sleep = asyncio.ensure_future(backoff.wait(away))
        woken = asyncio.ensure_future(self._wake.wait())
        try:
            await asyncio.wait([sleep, woken], return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (sleep, woken):
                task.cancel()
            await asyncio.gather(sleep, woken, return_exceptions=True)
        if sleep.done() and not sleep.cancelled() and sleep.exception() is not None:
            raise sleep.exception()

    async def wait(self, timeout_s: float) -> bool:
        """Whether the verifier has answered, after a try that starts now (or the one out),
        waited for at most ``timeout_s``; not waited for again once a wait for it ran out.
        Raises what ended the probe if that was not the verifier's absence
        (IncompatibleVerifier, RequestRejected)."""
        self.start()
        want = self.tries_done + 1
        if not self.reached and want != self._waited_out_try and timeout_s > 0:
            self._wake.set()
            try:
                async with asyncio.timeout(timeout_s):
                    while not (self.reached or self.tries_done >= want or self._task.done()):
                        await self._changed.wait()
            except TimeoutError:
                self._waited_out_try = want
        self._raise_failure()
        return self.reached

    async def settle(self) -> bool:
        """Waits for the probe to end: True once the verifier answered, False when it stayed
        away for the retry budget."""
        self.start()
        if self._task is not None:
            await asyncio.wait([self._task])
        self._raise_failure()
        return self.reached

    def _raise_failure(self) -> None:
        task = self._task
        if task is None or not task.done() or task.cancelled():
            return
        err = task.exception()
        if err is not None and not isinstance(err, VerifierUnavailable):
            raise err

    async def close(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task


def offline_wait_s(budget_ms: float | None) -> float:
    """How long a generation waits for an unanswered verifier before drafting alone: within
    ``OFFLINE_AFTER_S`` and half its latency budget (the rest is for drafting)."""
    if budget_ms is None:
        return OFFLINE_AFTER_S
    return min(OFFLINE_AFTER_S, budget_ms / 2000)


async def draft_until_reached(probe: VerifierProbe, state: GenerationState, propose: Propose,
                              stop_ids: frozenset[int],
                              stats: GenerationStats) -> AsyncIterator[Delivery]:
    """The draft alone, unverified, until the probe reaches the verifier (checked between
    proposals) or the generation's room is used; then waits for the probe. Returns with
    ``probe.reached`` False when the verifier stayed away for the retry budget."""
    async for delivery in draft_alone(state, propose, stop_ids, stats,
                                      until=lambda: probe.reached):
        yield delivery
    if not probe.reached:
        await probe.settle()
