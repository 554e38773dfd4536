"""Per-tenant quotas, so that one tenant cannot take the verifier from the others.

A tenant (cloud_verifier.auth; "anonymous" without keys) may hold at most ``sessions`` open
sessions and ``queued_rounds`` rounds waiting for the model, and spend ``tokens_per_s``
target tokens a second: every token a forward computes for it (the prompt not found in the
prefix cache, each draft token, and the step's own token). The rate is a token bucket of
``token_burst`` tokens that may run into debt: a round is admitted while the bucket is not
in debt, and pays its cost after, so a prompt longer than the burst still gets in, and the
tenant's next rounds wait for the debt to refill. A round waits for that itself when the
wait is short (``pace_s``: streams the server drives are slowed, not broken) and is
refused with RESOURCE_EXHAUSTED and a RetryInfo of the whole wait otherwise.

Over-quota answers use the OVERLOADED reason, not a reason of their own: a client does what
it does for an overloaded verifier (wait the RetryInfo delay and reopen) either way.
``ErrorInfo.metadata["quota"]`` names the quota for operators and dashboards.

Fair share when the session table is full: the newcomer's tenant may take the least
recently used idle session of the tenant that holds the most sessions, if that one would
still hold more than the newcomer's (``fair_share_victim``), so that one tenant's idle
sessions cannot lock the others out. The evicted session's client reopens (SESSION_EVICTED).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cloud_verifier.errors import Busy

if TYPE_CHECKING:  # sessions imports torch; the command line parses quotas without it
    from cloud_verifier.sessions import Session

# Only sessions idle this long are taken for fair share: a client between two rounds
# (drafting, on the network) is not idle in any sense that matters.
FAIR_SHARE_IDLE_S = 1.0


@dataclass(frozen=True)
class Quota:
    """Limits of one tenant on one verifier; None means no limit."""

    sessions: int | None = None
    queued_rounds: int | None = None
    tokens_per_s: float | None = None
    token_burst: float | None = None  # None: one second's worth
    pace_s: float = 0.5  # longest wait for the rate a round does itself instead of failing

    def __post_init__(self) -> None:
        for name in ("sessions", "queued_rounds"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"quota {name} must be >= 1, got {value}")
        if self.tokens_per_s is not None and self.tokens_per_s <= 0:
            raise ValueError(f"quota tokens_per_s must be > 0, got {self.tokens_per_s}")
        if self.token_burst is not None and self.token_burst < 1:
            raise ValueError(f"quota token_burst must be >= 1, got {self.token_burst}")
        if self.pace_s < 0:
            raise ValueError(f"quota pace_s must be >= 0, got {self.pace_s}")

    @property
    def burst(self) -> float:
        assert self.tokens_per_s is not None
        return self.token_burst if self.token_burst is not None else max(1.0, self.tokens_per_s)


class QuotaExceeded(Busy):
    """A tenant is over one of its quotas; waiting ``retry_after_s`` helps."""

    def __init__(self, quota: str, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.quota = quota
        self.metadata = {"quota": quota}
        if retry_after_s is not None:
            self.retry_after_s = retry_after_s


class _Bucket:
    def __init__(self, level: float, now: float) -> None:
        self.level = level
        self.at = now


class TenantQuotas:
    """Checks and charges the quotas of every tenant of one verifier (one event loop)."""

    def __init__(self, quota: Quota, clock=time.monotonic) -> None:
        self.quota = quota
        self._clock = clock
        self._buckets: dict[str, _Bucket] = {}

    def check_session(self, tenant: str, open_sessions: int) -> None:
        limit = self.quota.sessions
        if limit is not None and open_sessions >= limit:
            raise QuotaExceeded("sessions", f"this API key's tenant holds its quota of {limit} "
                                "open sessions; close one, or retry later")

    def check_round(self, tenant: str, queued_rounds: int) -> None:
        limit = self.quota.queued_rounds
        if limit is not None and queued_rounds >= limit:
            raise QuotaExceeded("queued_rounds", f"this API key's tenant has its quota of "
                                f"{limit} rounds queued for the model; back off")

    def debt_s(self, tenant: str) -> float:
        """Seconds until the tenant's bucket is out of debt (0: a round may run now)."""
        rate = self.quota.tokens_per_s
        if rate is None:
            return 0.0
        return max(0.0, -self._refill(tenant).level) / rate

    async def pace(self, tenant: str) -> None:
        """Waits until the tenant may spend tokens, up to ``pace_s``; raises QuotaExceeded
        (RetryInfo: the whole wait) beyond that."""
        waited = 0.0
        while (wait := self.debt_s(tenant)) > 0:
            if waited + wait > self.quota.pace_s:
                raise QuotaExceeded(
                    "tokens_per_s", f"this API key's tenant is over its quota of "
                    f"{self.quota.tokens_per_s:g} target tokens per second; retry in "
                    f"{wait:.2f} s", retry_after_s=wait)
            await asyncio.sleep(wait)
            waited += wait

    def charge(self, tenant: str, tokens: int) -> None:
        """Spends ``tokens`` (the bucket may go into debt)."""
        if self.quota.tokens_per_s is not None:
            self._refill(tenant).level -= tokens

    def _refill(self, tenant: str) -> _Bucket:
        now = self._clock()
        burst = self.quota.burst
        bucket = self._buckets.get(tenant)
        if bucket is None:
            bucket = self._buckets[tenant] = _Bucket(burst, now)
        else:
            assert self.quota.tokens_per_s is not None
            bucket.level = min(burst, bucket.level + (now - bucket.at) * self.quota.tokens_per_s)
            bucket.at = now
        return bucket


def fair_share_victim(idle_lru: Sequence[Session], held: Counter[str], tenant: str,
                      now: float) -> Session | None:
    """The session to evict so that ``tenant`` can open one in a full table, or None.

    ``idle_lru``: the table's idle sessions, least recently used first; ``held``: open
    sessions by tenant. The victim, idle for FAIR_SHARE_IDLE_S at least, belongs to the
    tenant that holds the most sessions, which must hold at least two more than ``tenant``
    (so that it still holds more after the move: two tenants never take turns evicting each
    other).
    """
    mine = held.get(tenant, 0)
    candidates = [s for s in idle_lru
                  if s.owner != tenant and held[s.owner] >= mine + 2
                  and now - s.last_used >= FAIR_SHARE_IDLE_S]
    if not candidates:
        return None
    richest = max(held[s.owner] for s in candidates)
    return next(s for s in candidates if held[s.owner] == richest)
