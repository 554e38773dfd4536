"""One typing run: every mode types the same fields, taking turns field by field, then each
goes through the outage drill.

The measured phase: the script's fields fill ``duration_s`` of typing; field i is typed by
every mode, one after the other, in an order rotated by i (so no mode always goes first after
a pause). One mode types at a time, so the verifier's counters read between fields give each
mode's server-side work. After every field the user pauses ``FIELD_GAP_S``, which also lets
cancelled work drain before the counters are read.

The outage drill, per mode, with the same fresh script for each: the user types; after
``outage_after_s`` the verifier is killed (SIGKILL), ``outage_s`` later it is started again on
the same address, and the user keeps typing until ``recovery_s`` after it serves again. Each
key is tagged with the phase it was pressed in: ``before``, ``down`` (from the kill until the
restarted verifier serves) or ``after``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from edge_client.bench.fleet.netem import NetEm, NetEmLink, profile
from edge_client.bench.ime.modes import KeyRecord, Mode, make_mode
from edge_client.bench.ime.typist import Field, Script, TypingProfile, key_kind
from edge_client.bench.ime.verifier import ServerWork, VerifierHandle, Work
from edge_client.connection import RetryPolicy
from edge_client.link import until

log = logging.getLogger(__name__)

FIELD_GAP_S = 0.5
DRAIN_TIMEOUT_S = 10.0  # a cancelled suggestion's task ends within this
WARMUP_TEXTS = ("Hi", "Hi there, how", "Hi there, how are you")


@dataclass(frozen=True)
class ImeConfig:
    modes: tuple[str, ...]
    profile: str = "wifi"
    duration_s: float = 60.0  # of typing, per mode
    seed: int = 0
    draft_len: int = 4
    fallback: bool = True  # edit sessions: draft-only suggestions while the verifier is away
    budget_ms: float | None = None  # edit sessions' latency budget
    # Edit sessions follow the verifier's suggested K (0 under acceptance collapse: Decode).
    follow_suggested_k: bool = True
    # Every mode's IME waits this long after a key before asking for a suggestion (a newer
    # key cancels the wait): GenerationConfig.settle_ms for edit sessions.
    settle_ms: float = 0.0
    # After a key inside a word, every mode waits this long (None: edit sessions the
    # product's default, GenerationConfig.word_settle_ms; reopen and cloud-only none).
    word_settle_ms: float | None = None
    heal: bool = True  # edit sessions: token healing and type-through (GenerationConfig.heal)
    preview: bool = True  # edit sessions: the draft's preview while waiting (.preview)
    drill: bool = True
    drill_modes: tuple[str, ...] | None = None  # the modes the drill runs for (None: all)
    outage_after_s: float = 3.0
    outage_s: float = 5.0
    recovery_s: float = 6.0
    retry_budget_s: float = 60.0
    draft_threads: int | None = None
    progress: bool = True
    typing: TypingProfile = field(default_factory=TypingProfile)

    def __post_init__(self) -> None:
        profile(self.profile)  # raises on an unknown name
        if not self.modes:
            raise ValueError("no modes to run")
        if self.settle_ms < 0 or (self.word_settle_ms or 0) < 0:
            raise ValueError("settle time must be >= 0")
        if self.duration_s <= 0:
            raise ValueError("duration must be > 0")
        if min(self.outage_after_s, self.outage_s, self.recovery_s) < 0:
            raise ValueError("outage times must be >= 0")


@dataclass
class RunResult:
    records: list[KeyRecord]
    server_work: dict[str, Work] | None  # per mode, measured phase; None: no metrics
    fields: int
    # Per mode: when its drill started, the verifier was killed and served again
    # (time.perf_counter()), and the fields typed.
    drills: dict[str, dict]
    wall_s: float


class _Bar:
    """A tqdm bar over keystrokes (the bench extra), or nothing."""

    def __init__(self, enabled: bool, total: int) -> None:
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="key", file=sys.stderr, dynamic_ncols=True,
                            desc="typing")

    def update(self, desc: str | None = None) -> None:
        if self.bar is not None:
            if desc and self.bar.desc != desc:
                self.bar.set_description(desc, refresh=False)
            self.bar.update(1)

    def grow(self, n: int) -> None:
        if self.bar is not None:
            self.bar.total += n
            self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


async def type_field(mode: Mode, fld: Field, phase: Callable[[], str], index: int,
                     records: list[KeyRecord], bar: _Bar,
                     stop: Callable[[], bool] = lambda: False) -> None:
    """Types one field in real time, a suggestion after every key; a key cancels the
    suggestion in flight. After the last key the suggestion has until the field's end."""
    await mode.open_field()
    t0 = time.perf_counter()
    tasks: list[asyncio.Task] = []
    task, record = None, None
    try:
        for i, key in enumerate(fld.keys):
            if stop():
                break
            await until(t0 + key.at_s)
            if task is not None and not task.done():
                mode.supersede(task, record)
            record = KeyRecord(mode.name, phase(), index, i, time.perf_counter(),
                               key.max_new_tokens, key_kind(key))
            records.append(record)
            task = asyncio.ensure_future(mode.suggest(key.text, key.max_new_tokens, record))
            tasks.append(task)
            bar.update(f"{mode.name} {record.phase}")
        if task is not None:
            await asyncio.wait([task], timeout=max(0.0, t0 + fld.duration_s
                                                   - time.perf_counter()))
            if not task.done():
                mode.supersede(task, record, final=True)
    finally:
        if tasks:
            done, pending = await asyncio.wait(tasks, timeout=DRAIN_TIMEOUT_S)
            for t in pending:
                log.warning("%s: a suggestion did not end %.0f s after its cancel",
                            mode.name, DRAIN_TIMEOUT_S)
                t.cancel()
            for t in done:
                if not t.cancelled() and t.exception() is not None:
                    raise t.exception()
        await mode.close_field()


