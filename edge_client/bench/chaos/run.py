"""``edgespec-bench chaos``: every scenario x runs, each run one generation of the product
client through the fault proxy, compared token for token with a fault-free run.

    edgespec-bench chaos --runs 20 --json chaos.json

Run r of a scenario uses decoding r mod 3 (greedy Verify rounds, seeded sampling on Verify
rounds, greedy lookahead: the outputs that are a function of the seed) and fault point
1 + r mod 7 (edge_client.bench.chaos.scenarios). The verifier is its own process
(``python -m cloud_verifier.server``) on a fixed port, so that it can be killed and a fresh
one started on the same port. A run passes when its faults fired, it raised nothing, and
its tokens equal the reference: 0 tokens lost, 0 duplicated.
"""

from __future__ import annotations

import asyncio
import difflib
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from edge_client import local_verifier
from edge_client.bench.chaos.proxy import FaultProxy
from edge_client.bench.chaos.scenarios import (
    CALL_DEADLINE_S,
    DECODINGS,
    REPLY_DEADLINE_S,
    SCENARIOS,
    fault_point,
)
from edge_client.client import AsyncEdgeClient, GenerationConfig
from edge_client.connection import Deadlines, RetryPolicy

log = logging.getLogger(__name__)

SEED = 11
GRACE_S = 0.5  # the verifier's shutdown grace: SIGTERM cuts a generation in flight


class VerifierProcess:
    """One verifier process on a fixed port; a kill or a stop starts a fresh one there."""

    def __init__(self, model: str | None, port: int | None = None,
                 extra: list[str] | None = None) -> None:
        self.model = model
        self.extra = list(extra or ())
        self.port = port or local_verifier.free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.proc = self._spawn()
        self.startup_s = local_verifier.wait_serving(self.address, self.proc)
        self._replacing: threading.Thread | None = None

    def _spawn(self):
        return local_verifier.spawn(self.port, self.model,
                                    ["--grace", str(GRACE_S), *self.extra])

    def _replace(self, sig: int) -> None:
        old = self.proc
        os.kill(old.pid, sig)

        def respawn() -> None:  # the port is free once the old process has exited
            old.wait()
            self.proc = self._spawn()

        self._replacing = threading.Thread(target=respawn, name="verifier-restart")
        self._replacing.start()

    def kill_and_restart(self) -> None:
        self._replace(signal.SIGKILL)

    def terminate_and_restart(self) -> None:
        self._replace(signal.SIGTERM)

    def ensure_serving(self) -> None:
        if self._replacing is not None:
            self._replacing.join()
            self._replacing = None
        local_verifier.wait_serving(self.address, self.proc)

    def stop(self) -> None:
        self.ensure_serving()
        local_verifier.stop(self.proc)


@dataclass(frozen=True)
class RunSettings:
    draft_dir: Path | None
    prompt: str
    tokens: int
    retry_budget_s: float

    def config(self, decoding: str) -> GenerationConfig:
        temperature = DECODINGS[decoding][1]
        return GenerationConfig(max_new_tokens=self.tokens, temperature=temperature,
                                top_p=0.95 if temperature else 1.0, seed=SEED, ignore_eos=True)


def token_diff(reference: list[int], output: list[int]) -> tuple[int, int]:
    """(tokens of the reference missing from the output, tokens the output has in excess)."""
    lost = extra = 0
    for op, a0, a1, b0, b1 in difflib.SequenceMatcher(None, reference, output,
                                                      autojunk=False).get_opcodes():
        if op != "equal":
            lost += a1 - a0
            extra += b1 - b0
    return lost, extra


async def generate(address: str, settings: RunSettings,
                   decoding: str) -> tuple[list[int], dict]:
    """One generation through a fresh client (so a fresh connection); its tokens, stats."""
    protocol = DECODINGS[decoding][0]
    async with AsyncEdgeClient(
            address, settings.draft_dir, protocol=protocol,
            deadlines=Deadlines(call_s=CALL_DEADLINE_S, reply_s=REPLY_DEADLINE_S),
            retry=RetryPolicy(base_delay_s=0.1, max_delay_s=1.0,
                              budget_s=settings.retry_budget_s)) as client:
        gen = client.generate(settings.prompt, settings.config(decoding))
        tokens: list[int] = []
        async for chunk in gen:
            tokens.extend(chunk)
        return tokens, gen.stats.to_dict()


