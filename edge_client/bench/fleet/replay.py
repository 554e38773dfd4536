"""Recorded drafts: the target's greedy continuation of every request of a workload and the
draft model's greedy drafts along it, cached on disk, so that a server benchmark can replay
them without running the draft on the (simulated) devices.

The continuation comes from the verifier's Generate RPC through the client core's "cloud"
protocol (edge_client.core): lossless verification commits exactly that text.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from edge_client import core
from edge_client.bench.fleet.workload import Request
from edge_client.combined_drafter import make_drafter
from edge_client.connection import Connection, Deadlines, RetryPolicy
from edge_client.drafter import DraftSampling, Proposal
from edge_client.generation_state import CLOUD, GenerationState, ServerLimits, SessionParams
from shared.pb import verifier_pb2 as pb

REPLAY_FORMAT = 4  # bump when Recording (or what it records) changes
# Recording is not load: generous deadlines, the core's retries.
RECORD_DEADLINE_S = 600.0


@dataclass
class Recording:
    """The target's greedy continuation of one request and the model's drafts along it."""

    max_new_tokens: int
    continuation: list[int]
    proposals: list[list[int]]  # [j]: K greedy drafts after prompt + continuation[:j]
    confidences: list[list[float]]  # [j]: the draft's probability of each of them

    def covers(self, request: Request) -> bool:
        return (self.max_new_tokens >= request.max_new_tokens
                or len(self.continuation) < self.max_new_tokens)  # it ended on a stop token


class ReplayBook:
    """Recorded greedy proposals per request, cached as JSON on disk."""

    def __init__(self, path: Path | None, identity: dict) -> None:
        self.path = path
        self.identity = identity
        self.recordings: dict[str, Recording] = {}
        if path is not None and path.exists():
            data = json.loads(path.read_text())
            if data.get("identity") == identity:
                self.recordings = {k: Recording(**v) for k, v in data["recordings"].items()}

    def save(self) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"identity": self.identity, "recordings": {
            k: asdict(v) for k, v in self.recordings.items()}}))
        tmp.replace(self.path)

    def lookup(self, request: Request, committed: list[int], k: int) -> Proposal | None:
        rec = self.recordings.get(request.key)
        if rec is None:
            return None
        j = len(committed) - len(request.prompt_ids)
        if j >= len(rec.proposals) or committed[len(request.prompt_ids):] != \
                rec.continuation[:j]:
            return None
        # Recorded with the book's K (identity), never less than a device asks for; a greedy
        # proposal for k is the first k of it, a stopped one included (a stop depends on the
        # drafts before it only).
        return Proposal(rec.proposals[j][:k], None, rec.confidences[j][:k])


def draft_identity(draft_dir: Path) -> list:
    """What the recorded drafts depend on: the draft model's files (name, size, mtime)."""
    return sorted([p.name, p.stat().st_size, p.stat().st_mtime_ns]
                  for p in Path(draft_dir).iterdir() if p.is_file())


def book_path(identity: dict) -> Path:
    """The default cache file of a book: $EDGESPEC_CACHE/fleet-replay/<digest>.json."""
    import hashlib

    from shared.paths import cache_dir

    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()
    return cache_dir() / "fleet-replay" / f"{digest[:16]}.json"


def greedy_proposals(model, prompt: list[int], continuation: list[int], k: int,
                     drafter: str = "model", stop_confidence: float = 0.0) -> list[Proposal]:
    """The ``drafter``'s greedy proposals of up to ``k`` after each prefix of the
    continuation: what a device drafting with it proposes there."""
    draft = make_drafter(drafter, model, DraftSampling(stop_confidence=stop_confidence),
                         np.random.default_rng(0))
    return [draft.propose(prompt + continuation[:j], k) for j in range(len(continuation))]


async def _no_drafts(committed: list[int], k: int) -> Proposal:
    return Proposal([], None)


async def target_continuation(conn: Connection, info: pb.GetInfoResponse,
                              request: Request) -> list[int]:
    """The target's greedy continuation of ``request``, from the verifier's Generate."""
    state = GenerationState(list(request.prompt_ids), SessionParams(request.max_new_tokens),
                            ServerLimits.from_info(info), draft_len=0, protocol=CLOUD)
    tokens: list[int] = []
    async with contextlib.aclosing(core.generate(
            conn, state, _no_drafts, core.GenerationStats(), info,
            np.random.default_rng(0))) as deliveries:
        async for delivery in deliveries:
            tokens.extend(delivery.tokens)
    return tokens


async def record_replay(book: ReplayBook, address: str, info: pb.GetInfoResponse,
                        requests: list[Request], model_factory: Callable, k: int,
                        drafter: str = "model", stop_confidence: float = 0.0,
                        concurrency: int = 8, progress: bool = True) -> int:
    """Records every request missing from the book; returns how many were recorded."""
    longest: dict[str, Request] = {}
    for r in requests:
        if r.key not in longest or r.max_new_tokens > longest[r.key].max_new_tokens:
            longest[r.key] = r
    todo = [r for r in longest.values()
            if r.key not in book.recordings or not book.recordings[r.key].covers(r)]
    if not todo:
        return 0
    from tqdm import tqdm

    conn = Connection(address, deadlines=Deadlines(RECORD_DEADLINE_S, RECORD_DEADLINE_S,
                                                   RECORD_DEADLINE_S),
                      retry=RetryPolicy(budget_s=RECORD_DEADLINE_S))
    gate = asyncio.Semaphore(concurrency)
    model = model_factory()
    bar = tqdm(total=len(todo), desc="recording drafts", unit="req", file=sys.stderr,
               disable=not progress)

    async def one(req: Request) -> None:
        async with gate:
            tokens = await target_continuation(conn, info, req)
        proposals = await asyncio.to_thread(greedy_proposals, model, list(req.prompt_ids),
                                            tokens, k, drafter, stop_confidence)
        book.recordings[req.key] = Recording(req.max_new_tokens, tokens,
                                             [p.tokens for p in proposals],
                                             [p.confidence or [] for p in proposals])
        bar.update(1)

    try:
        await asyncio.gather(*(one(r) for r in todo))
    finally:
        bar.close()
        await conn.close()
    book.save()
    return len(todo)
