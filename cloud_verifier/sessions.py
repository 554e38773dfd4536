"""Session table: ids, expiry, and the per-session state a round needs.

A session lives on the stream that opened it, which holds it directly: nothing looks a
session up by id, so an id (128 random bits from ``secrets``) only names it in logs and
metrics. Its owner (the caller's API key digest) scopes the prefix cache.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from cloud_verifier.draft_policy import AcceptanceTracker
from cloud_verifier.errors import TooManySessions
from cloud_verifier.kv_store import SessionKV
from cloud_verifier.sampling import SamplingParams

log = logging.getLogger(__name__)

SESSION_ID_BYTES = 16  # 128 bits
_U64 = 2**64 - 1


def position_seed(seed: int, position: int) -> int:
    """The generator seed for the round that starts at committed length ``position``.

    Randomness is a function of (session seed, position), not of a generator's history, so
    a session reopened with its full context after an eviction draws exactly the numbers
    the evicted one would have drawn: eviction cannot change the output. torch's CPU
    generator keeps only the low 32 bits of a seed, so all 64 bits of the session seed and
    the position are mixed (splitmix64's finalizer) and folded into 32.
    """
    z = (seed + (position + 1) * 0x9E3779B97F4A7C15) & _U64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _U64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _U64
    z ^= z >> 31
    return (z ^ (z >> 32)) & 0xFFFFFFFF


def short_id(session_id: str) -> str:
    """What logs show: enough to correlate, too little to hijack."""
    return session_id[:8]


@dataclass
class Session:
    id: str
    owner: str
    sampling: SamplingParams
    # Prompt plus every committed token. The KV cache covers committed[:cache_len].
    committed: list[int]
    prompt_len: int
    max_new_tokens: int  # 0: limited by max_context only
    stop_token_ids: frozenset[int]
    generator: torch.Generator
    # Target KV over committed[:kv.length] (None before the first forward).
    kv: SessionKV | None = None
    next_round: int = 0
    finished: bool = False
    # Closed to free memory (evicted) or after sitting idle past the TTL (expired): the
    # stream's next message gets the matching reason.
    evicted: bool = False
    expired: bool = False
    acceptance: AcceptanceTracker = field(default_factory=AcceptanceTracker)
    last_used: float = field(default_factory=time.monotonic)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # Admission order: under KV pressure older sessions keep their memory (batcher).
    seq: int = 0
    # Decoded by a stream the server drives (Generate, lookahead mode): never idle while it
    # lasts, so it is neither evicted nor expired, only preempted (its KV dropped and
    # recomputed later). A reader that stops reading is the stream's business: the
    # stalled-reader limit closes it as STREAM_IDLE (cloud_verifier.service).
    streamed: bool = False
    # Editable (OpenSession.editable): serves one suggestion after another; finishing one
    # does not close the session. ``suggestion`` is the current one's number.
    editable: bool = False
    suggestion: int = 0
    # Opened with want_feature: each round's outcome carries the target feature of its last
    # committed token (cloud_verifier.engine).
    want_feature: bool = False
    # Token healing: the bytes the new tokens must still spell (OpenSession.continue_with,
    # Edit.continue_with), advanced as tokens commit (cloud_verifier.engine).
    continue_with: bytes = b""
    # Whether the last suggested_draft_len was above 0; its changes are the acceptance
    # collapses (and recoveries) the metrics count.
    speculating: bool = True

    @property
    def cache_len(self) -> int:
        return 0 if self.kv is None else self.kv.length

    @property
    def num_generated(self) -> int:
        return len(self.committed) - self.prompt_len


class SessionStore:
    """Owns every live session; bounded in count and idle time."""

    def __init__(self, max_sessions: int, ttl_s: float,
                 on_close: Callable[[Session], None] = lambda session: None,
                 clock=time.monotonic) -> None:
        self._max = max_sessions
        self._on_close = on_close
        self._ttl = ttl_s
        self._clock = clock
        self._sessions: dict[str, Session] = {}
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._sessions)

    @property
    def full(self) -> bool:
        return len(self._sessions) >= self._max

    def held(self) -> Counter[str]:
        """Open sessions by owner."""
        return Counter(s.owner for s in self._sessions.values())

    def create(self, owner: str, sampling: SamplingParams, prompt: list[int],
               max_new_tokens: int, stop_token_ids: frozenset[int]) -> Session:
        if len(self._sessions) >= self._max:
            raise TooManySessions(
                f"the verifier holds its maximum of {self._max} sessions; retry later")
        session_id = secrets.token_hex(SESSION_ID_BYTES)
        generator = torch.Generator(device="cpu")  # reseeded each round: position_seed
        session = Session(
            id=session_id, owner=owner, sampling=sampling, committed=list(prompt),
            prompt_len=len(prompt), max_new_tokens=max_new_tokens,
            stop_token_ids=stop_token_ids, generator=generator, last_used=self._clock(),
            seq=next(self._seq))
        self._sessions[session_id] = session
        return session

    def touch(self, session: Session) -> None:
        """A round ran: the session is in use, not idle."""
        session.last_used = self._clock()

    def close(self, session_id: str) -> Session | None:
        """Removes a live session and frees its KV memory; None if it was not live."""
        session = self._sessions.pop(session_id, None)
        if session is not None:
            self._on_close(session)
            session.finished = True
            log.info("session %s closed after %d tokens", short_id(session_id),
                     session.num_generated)
        return session

    def idle_lru(self) -> list[Session]:
        """Live sessions with no round in flight and no stream driving them, least recently
        used first."""
        idle = [s for s in self._sessions.values() if not s.lock.locked() and not s.streamed]
        return sorted(idle, key=lambda s: s.last_used)

    def holding_kv(self) -> list[Session]:
        """Live sessions that hold KV memory."""
        return [s for s in self._sessions.values() if s.kv is not None]

    def expire_idle(self) -> int:
        """Closes sessions idle past the TTL (marked ``expired``); returns how many. Streamed
        sessions are never idle (see ``Session.streamed``)."""
        now = self._clock()
        stale = [sid for sid, s in self._sessions.items()
                 if now - s.last_used > self._ttl and not s.lock.locked() and not s.streamed]
        for sid in stale:
            self._sessions[sid].expired = True
            self.close(sid)
        return len(stale)