async def run_one(verifier: VerifierProcess, settings: RunSettings, scenario: str, run: int,
                  decoding: str, reference: list[int]) -> dict:
    spec = SCENARIOS[scenario]
    point = fault_point(run)
    faults = spec.faults(point, verifier)
    proxy = FaultProxy(verifier.address, faults)
    address = await proxy.start()
    t0 = time.perf_counter()
    tokens: list[int] = []
    stats: dict = {}
    error = None
    try:
        # Bounded: a run that does not end within its retry budget (and then some) fails.
        async with asyncio.timeout(settings.retry_budget_s * 2 + 60):
            tokens, stats = await generate(address, settings, decoding)
    except Exception as err:  # noqa: BLE001 - a failed run is a result of the chaos run
        error = f"{type(err).__name__}: {err}"
    finally:
        await proxy.close()
    wall_s = time.perf_counter() - t0
    if spec.restarts_verifier:
        await asyncio.to_thread(verifier.ensure_serving)
    lost, duplicated = token_diff(reference, tokens)
    fired = [f.fault for f in proxy.fired]
    record = {
        "scenario": scenario, "run": run, "decoding": decoding, "fault_point": point,
        "faults": [f.describe() for f in faults], "fired": fired,
        "all_fired": len(fired) == len(faults), "connections": proxy.connections,
        "swallowed_replies": proxy.swallowed_replies,
        "identical": tokens == reference, "tokens": len(tokens), "lost": lost,
        "duplicated": duplicated, "reopens": stats.get("reopens", 0),
        "lost_attempts": stats.get("lost_attempts", {}), "error": error,
        "wall_s": round(wall_s, 2)}
    record["ok"] = (record["all_fired"] and record["identical"] and error is None
                    and lost == duplicated == 0)
    return record


def progress_line(r: dict) -> str:
    return (f"{r['scenario']:11s} run {r['run']:2d} {r['decoding']:16s} point "
            f"{r['fault_point']}: {'ok' if r['ok'] else 'FAILED'} (reopens {r['reopens']}, "
            f"{r['wall_s']:.1f} s) {r['error'] or ''}").rstrip()


def summarize(records: list[dict], scenarios: list[str]) -> list[dict]:
    rows = []
    for name in scenarios:
        rs = [r for r in records if r["scenario"] == name]
        walls = [r["wall_s"] for r in rs] or [0.0]
        rows.append({
            "scenario": name, "runs": len(rs), "fired": sum(r["all_fired"] for r in rs),
            "identical": sum(r["identical"] for r in rs),
            "tokens_lost": sum(r["lost"] for r in rs),
            "tokens_duplicated": sum(r["duplicated"] for r in rs),
            "reopens": sum(r["reopens"] for r in rs),
            "errors": sum(r["error"] is not None for r in rs),
            "wall_s_mean": round(sum(walls) / len(walls), 2), "wall_s_max": max(walls),
            "outcomes": "".join("." if r["ok"] else "x" for r in rs)})
    return rows


def format_table(rows: list[dict]) -> str:
    head = ("scenario", "runs", "fired", "identical", "lost", "dup", "reopens", "errors",
            "wall s mean/max", "runs (. ok, x failed)")
    lines = [head] + [(r["scenario"], str(r["runs"]), str(r["fired"]), str(r["identical"]),
                       str(r["tokens_lost"]), str(r["tokens_duplicated"]), str(r["reopens"]),
                       str(r["errors"]), f"{r['wall_s_mean']:.1f}/{r['wall_s_max']:.1f}",
                       r["outcomes"]) for r in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True))
                     .rstrip() for line in lines)


async def run_chaos(model: str | None, settings: RunSettings, scenarios: list[str],
                    decodings: list[str], runs: int,
                    verifier_args: list[str] | None = None) -> dict:
    verifier = await asyncio.to_thread(VerifierProcess, model, extra=verifier_args)
    settings = RunSettings(settings.draft_dir, settings.prompt, settings.tokens,
                           settings.retry_budget_s + 3 * verifier.startup_s)
    try:
        references = {}
        for decoding in decodings:  # fault-free, through a proxy without faults
            proxy = FaultProxy(verifier.address)
            try:
                references[decoding], _ = await generate(await proxy.start(), settings,
                                                         decoding)
            finally:
                await proxy.close()
        records = []
        for name in scenarios:
            for run in range(runs):
                decoding = decodings[run % len(decodings)]
                record = await run_one(verifier, settings, name, run, decoding,
                                       references[decoding])
                records.append(record)
                print(progress_line(record), flush=True)
    finally:
        await asyncio.to_thread(verifier.stop)
    table = summarize(records, scenarios)
    return {"config": {"model": model, "draft_dir": str(settings.draft_dir or "shipped"),
                       "prompt": settings.prompt, "tokens": settings.tokens, "runs": runs,
                       "decodings": decodings, "reply_deadline_s": REPLY_DEADLINE_S,
                       "verifier_grace_s": GRACE_S,
                       "verifier_startup_s": round(verifier.startup_s, 2)},
            "references": references, "table": table, "runs": records,
            "ok": all(r["ok"] for r in records) and len(records) == runs * len(scenarios)}
