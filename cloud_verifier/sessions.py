"""Session table: ids, ownership, expiry, and the per-session state a round needs.

A session id is 128 random bits from ``secrets`` and is bound to the identity of the
caller that opened it; lookups by anyone else read as "not found", so an id reveals nothing
to a caller that does not own it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import re
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from cloud_verifier.draft_policy import AcceptanceTracker
from cloud_verifier.errors import SessionNotFound, TooManySessions
from cloud_verifier.kv_store import SessionKV
from shared.sampling import SamplingParams

log = logging.getLogger(__name__)

SESSION_ID_BYTES = 16  # 128 bits
_SESSION_ID_RE = re.compile(r"^[0-9a-f]{32}$")


def is_well_formed_session_id(session_id: str) -> bool:
    return bool(_SESSION_ID_RE.match(session_id))


def position_seed(seed: int, position: int) -> int:
    """The generator seed for the round that starts at committed length ``position``.

    Randomness is a function of (session seed, position), not of a generator's history, so
    a session reopened with its full context after an eviction draws exactly the numbers
    the evicted one would have drawn: eviction cannot change the output.
    """
    return (seed * 0x9E3779B97F4A7C15 + position) % (2**63)


def short_id(session_id: str) -> str:
    """What logs show: enough to correlate, too little to hijack."""
    return session_id[:8]


@dataclass(frozen=True)
class RoundResult:
    """Outcome of one verification round (the wire's RoundResult, minus protobuf)."""

    round: int
    num_accepted: int
    next_token: int
    committed_length: int
    finished: bool
    target_forwards: int
    queue_ns: int
    forward_ns: int
    suggested_draft_len: int = 0
    draft_token_cost: float | None = None


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
    last_result: RoundResult | None = None
    last_draft_digest: bytes = b""
    finished: bool = False
    evicted: bool = False
    acceptance: AcceptanceTracker = field(default_factory=AcceptanceTracker)
    last_used: float = field(default_factory=time.monotonic)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # Admission order: under KV pressure older sessions keep their memory (batcher).
    seq: int = 0
    # Decoded by a stream the server drives (Generate, Lookahead): never idle while it lasts,
    # so it is never evicted, only preempted (its KV dropped and recomputed later).
    streamed: bool = False

    @property
    def cache_len(self) -> int:
        return 0 if self.kv is None else self.kv.length

    @property
    def num_generated(self) -> int:
        return len(self.committed) - self.prompt_len


class SessionStore:
    """Owns every live session; bounded in count and idle time.

    Closed sessions stay readable (without their KV cache) for one TTL in a bounded list, so
    that a client whose reply to the final round was lost can retry that round and get the
    same answer.
    """

    def __init__(self, max_sessions: int, ttl_s: float,
                 on_close: Callable[[Session], None] = lambda session: None,
                 clock=time.monotonic) -> None:
        self._max = max_sessions
        self._on_close = on_close
        self._ttl = ttl_s
        self._clock = clock
        self._sessions: dict[str, Session] = {}
        self._seq = itertools.count()
        self._closed: OrderedDict[str, Session] = OrderedDict()

    def __len__(self) -> int:
        return len(self._sessions)

    def create(self, owner: str, sampling: SamplingParams, prompt: list[int],
               max_new_tokens: int, stop_token_ids: frozenset[int]) -> Session:
        self.expire_idle()
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
        log.info("session %s opened: prompt %d tokens, %s", short_id(session_id), len(prompt),
                 "greedy" if sampling.is_greedy else "sampling")
        return session

    def get(self, session_id: str, owner: str) -> Session:
        """A live session, or a recently closed one (``finished`` is then set)."""
        session = self._sessions.get(session_id) or self._closed.get(session_id)
        if session is None or session.owner != owner:
            raise SessionNotFound(
                f"session {short_id(session_id)}... is unknown, expired or closed; "
                "open a new session")
        if not session.finished and self._clock() - session.last_used > self._ttl:
            session.evicted = True
            self.close(session_id)
        session.last_used = self._clock()
        return session

    def touch(self, session: Session) -> None:
        """A round ran: the session is in use, not idle (streams never look it up)."""
        session.last_used = self._clock()

    def close(self, session_id: str) -> Session | None:
        session = self._sessions.pop(session_id, None)
        if session is not None:
            self._on_close(session)  # frees its KV memory now
            session.finished = True
            self._closed[session_id] = session
            while len(self._closed) > 4 * self._max:
                self._closed.popitem(last=False)
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
        now = self._clock()
        stale = [sid for sid, s in self._sessions.items()
                 if now - s.last_used > self._ttl and not s.lock.locked()]
        for sid in stale:
            self._sessions[sid].evicted = True
            self.close(sid)
        while self._closed and now - next(iter(self._closed.values())).last_used > self._ttl:
            self._closed.popitem(last=False)
        return len(stale)
