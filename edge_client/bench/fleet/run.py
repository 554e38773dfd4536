"""One fleet run: N devices against one verifier for a measured window (``run_fleet``)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from edge_client.bench.fleet.config import FleetConfig, require_loopback
from edge_client.bench.fleet.device import Device
from edge_client.bench.fleet.drafts import DraftSource
from edge_client.bench.fleet.netem import NetEm, profile
from edge_client.bench.fleet.replay import (
    REPLAY_FORMAT,
    ReplayBook,
    book_path,
    draft_identity,
    record_replay,
)
from edge_client.bench.fleet.report import build_report
from edge_client.bench.fleet.workload import Workload, build_workload
from edge_client.connection import Connection, Deadlines
from edge_client.drafter import DraftSampling
from edge_client.errors import IncompatibleVerifier
from edge_client.generation_state import ServerLimits
from edge_client.tokenizer import EdgeTokenizer
from shared.pb import verifier_pb2 as pb

log = logging.getLogger(__name__)

STOP_GRACE_S = 1.0
STOP_ATTEMPTS = 30


def check_compatible(info: pb.GetInfoResponse, tokenizer: EdgeTokenizer) -> None:
    if info.tokenizer_fingerprint != tokenizer.fingerprint:
        raise IncompatibleVerifier(f"the verifier serves {info.target_model!r} whose tokenizer "
                                   "differs from the draft's; token ids would mean different "
                                   "text")


async def verifier_info(address: str, deadline_s: float) -> pb.GetInfoResponse:
    conn = Connection(address, deadlines=Deadlines(call_s=deadline_s))
    try:
        return await conn.info()
    finally:
        await conn.close()


def replay_k(config: FleetConfig, limits: ServerLimits) -> int:
    """The drafts recorded after each prefix: the most a round (or a lookahead, 2K + 1:
    GenerationState.lookahead_len) asks for."""
    k = 2 * config.draft_len + 1 if config.protocol == "lookahead" else config.draft_len
    return min(k, limits.max_draft_len)


async def run_fleet_async(address: str, config: FleetConfig, draft_dir: Path,
                          replay_cache: Path | None = None) -> dict:
    require_loopback(address)
    tokenizer = EdgeTokenizer(draft_dir)
    info = await verifier_info(address, config.deadline_s)
    check_compatible(info, tokenizer)
    limits = ServerLimits.from_info(info)
    workload = build_workload(tokenizer, config, limits.max_context)
    prof = profile(config.profile)

    models: list = []

    def model_factory():
        if not models:
            from edge_client.draft_model import OnnxDraftModel

            models.append(OnnxDraftModel(draft_dir, intra_op_threads=1))
        return models[0]

    book = None
    recorded = 0
    if config.mode == "spec" and config.drafts == "replay":
        k = replay_k(config, limits)
        identity = {"format": REPLAY_FORMAT, "target": info.target_model,
                    "tokenizer": info.tokenizer_fingerprint,
                    "draft": draft_identity(draft_dir), "k": k, "drafter": config.drafter,
                    "stop_confidence": config.stop_confidence}
        book = ReplayBook(replay_cache or book_path(identity), identity)
        recorded = await record_replay(book, address, info, workload.all_requests(
            config.workload, config.clients), model_factory, k, config.drafter,
            config.stop_confidence, progress=config.progress)

    sampling = DraftSampling(temperature=config.temperature,
                             stop_confidence=config.stop_confidence)

    def draft_source() -> DraftSource | None:
        return (DraftSource(config.drafts, model_factory, sampling, book, config.confidence,
                            config.drafter)
                if config.mode == "spec" else None)

    if config.warm_up:
        await _warm_up(address, config, info, workload, draft_source)
    devices: list[Device] = []
    start = time.perf_counter()
    end = start + config.duration_s
    for i in range(config.clients):
        kind = workload.kind_of(config.workload, i)
        devices.append(Device(
            i, kind, config, address, info,
            NetEm(prof, np.random.default_rng([config.seed, i, 1])), draft_source(),
            workload.schedule(kind, i, config.max_requests),
            np.random.default_rng([config.seed, i]),
            np.random.default_rng([config.seed, i, 2]), stop_at=end))
    tasks = [asyncio.ensure_future(d.run(config.ramp_s * i / config.clients))
             for i, d in enumerate(devices)]
    try:
        await _progress(config, tasks, devices, end)
    finally:
        await _stop(tasks)
        for d, t in zip(devices, tasks, strict=True):
            if t.done() and not t.cancelled() and t.exception() is not None:
                log.error("client %d stopped: %r", d.index, t.exception())
        for d in devices:
            await d.close()
    drafts = [d.drafts for d in devices if d.drafts is not None]
    return build_report(address, config, info, prof, devices, drafts, end - start, end,
                        recorded)


async def _stop(tasks: list[asyncio.Task]) -> None:
    """Cancels the devices cut by the window and waits for them to end. Leaving the core's
    generator cancels its stream, which closes the server's session. A device that outlives
    its cancellation (on Python 3.11, ``asyncio.wait_for`` drops a cancellation that meets a
    result arriving at the same moment) is cancelled again; each also stops by itself at
    the end of its current request."""
    pending = {t for t in tasks if not t.done()}
    for _ in range(STOP_ATTEMPTS):
        if not pending:
            return
        for t in pending:
            t.cancel()
        _, pending = await asyncio.wait(pending, timeout=STOP_GRACE_S)
    log.error("%d clients did not stop after %d cancellations", len(pending), STOP_ATTEMPTS)


async def _warm_up(address: str, config: FleetConfig, info: pb.GetInfoResponse,
                   workload: Workload, draft_source: Callable[[], DraftSource | None]) -> None:
    """One short uncounted request per request kind, so that first-call costs (connection
    set-up, the server's first forward of a shape) stay out of the window."""
    kinds = sorted({workload.kind_of(config.workload, i) for i in range(config.clients)})
    quiet = dataclasses.replace(config, think_ms=0.0)
    for kind in kinds:
        request = next(workload.schedule(kind, 0, 1))
        request = dataclasses.replace(request, max_new_tokens=min(
            request.max_new_tokens, 2 * config.draft_len + 2))
        rng = np.random.default_rng(0)
        device = Device(-1, kind, quiet, address, info, NetEm(profile("none"), rng),
                        draft_source(), iter([request]), rng, rng)
        try:
            await asyncio.wait_for(device.run(0.0), config.deadline_s)
        finally:
            await device.close()


async def _progress(config: FleetConfig, tasks: list[asyncio.Task], devices: list[Device],
                    end: float) -> None:
    """Waits out the window (or all clients ending early), with a progress bar on stderr."""
    from tqdm import tqdm

    bar = tqdm(total=round(config.duration_s), unit="s", file=sys.stderr,
               disable=not config.progress, desc=f"{config.mode} x{config.clients}",
               bar_format="{l_bar}{bar}| {n:.0f}/{total:.0f} s {postfix}")
    all_done = asyncio.ensure_future(asyncio.wait(tasks))
    try:
        while (left := end - time.perf_counter()) > 0 and not all_done.done():
            await asyncio.wait([all_done], timeout=min(0.5, left))
            tokens = sum(e[1] for d in devices for r in d.records for e in r.events)
            errors = sum(sum(d.errors.values()) for d in devices)
            bar.n = min(config.duration_s, config.duration_s - max(0.0, end -
                                                                   time.perf_counter()))
            bar.set_postfix(tokens=tokens, errors=errors, refresh=True)
    finally:
        all_done.cancel()
        bar.close()


def run_fleet(address: str, config: FleetConfig, draft_dir: Path,
              replay_cache: Path | None = None) -> dict:
    return asyncio.run(run_fleet_async(address, config, Path(draft_dir),
                                       None if replay_cache is None else Path(replay_cache)))
