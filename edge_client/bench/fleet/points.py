"""A sweep's points: each (mode, profile, client count)'s windows reduced to one point, for
the sweep (edge_client.bench.fleet.sweep) and its plots (edge_client.bench.fleet.plots)."""

from __future__ import annotations

import statistics

MEDIAN_KEYS = ("tokens_per_s", "tpot_ms_p50", "tpot_ms_p95", "tpot_ms_p99", "ttft_ms_p50")


def points(runs: list[dict]) -> list[dict]:
    """One point per (mode, profile, clients): the medians of its windows' figures, and the
    failed requests of all of them."""
    groups: dict[tuple[str, str, int], list[dict]] = {}
    for run in runs:
        groups.setdefault((run["mode"], run["profile"]["name"], run["clients"]), []).append(
            run["aggregate"])
    out = []
    for (mode, prof, clients), aggs in groups.items():
        point = {"mode": mode, "profile": prof, "clients": clients, "windows": len(aggs),
                 "requests_failed": sum(a["requests_failed"] for a in aggs)}
        for key in MEDIAN_KEYS:
            values = [a[key] for a in aggs if a[key] is not None]
            point[key] = statistics.median(values) if values else None
        out.append(point)
    return out
