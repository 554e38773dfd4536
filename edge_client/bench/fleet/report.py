"""A fleet run's result: per-request records summarized into per-client and aggregate
figures (the package docstring defines them), the result dict, and its one-line summary."""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import asdict
from pathlib import Path

import numpy as np

from edge_client.bench.fleet.config import FleetConfig
from edge_client.bench.fleet.device import Device, RequestRecord
from edge_client.bench.fleet.drafts import DraftSource
from edge_client.bench.fleet.netem import NetworkProfile
from shared.pb import verifier_pb2 as pb

PERCENTILES = (50, 95, 99)


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def summarize(records: list[RequestRecord], window_s: float,
              end: float) -> tuple[dict, list[float], list[float]]:
    tokens = forwards = trips = up = down = 0
    queue_s = forward_s = 0.0
    tpot_ms: list[float] = []
    ttft_ms: list[float] = []
    drafted = accepted = drafting_forwards = 0
    for r in records:
        events = [e for e in r.events if e[0] <= end]
        n = sum(e[1] for e in events)
        tokens += n
        forwards += sum(e[2] for e in events)
        trips += sum(e[3] for e in events)
        up += sum(e[4] for e in events)
        down += sum(e[5] for e in events)
        queue_s += sum(e[6] for e in events)
        forward_s += sum(e[7] for e in events)
        drafted += r.drafted
        drafting_forwards += r.drafting_forwards
        accepted += r.accepted
        if n >= 1:
            ttft_ms.append((events[0][0] - r.start) * 1000)
        if n >= 2:
            tpot_ms.append((events[-1][0] - events[0][0]) / (n - 1) * 1000)

    def per_token(x: float) -> float | None:
        return x / tokens if tokens else None

    out = {
        "tokens": tokens,
        "tokens_per_s": tokens / window_s,
        "requests_started": len(records),
        "requests_completed": sum(r.completed for r in records),
        "requests_failed": sum(r.failed is not None for r in records),
        "requests_failed_by_status": dict(Counter(r.failed for r in records if r.failed)),
        "reopens": sum(r.reopens for r in records),
        "round_trips_per_token": per_token(trips),
        "target_forwards_per_token": per_token(forwards),
        "bytes_per_token": per_token(up + down),
        "bytes_up_per_token": per_token(up),
        "bytes_down_per_token": per_token(down),
        "drafted_per_token": per_token(drafted),
        "acceptance_rate": accepted / drafted if drafted else None,
        # Share of the target forwards that verified drafts (spec mode).
        "drafting_forward_share": drafting_forwards / forwards if forwards else None,
        # Share of the tokens that came from Decodes (spec mode, rounds).
        "continued_share": per_token(sum(r.continued for r in records)),
        # Server-side time (Step.timing) per token delivered.
        "server_queue_ms_per_token": per_token(queue_s * 1000),
        "server_forward_ms_per_token": per_token(forward_s * 1000),
    }
    for q in PERCENTILES:
        out[f"tpot_ms_p{q}"] = _pct(tpot_ms, q)
    for q in PERCENTILES:
        out[f"ttft_ms_p{q}"] = _pct(ttft_ms, q)
    out["tpot_samples"] = len(tpot_ms)
    return out, tpot_ms, ttft_ms


def build_report(address: str, config: FleetConfig, info: pb.GetInfoResponse,
                 prof: NetworkProfile, devices: list[Device], drafts: list[DraftSource],
                 window_s: float, end: float, recorded: int) -> dict:
    per_client = []
    all_records: list[RequestRecord] = []
    for d in devices:
        summary, _, _ = summarize(d.records, window_s, end)
        summary.update(client=d.index, workload=d.kind, errors=dict(d.errors),
                       network_retransmits=d.netem.retransmits, backoff_s=d.backoff_s)
        if d.drafts is not None:
            summary.update(draft_s=d.drafts.draft_s, replay_hits=d.drafts.hits,
                           replay_misses=d.drafts.misses)
        per_client.append(summary)
        all_records += d.records
    aggregate, tpot, ttft = summarize(all_records, window_s, end)
    total_errors: Counter = Counter()
    for d in devices:
        total_errors.update(d.errors)
    aggregate["errors"] = dict(total_errors)
    aggregate["network_retransmits"] = sum(d.netem.retransmits for d in devices)
    if drafts:
        aggregate["draft_s"] = sum(s.draft_s for s in drafts)
        aggregate["replay_hits"] = sum(s.hits for s in drafts)
        aggregate["replay_misses"] = sum(s.misses for s in drafts)
    return {
        "clients": config.clients,
        "duration_s": window_s,
        "profile": asdict(prof),
        "workload": config.workload,
        "mode": config.mode,
        "drafts": config.drafts if config.mode == "spec" else None,
        "drafter": config.drafter if config.mode == "spec" else None,
        "stop_confidence": config.stop_confidence if config.mode == "spec" else None,
        "protocol": config.protocol if config.mode == "spec" else None,
        "replay_recorded_requests": recorded,
        "draft_len": config.draft_len,
        "confidence": (config.confidence and config.temperature == 0
                       if config.mode == "spec" else None),
        "adaptive": (config.adaptive if config.mode == "spec" and config.protocol == "rounds"
                     else None),
        "temperature": config.temperature,
        "chat_tokens": config.chat_tokens,
        "ime_document": config.ime_document,
        "address": address,
        "target_model": info.target_model,
        "aggregate": aggregate,
        "per_client": per_client,
        "samples": {"tpot_ms": tpot, "ttft_ms": ttft},
    } | ({"outputs": [{"client": d.index, "prompt_key": r.prompt_key,
                        "max_new_tokens": r.max_new_tokens, "tokens": r.output,
                        "completed": r.completed} for d in devices for r in d.records]}
         if config.keep_outputs else {})


def result_line(result: dict) -> str:
    a = result["aggregate"]

    def f(x, spec=".0f"):
        return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)

    return (f"{result['mode']:8s} {result['profile']['name']:7s} x{result['clients']:<3d} "
            f"{f(a['tokens_per_s'], '.1f')} tok/s  TPOT p50/p95/p99 {f(a['tpot_ms_p50'])}/"
            f"{f(a['tpot_ms_p95'])}/{f(a['tpot_ms_p99'])} ms  TTFT p50 {f(a['ttft_ms_p50'])} ms"
            f"  {f(a['round_trips_per_token'], '.2f')} RT/tok  "
            f"{f(a['target_forwards_per_token'], '.2f')} fwd/tok  "
            f"{f(a['bytes_per_token'])} B/tok  errors {a['errors'] or 0}")


def write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
