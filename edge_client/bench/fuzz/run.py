"""The fuzz run: Hypothesis draws requests, a live verifier answers them, and each answer is
checked; an honest session runs beside it all the time.

Properties, each reported as held or not:

- ``documented_statuses``: every call ends OK or with a documented (code, reason) pair
  (edge_client.bench.fuzz.statuses), never INTERNAL, never a status without ErrorInfo;
- ``undecodable_invalid_argument``: a payload that is not a valid encoding of its request
  message gets INVALID_ARGUMENT with reason INVALID_ARGUMENT (or UNAUTHENTICATED when the
  call carried no valid key);
- ``no_hang``: no call runs past ``CALL_DEADLINE_S``;
- ``no_crash``: the verifier process is alive and SERVING at the end;
- ``rss_bounded``: its RSS never exceeds the RSS after warm-up by more than its memory caps
  plus ``RSS_SLACK_MB``;
- ``honest_unchanged``: every honest generation equals its pre-fuzz output, and none failed.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis.strategies import SearchStrategy

from edge_client.bench.fuzz.statuses import documented, outcome_name, undecodable_answered_right
from edge_client.bench.fuzz.strategies import METHODS, FuzzRequest
from edge_client.bench.fuzz.target import (
    RSS_SLACK_MB,
    FuzzTarget,
    Outcome,
)

log = logging.getLogger(__name__)
RSS_EVERY = 100  # requests between RSS samples
WARMUP = 50  # requests before the RSS baseline
KEEP_EXAMPLES = 20


def is_undecodable(request: FuzzRequest) -> bool:
    if not request.raw:
        return False
    for payload in request.messages:
        try:
            METHODS[request.method].FromString(payload)
        except DecodeError:
            return True
    return False


@dataclass
class FuzzLog:
    """What the calls ended with."""

    api_key: str
    requests: int = 0
    messages: int = 0
    outcomes: collections.Counter = field(default_factory=collections.Counter)
    undocumented: list[str] = field(default_factory=list)
    undocumented_count: int = 0
    undecodable: int = 0
    undecodable_wrong: int = 0
    undecodable_examples: list[str] = field(default_factory=list)
    hangs: int = 0
    rss_mb: list[float] = field(default_factory=list)
    baseline_rss_mb: float | None = None

    def record(self, request: FuzzRequest, outcome: Outcome) -> None:
        self.requests += 1
        self.messages += len(request.messages)
        name = outcome_name(outcome.code, outcome.reason)
        self.outcomes[f"{request.method}{' raw' if request.raw else ''} {name}"] += 1
        example = f"{name} ({outcome.message[:120]!r}) <- {request.describe()}"
        if not documented(outcome.code, outcome.reason):
            self.undocumented_count += 1
            if len(self.undocumented) < KEEP_EXAMPLES:
                self.undocumented.append(example)
        if is_undecodable(request):
            self.undecodable += 1
            if not undecodable_answered_right(outcome.code, outcome.reason,
                                              request.carries_key(self.api_key)):
                self.undecodable_wrong += 1
                if len(self.undecodable_examples) < KEEP_EXAMPLES:
                    self.undecodable_examples.append(example)
        self.hangs += outcome.hang


def fuzz(target: FuzzTarget, strategy: SearchStrategy[FuzzRequest], n: int, seed: int,
         on_result: Callable[[FuzzRequest, Outcome], None]) -> None:
    """Draws ``n`` requests from ``strategy`` (reproducibly from ``seed``) and makes them."""

    @hypothesis_seed(seed)
    @settings(max_examples=n, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def one(request: FuzzRequest) -> None:
        on_result(request, target.call(request))

    one()


def run_fuzz(target: FuzzTarget, strategy: SearchStrategy[FuzzRequest], n: int, seed: int,
             honest=None) -> dict:
    """Fuzzes ``target`` with ``n`` requests while ``honest`` (a started HonestSession, or
    None) runs; returns the report with every property."""
    fuzz_log = FuzzLog(target.api_key)
    start_rss = round(target.rss_mb(), 1)  # the baseline if the run is shorter than WARMUP
    t0 = time.perf_counter()

    def on_result(request: FuzzRequest, outcome: Outcome) -> None:
        fuzz_log.record(request, outcome)
        if fuzz_log.requests == WARMUP or (fuzz_log.requests % RSS_EVERY == 0 and target.alive()):
            fuzz_log.rss_mb.append(round(target.rss_mb(), 1))
            if fuzz_log.baseline_rss_mb is None:
                fuzz_log.baseline_rss_mb = fuzz_log.rss_mb[-1]

    fuzz(target, strategy, n, seed, on_result)
    wall_s = time.perf_counter() - t0
    alive = target.alive() and target.serving()
    if alive:
        fuzz_log.rss_mb.append(round(target.rss_mb(), 1))
    baseline = fuzz_log.baseline_rss_mb or start_rss
    bound = baseline + target.memory_caps_mb + RSS_SLACK_MB
    honest_report = honest.report if honest is not None else None
    properties = {
        "documented_statuses": fuzz_log.undocumented_count == 0,
        "undecodable_invalid_argument": fuzz_log.undecodable_wrong == 0,
        "no_hang": fuzz_log.hangs == 0,
        "no_crash": alive,
        "rss_bounded": bool(fuzz_log.rss_mb) and max(fuzz_log.rss_mb) <= bound,
    }
    if honest_report is not None:
        properties["honest_unchanged"] = (honest_report.runs > 0
                                          and honest_report.mismatches == 0
                                          and not honest_report.errors)
    return {
        "requests": fuzz_log.requests, "messages": fuzz_log.messages, "seed": seed,
        "wall_s": round(wall_s, 1), "properties": properties,
        "failed_properties": [k for k, v in properties.items() if not v],
        "outcomes": dict(sorted(fuzz_log.outcomes.items())),
        "undocumented": {"count": fuzz_log.undocumented_count,
                         "examples": fuzz_log.undocumented},
        "undecodable": {"count": fuzz_log.undecodable, "wrong": fuzz_log.undecodable_wrong,
                        "examples": fuzz_log.undecodable_examples},
        "hangs": fuzz_log.hangs, "server_alive": alive,
        "server_tracebacks": target.tracebacks(),
        "rss_mb": {"baseline": baseline, "bound": bound,
                   "max": max(fuzz_log.rss_mb, default=None), "samples": fuzz_log.rss_mb},
        "honest": None if honest_report is None else {
            "runs": honest_report.runs, "mismatches": honest_report.mismatches,
            "errors": honest_report.errors[:KEEP_EXAMPLES]},
    }