async def warm_up(mode: Mode) -> None:
    """A few uncounted suggestions: the first forwards and the draft's first run are slow."""
    await mode.open_field()
    try:
        for text in WARMUP_TEXTS:
            await mode.suggest(text, 8, KeyRecord(mode.name, "warmup", 0, 0,
                                                  time.perf_counter(), 8))
    finally:
        await mode.close_field()


async def outage_drill(mode: Mode, script: Script, verifier: VerifierHandle, cfg: ImeConfig,
                       records: list[KeyRecord], bar: _Bar) -> dict:
    t_start = time.perf_counter()
    times: dict[str, float] = {}

    async def control() -> None:
        await until(t_start + cfg.outage_after_s)
        verifier.kill()
        times["killed"] = time.perf_counter()
        log.info("%s drill: verifier killed", mode.name)
        await asyncio.sleep(cfg.outage_s)
        times["serving"] = await verifier.restart()
        log.info("%s drill: verifier serving again", mode.name)

    def phase() -> str:
        return "before" if "killed" not in times else ("down" if "serving" not in times
                                                       else "after")

    def recovered() -> bool:
        return "serving" in times and time.perf_counter() - times["serving"] >= cfg.recovery_s

    controller = asyncio.ensure_future(control())
    try:
        index = 0
        while not recovered():
            fld = script.next_field()
            bar.grow(len(fld.keys))
            await type_field(mode, fld, phase, index, records, bar, stop=recovered)
            index += 1
            if controller.done() and controller.exception() is not None:
                raise controller.exception()
        await controller
    finally:
        controller.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await controller
    return {"started": t_start, "killed": times["killed"], "serving": times["serving"],
            "fields": index}


async def run_ime(verifier: VerifierHandle, draft_dir: Path | None, cfg: ImeConfig,
                  messages: list[str]) -> RunResult:
    started = time.perf_counter()
    retry = RetryPolicy(budget_s=cfg.retry_budget_s)
    modes: list[Mode] = []
    try:
        for i, name in enumerate(cfg.modes):
            link = NetEmLink(NetEm(profile(cfg.profile), np.random.default_rng([cfg.seed, i])))
            mode = make_mode(name, verifier.address, draft_dir, link, retry, cfg.draft_len,
                             cfg.fallback, cfg.budget_ms, cfg.draft_threads,
                             cfg.follow_suggested_k, cfg.settle_ms, cfg.word_settle_ms,
                             cfg.heal, cfg.preview)
            modes.append(mode)
            await mode.client.connect()
        for mode in modes:
            await warm_up(mode)

        fields = Script(messages, cfg.seed, cfg.typing).fields_for(cfg.duration_s)
        records: list[KeyRecord] = []
        work = ServerWork(verifier.metrics_url)
        server_work = {m.name: Work() for m in modes} if work.available else None
        bar = _Bar(cfg.progress, sum(len(f.keys) for f in fields) * len(modes))
        try:
            await work.since_last()
            for i, fld in enumerate(fields):
                for j in range(len(modes)):
                    mode = modes[(i + j) % len(modes)]
                    await type_field(mode, fld, lambda: "typing", i, records, bar)
                    await asyncio.sleep(FIELD_GAP_S)
                    done = await work.since_last()
                    if server_work is not None and done is not None:
                        server_work[mode.name] += done
            drills = {}
            if cfg.drill and verifier.stoppable:
                for mode in modes:
                    if cfg.drill_modes is not None and mode.name not in cfg.drill_modes:
                        continue
                    script = Script(messages, cfg.seed + 1, cfg.typing)
                    drills[mode.name] = await outage_drill(mode, script, verifier, cfg,
                                                           records, bar)
        finally:
            bar.close()
    finally:
        for mode in modes:
            await mode.close()
    return RunResult(records, server_work, len(fields), drills, time.perf_counter() - started)
