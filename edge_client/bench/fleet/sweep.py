"""Capacity sweep of the simulated fleet: speculative vs cloud-only serving, per network
profile, over growing client counts (``edgespec-bench sweep``).

**Capacity** of a (mode, profile) is the largest client count whose run keeps the p95 TPOT
(edge_client.bench.fleet defines TPOT) at or under the SLO (200 ms by default) with no failed
request; 0 if even the smallest count misses it. Latency only grows with load, so once a
count has missed the SLO the sweep runs one more count (for the plots) and stops that
(mode, profile) there, which bounds the sweep's time; ``--keep-going`` runs every count.

Every point is ``--repeats`` ``run_fleet`` windows per mode against the same verifier;
recorded drafts are made once (cached on disk) and replayed by every spec window. The modes
alternate within each client count (spec, baseline, spec, baseline, ..., then the next count),
so the figures compared at a load are taken seconds apart, not a whole sweep apart: this
machine's speed drifts by more than the effects measured. A point's figures are the medians
over its windows. **Never worse** is, at every load both modes ran, the median over repeats of
the spec/baseline tokens/s ratio of adjacent windows (with its range).

The sweep's JSON is written before anything is plotted (edge_client.bench.fleet.plots): an
install without matplotlib, or a plot that fails, loses no measurement.
"""

from __future__ import annotations

import logging
import statistics
import sys
import time
from pathlib import Path

from edge_client.bench.fleet.config import FleetConfig
from edge_client.bench.fleet.points import MEDIAN_KEYS, points
from edge_client.bench.fleet.report import result_line, write_json
from edge_client.bench.fleet.run import run_fleet_async

log = logging.getLogger(__name__)

def meets_slo(point: dict, slo_ms: float) -> bool:
    return (point["tpot_ms_p95"] is not None and point["tpot_ms_p95"] <= slo_ms
            and point["requests_failed"] == 0)


def capacity(runs: list[dict], slo_ms: float) -> tuple[dict, dict]:
    """{mode: {profile: clients}} and the (median) figures of the point that sets each."""
    counts: dict[str, dict[str, int]] = {}
    figures: dict[str, dict[str, dict | None]] = {}
    for point in points(runs):
        mode, prof = point["mode"], point["profile"]
        counts.setdefault(mode, {}).setdefault(prof, 0)
        figures.setdefault(mode, {}).setdefault(prof, None)
        if meets_slo(point, slo_ms) and point["clients"] > counts[mode][prof]:
            counts[mode][prof] = point["clients"]
            figures[mode][prof] = {k: point[k] for k in ("clients", "windows", *MEDIAN_KEYS)}
    return counts, figures


def never_worse(runs: list[dict]) -> list[dict]:
    """Per (profile, client count) both modes ran: median tokens/s of each, and the median and
    range of spec / baseline over adjacent (spec, baseline) windows."""
    by_key: dict[tuple[str, int], dict[str, list[float]]] = {}
    for r in runs:
        by_key.setdefault((r["profile"]["name"], r["clients"]), {}).setdefault(
            r["mode"], []).append(r["aggregate"]["tokens_per_s"])
    rows = []
    for (prof, clients), modes in sorted(by_key.items()):
        spec, base = modes.get("spec"), modes.get("baseline")
        if not spec or not base:
            continue
        ratios = [a / b for a, b in zip(spec, base, strict=False) if b]
        rows.append({"profile": prof, "clients": clients,
                     "spec_tokens_per_s": statistics.median(spec),
                     "baseline_tokens_per_s": statistics.median(base),
                     "ratio": statistics.median(ratios) if ratios else None,
                     "ratio_min": min(ratios, default=None),
                     "ratio_max": max(ratios, default=None), "pairs": len(ratios)})
    return rows


async def sweep(address: str, configs: list[list[FleetConfig]], draft_dir: Path,
                replay_cache: Path | None, slo_ms: float, keep_going: bool) -> list[dict]:
    """``configs``: the windows of each load in run order, loads in sweep order."""
    runs: list[dict] = []
    stopped: dict[tuple[str, str], int] = {}  # (mode, profile) -> loads run past the SLO
    for load in configs:
        done = []
        for config in load:
            if not keep_going and stopped.get((config.mode, config.profile), 0) >= 2:
                continue
            result = await run_fleet_async(address, config, draft_dir, replay_cache)
            done.append(result)
            print(result_line(result), file=sys.stderr)
        runs += done
        for point in points(done):
            key = (point["mode"], point["profile"])
            if not meets_slo(point, slo_ms) or stopped.get(key, 0):
                stopped[key] = stopped.get(key, 0) + 1
    return runs


def cdf_runs(runs: list[dict], profiles: list[str], modes: list[str]) -> list[dict]:
    """The runs the latency CDF compares: per profile, the largest client count every mode
    ran."""
    out = []
    for prof in profiles:
        both = [r for r in runs if r["profile"]["name"] == prof]
        common = set.intersection(*({r["clients"] for r in both if r["mode"] == m}
                                    for m in modes)) if both else set()
        if common:
            out += [r for r in both if r["clients"] == max(common)]
    return out


def write_sweep(json_path: Path, plots_dir: Path | None, runs: list[dict], slo_ms: float,
                settings: dict, verifier: dict, started: float, profiles: list[str],
                modes: list[str]) -> dict:
    """Writes the sweep's JSON, then its plots. A plot that cannot be made (no matplotlib,
    or any failure) is a warning; the JSON then lists only the plots written."""
    counts, figures = capacity(runs, slo_ms)
    plots_dir = plots_dir or json_path.parent
    plots = {"latency_cdf": plots_dir / f"{json_path.stem}-latency-cdf.png",
             "vs_clients": plots_dir / f"{json_path.stem}-vs-clients.png"}
    result = {
        "slo_tpot_p95_ms": slo_ms,
        "capacity": counts,
        "capacity_figures": figures,
        "never_worse": never_worse(runs),
        **settings,
        "points": points(runs),
        "started_unix": started,
        "wall_s": time.time() - started,
        "plots": {k: str(v) for k, v in plots.items()},
        "verifier": verifier,
        "runs": runs,
    }
    write_json(json_path, result)
    written = {}
    try:
        from edge_client.bench.fleet.plots import plot_latency_cdf, plot_vs_clients

        plot_latency_cdf(cdf_runs(runs, profiles, modes), plots["latency_cdf"], slo_ms)
        written["latency_cdf"] = plots["latency_cdf"]
        plot_vs_clients(runs, plots["vs_clients"], slo_ms)
        written["vs_clients"] = plots["vs_clients"]
    except Exception as err:  # noqa: BLE001 - the measurements are saved; plots are extra
        log.warning("sweep: plotting failed (%s: %s); %s has the results", type(err).__name__,
                    err, json_path)
        result["plots"] = {k: str(v) for k, v in written.items()}
        write_json(json_path, result)
    return result
