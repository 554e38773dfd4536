"""One generation's messages on the wire: ``Wire`` sends, reads and ends them through the
connection and its (emulated) link, and accounts what they cost in ``GenerationStats``;
``Delivery`` is what one target forward brought the device. The client core
(edge_client.core) and the streams it talks on (edge_client.session_streams) share them.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

import grpc

from edge_client.generation_state import GenerationState, ProtocolError
from shared.pb import verifier_pb2 as pb

if TYPE_CHECKING:
    from edge_client.connection import Connection
    from edge_client.drafter import Proposal

# How long the core waits for the verifier to end a finished stream before cancelling it.
END_GRACE_S = 2.0


@dataclass
class GenerationStats:
    new_tokens: int = 0
    rounds: int = 0  # steps: target forwards that committed tokens for this generation
    drafted: int = 0
    accepted: int = 0
    round_trips: int = 0
    target_forwards: int = 0
    bytes_up: int = 0  # serialized protobuf bytes sent
    bytes_down: int = 0  # serialized protobuf bytes received
    feature_bytes: int = 0  # of bytes_down: the target features (Step.feature)
    reopens: int = 0
    # Draft-only fallback: tokens the draft proposed alone while the verifier was away,
    # those still unverified at the end, and those the verifier then replaced.
    drafted_alone: int = 0
    unverified_tokens: int = 0
    replaced_tokens: int = 0
    # Positions the verifier's forwards fed for this generation (Step.fed_tokens).
    fed_tokens: int = 0
    # Editing sessions: steps of superseded suggestions that arrived and were dropped.
    stale_steps: int = 0
    # The status of every attempt lost (whether it was retried or ended the generation),
    # by code name: what a load test reports as errors.
    lost_attempts: dict[str, int] = field(default_factory=dict)
    draft_s: float = 0.0
    wait_s: float = 0.0  # waiting for replies (network + the server's queue and forwards)
    verify_s: float = 0.0  # the server's own queue + forward time
    backoff_s: float = 0.0
    wall_s: float = 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_round(self) -> float:
        return self.new_tokens / self.rounds if self.rounds else 0.0

    def describe(self) -> str:
        """The stats in one line a new user can read: accepted drafts per drafted token,
        tokens per target forward, and the forwards saved against cloud-only decoding (one
        forward per token)."""
        saved = 1 - self.target_forwards / self.new_tokens if self.new_tokens else 0.0
        per_forward = self.new_tokens / self.target_forwards if self.target_forwards else 0.0
        return (f"{self.new_tokens} tokens in {self.wall_s:.2f} s "
                f"({self.new_tokens / self.wall_s if self.wall_s else 0.0:.1f} tok/s): "
                f"{self.accepted} of {self.drafted} drafted tokens accepted "
                f"({self.acceptance_rate:.0%}), {per_forward:.2f} tokens per target forward, "
                f"{self.target_forwards} target forwards where cloud-only decoding takes "
                f"{self.new_tokens} ({saved:.0%} saved); {self.round_trips} round trips, "
                f"{self.reopens} reopens")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["network_s"] = max(0.0, self.wait_s - self.verify_s)
        d["acceptance_rate"] = self.acceptance_rate
        d["tokens_per_round"] = self.tokens_per_round
        d["tokens_per_s"] = self.new_tokens / self.wall_s if self.wall_s else 0.0
        return d


@dataclass(frozen=True)
class Delivery:
    """Tokens the device has, from one target forward, with the costs charged to them."""

    tokens: list[int]
    at: float  # when the device has them (time.perf_counter(), after any emulated delay)
    drafted: int
    accepted: int
    forwards: int
    queue_s: float
    forward_s: float
    round_trips: int  # since the previous delivery, failed attempts included
    bytes_up: int
    bytes_down: int
    decoded: bool = False  # from a Decode: the verifier decoded alone
    # False: drafted on the device alone (draft-only fallback), not verified yet.
    verified: bool = True
    # Unverified tokens at the end of what was delivered before that this delivery takes
    # back (they are verified now: kept ones come again in ``tokens``, the rest replaced).
    replaces: int = 0


class Wire:
    """One generation's messages through the connection and its link, with accounting."""

    def __init__(self, conn: Connection, stats: GenerationStats, routing_key: str) -> None:
        self.conn = conn
        self.stats = stats
        self.metadata = conn.metadata(routing_key)
        self.pending = [0, 0, 0]  # round trips, bytes up, bytes down not yet delivered

    def session(self):
        return self.conn.stub.Session(timeout=self.conn.deadlines.stream_s,
                                      metadata=self.metadata)

    async def send(self, message, round_trip: bool) -> None:
        """Accounts for a message and lets the (emulated) network carry it."""
        size = message.ByteSize()
        self._count(round_trip, size, 0)
        await self.conn.link.send(size)

    async def write(self, call, message, round_trip: bool) -> None:
        await self.send(message, round_trip)
        try:
            await call.write(message)
        except asyncio.InvalidStateError:
            # The verifier ended the stream first (an eviction while we drafted, a drain):
            # reading raises its status.
            await call.read()
            raise ProtocolError("the verifier ended the stream before the generation "
                                "finished") from None

    async def read(self, call):
        """The next message and when the device has it; None at the stream's end."""
        t0 = time.perf_counter()
        try:
            # asyncio.timeout, not wait_for: wait_for can swallow a cancellation that
            # arrives together with a result (Python 3.11), and cancel() must always win.
            async with asyncio.timeout(self.conn.deadlines.reply_s):
                message = await call.read()
        finally:
            self.stats.wait_s += time.perf_counter() - t0
        if message is grpc.aio.EOF:
            return None, time.perf_counter()
        return message, self.arrived(message)

    def arrived(self, message) -> float:
        size = message.ByteSize()
        self._count(False, 0, size)
        return self.conn.link.arrival(size)

    def _count(self, round_trip: bool, up: int, down: int) -> None:
        s, p = self.stats, self.pending
        s.round_trips += round_trip
        s.bytes_up += up
        s.bytes_down += down
        p[0] += round_trip
        p[1] += up
        p[2] += down

    def deliver(self, state: GenerationState, step: pb.Step, proposal: Proposal | None,
                at: float, decoded: bool = False) -> Delivery:
        shown = state.num_unverified
        new = state.apply(step, proposal)
        s = self.stats
        s.rounds += 1
        s.new_tokens += len(new)
        s.drafted += step.num_drafted
        s.accepted += step.num_accepted
        s.target_forwards += step.target_forwards
        s.fed_tokens += step.fed_tokens
        if step.HasField("feature"):
            s.feature_bytes += step.feature.ByteSize()
        queue_s, forward_s = step.timing.queue_ns / 1e9, step.timing.forward_ns / 1e9
        s.verify_s += queue_s + forward_s
        (rt, up, down), self.pending = self.pending, [0, 0, 0]
        s.replaced_tokens = state.replaced
        return Delivery(new, at, step.num_drafted, step.num_accepted, step.target_forwards,
                        queue_s, forward_s, rt, up, down, decoded, replaces=shown)

    async def end(self, call) -> None:
        """Half-closes a finished stream and lets the verifier end it with its status."""
        with contextlib.suppress(grpc.aio.AioRpcError, TimeoutError):
            await call.done_writing()
            async with asyncio.timeout(END_GRACE_S):
                while await call.read() is not grpc.aio.EOF:
                    pass
