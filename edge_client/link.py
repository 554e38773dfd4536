"""How long a message takes between the device and the verifier, beyond what gRPC takes.

The client core asks its link when to send each message and when the device "has" each
reply, so that one implementation runs on a real network (``Link``: no delay), on loopback
with an injected round-trip time (``DelayLink``, for measuring a WAN on one machine), or under
the fleet's per-device network emulation (edge_client.bench.fleet).
"""

from __future__ import annotations

import asyncio
import time


class Link:
    """A real network: no delay added."""

    async def send(self, nbytes: int) -> None:
        """Returns when a message of ``nbytes`` has crossed the uplink."""

    def arrival(self, nbytes: int) -> float:
        """A message of ``nbytes`` was just received: the time the device has it
        (``time.perf_counter()`` clock)."""
        return time.perf_counter()


class DelayLink(Link):
    """A fixed round-trip time, half each way."""

    def __init__(self, rtt_ms: float) -> None:
        if rtt_ms < 0:
            raise ValueError("rtt_ms must be >= 0")
        self.one_way_s = rtt_ms / 2000

    async def send(self, nbytes: int) -> None:
        if self.one_way_s:
            await asyncio.sleep(self.one_way_s)

    def arrival(self, nbytes: int) -> float:
        return time.perf_counter() + self.one_way_s


async def until(t: float) -> None:
    """Sleeps until ``time.perf_counter()`` reaches ``t``."""
    delay = t - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)
