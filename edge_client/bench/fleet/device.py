"""One simulated device: its requests, one after another, each one generation of the client
core (edge_client.core) over the device's own connection and emulated network.

The device adds no protocol or retry logic: it builds each request's ``GenerationState``,
runs ``edge_client.core.generate`` with a ``NetEmLink`` and its drafts, and turns the
deliveries into a ``RequestRecord``. What the core retried comes from its stats
(``GenerationStats.lost_attempts``); what failed a request, from what the core raised.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from edge_client import core
from edge_client.bench.fleet.config import FleetConfig
from edge_client.bench.fleet.drafts import DraftSource
from edge_client.bench.fleet.netem import NetEm, NetEmLink
from edge_client.bench.fleet.workload import Request
from edge_client.connection import Connection
from edge_client.drafter import Proposal
from edge_client.errors import IncompatibleVerifier, RequestRejected, VerifierUnavailable
from edge_client.generation_state import (
    NO_DRAFTS,
    ROUNDS,
    GenerationState,
    ProtocolError,
    ServerLimits,
    SessionParams,
)
from edge_client.rate_chooser import RateChooser
from shared.pb import verifier_pb2 as pb

log = logging.getLogger(__name__)

FAILURE_PAUSE_S = 0.1  # after a failed request: do not spin on a failing server


@dataclass
class RequestRecord:
    kind: str
    start: float
    # (delivery time, tokens, target forwards, round trips, bytes up, bytes down,
    #  server queue s, server forward s)
    events: list[tuple] = field(default_factory=list)
    completed: bool = False
    failed: str | None = None  # the status (code name) that failed it
    reopens: int = 0
    drafted: int = 0
    accepted: int = 0
    drafting_forwards: int = 0  # target forwards that verified at least one draft
    continued: int = 0  # tokens from Decodes (the verifier decoding alone)
    prompt_key: str = ""
    max_new_tokens: int = 0
    output: list[int] = field(default_factory=list)  # every token received

    def add(self, d: core.Delivery) -> None:
        self.output.extend(d.tokens)
        self.events.append((d.at, len(d.tokens), d.forwards, d.round_trips, d.bytes_up,
                            d.bytes_down, d.queue_s, d.forward_s))
        self.drafted += d.drafted
        self.accepted += d.accepted
        if d.drafted:
            self.drafting_forwards += d.forwards
        if d.decoded:
            self.continued += len(d.tokens)


def failure_name(err: Exception) -> str:
    if isinstance(err, RequestRejected):
        return err.details.code.name
    if isinstance(err, VerifierUnavailable):
        return "UNAVAILABLE"
    if isinstance(err, ProtocolError):
        return "PROTOCOL_ERROR"
    return "INCOMPATIBLE_VERIFIER"


async def _no_drafts(committed: list[int], k: int) -> Proposal:
    return NO_DRAFTS


# -- the device -----------------------------------------------------------------------------


class Device:
    def __init__(self, index: int, kind: str, config: FleetConfig, address: str,
                 info: pb.GetInfoResponse, netem: NetEm, drafts: DraftSource | None,
                 schedule: Iterator[Request], rng: np.random.Generator,
                 retry_rng: np.random.Generator, stop_at: float = math.inf) -> None:
        self.index = index
        self.kind = kind
        self.config = config
        self.info = info
        self.limits = ServerLimits.from_info(info)
        self.netem = netem
        self.conn = Connection(address, deadlines=config.deadlines(), retry=config.retry(),
                               link=NetEmLink(netem))
        self.drafts = drafts
        self.schedule = schedule
        self.rng = rng  # think times
        self.retry_rng = retry_rng  # the core's back-off jitter
        self.stop_at = stop_at  # no request starts after this (time.perf_counter())
        self.records: list[RequestRecord] = []
        # Every error status seen: each attempt the core lost (retried or not), and each
        # failure it raised that no lost attempt stands for (a protocol error).
        self.errors: Counter = Counter()
        self.backoff_s = 0.0
        # Drafting vs Decode by measured rate, across this device's generations (rounds).
        self.chooser = (RateChooser() if config.adaptive and config.core_protocol == ROUNDS
                        else None)
        think = config.think_ms if config.think_ms is not None else (300.0 if kind == "ime"
                                                                     else 0.0)
        self.think_s = think / 1000

    async def close(self) -> None:
        await self.conn.close()

    async def run(self, start_delay_s: float) -> None:
        await asyncio.sleep(start_delay_s)
        for n, request in enumerate(self.schedule):
            if self.think_s:
                await asyncio.sleep(self.think_s * float(self.rng.uniform(0.5, 1.5)))
            if time.perf_counter() >= self.stop_at:
                return
            record = RequestRecord(request.kind, time.perf_counter(), prompt_key=request.key,
                                   max_new_tokens=request.max_new_tokens)
            self.records.append(record)
            try:
                await self.generate(request, n, record)
                record.completed = True
            except (RequestRejected, VerifierUnavailable, ProtocolError,
                    IncompatibleVerifier) as err:
                log.info("client %d: request failed (%s): %s", self.index, record.failed, err)
                await asyncio.sleep(FAILURE_PAUSE_S)

    async def generate(self, request: Request, n: int, record: RequestRecord) -> None:
        """One request through the core; raises what the core raises."""
        cfg = self.config
        params = SessionParams(max_new_tokens=request.max_new_tokens,
                               temperature=cfg.temperature,
                               seed=(cfg.seed * 1_000_003 + self.index * 10_007 + n) % 2**63)
        state = GenerationState(list(request.prompt_ids), params, self.limits, cfg.draft_len,
                                cfg.core_protocol, follow_suggestion=True,
                                chooser=self.chooser)
        stats = core.GenerationStats()
        propose = (self.drafts.start(request, np.random.default_rng(params.seed), stats)
                   if self.drafts is not None else _no_drafts)
        try:
            async with contextlib.aclosing(core.generate(
                    self.conn, state, propose, stats, self.info, self.retry_rng)) as deliveries:
                async for delivery in deliveries:
                    record.add(delivery)
        except (RequestRejected, VerifierUnavailable, ProtocolError,
                IncompatibleVerifier) as err:
            record.failed = failure_name(err)
            lost = stats.lost_attempts
            if isinstance(err, RequestRejected | VerifierUnavailable) and lost:
                # The attempt the core gave up on is counted as the failure.
                name = err.details.code.name if isinstance(err, RequestRejected) else None
                name = name if name in lost else next(reversed(lost))
                lost[name] -= 1
            raise
        finally:
            self.errors.update({k: v for k, v in stats.lost_attempts.items() if v > 0})
            if record.failed:
                self.errors[record.failed] += 1
            record.reopens = state.reopens
            self.backoff_s += stats.backoff_s
