"""Draft-only generations that do not wait for an absent verifier.

With ``fallback="draft-only"`` the device suggests with its draft alone, marked unverified,
while the verifier is away. Waiting for the verifier to be declared away (a refused
connection is quick, but an unroutable host or a frozen one costs the GetInfo deadline, and
a retry loop costs its whole budget) would make the fallback useless for a UI: the user
waits as if there were no fallback. So:

- one ``VerifierProbe`` per client asks the verifier for GetInfo in the background, with the
  retry policy's back-off, until it answers or the retry budget passes;
- ``connect()`` and each generation wait for it at most ``OFFLINE_AFTER_S`` (and at most
  half the generation's latency budget), and only while its first try is still out and no
  earlier wait ran out: then the verifier is known away and the draft starts at once;
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
    which sets ``client.info``) until it answers, with back-off between tries. Past the
    retry budget it ends with VerifierUnavailable; ``start()`` then begins a new one."""

    def __init__(self, client) -> None:
        self.client = client
        self._task: asyncio.Task | None = None
        self._first_try: asyncio.Event = asyncio.Event()
        # A wait for the first try already ran out: the verifier counts as away, and later
        # waits (the generation after connect()) do not add another.
        self._waited_out = False
        self.tries = 0

    @property
    def reached(self) -> bool:
        return self.client.info is not None

    def start(self) -> None:
        if self.reached or (self._task is not None and not self._task.done()):
            return
        self._first_try = asyncio.Event()
        self._waited_out = False
        self._task = asyncio.get_running_loop().create_task(self._run(),
                                                            name="edgespec-verifier-probe")

    async def _run(self) -> None:
        client = self.client
        # Back-off jitter only: it never touches the output.
        backoff = Backoff(client.conn.retry, np.random.default_rng())
        away = ErrorDetails(grpc.StatusCode.UNAVAILABLE, None, None,
                            f"the verifier at {client.conn.address} is unreachable", {})
        try:
            while True:
                self.tries += 1
                try:
                    await client.refresh_info()
                    log.info("the verifier at %s answered after %d tries",
                             client.conn.address, self.tries)
                    return
                except VerifierUnavailable as err:
                    if self.tries == 1:
                        log.warning("%s; the draft suggests alone until it answers", err)
                self._first_try.set()
                await backoff.wait(away)  # VerifierUnavailable past the retry budget
        finally:
            self._first_try.set()

    async def wait(self, timeout_s: float) -> bool:
        """Whether the verifier has answered, waiting for it at most ``timeout_s`` while the
        probe's first try is still out. Raises what ended the probe if that was not the
        verifier's absence (IncompatibleVerifier, RequestRejected)."""
        self.start()
        if not (self.reached or self._waited_out) and self._task is not None and timeout_s > 0:
            try:
                async with asyncio.timeout(timeout_s):
                    await self._first_try.wait()
            except TimeoutError:
                self._waited_out = True
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
