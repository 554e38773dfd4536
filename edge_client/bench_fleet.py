"""Capacity sweep of the simulated fleet: speculative vs cloud-only serving, per network
profile, over growing client counts; plots with matplotlib (Agg).

**Capacity** of a (mode, profile) is the largest client count whose run keeps the p95 TPOT
(edge_client.fleet defines TPOT) at or under the SLO (200 ms by default) with no failed
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
"""

from __future__ import annotations

import asyncio
import logging
import statistics
import sys
import time
from pathlib import Path

from edge_client.fleet import (
    FleetConfig,
    config_from_args,
    result_line,
    run_fleet_async,
    write_json,
)
from edge_client.fleet_verifier import fleet_verifier

log = logging.getLogger(__name__)

DEFAULT_CLIENTS = (1, 2, 4, 8, 16, 32, 64)
DEFAULT_PROFILES = ("4g", "wifi")
MODES = ("spec", "baseline")
SLO_TPOT_P95_MS = 200.0


def meets_slo(point: dict, slo_ms: float) -> bool:
    return (point["tpot_ms_p95"] is not None and point["tpot_ms_p95"] <= slo_ms
            and point["requests_failed"] == 0)


_MEDIAN_KEYS = ("tokens_per_s", "tpot_ms_p50", "tpot_ms_p95", "tpot_ms_p99", "ttft_ms_p50")


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
        for key in _MEDIAN_KEYS:
            values = [a[key] for a in aggs if a[key] is not None]
            point[key] = statistics.median(values) if values else None
        out.append(point)
    return out


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
            figures[mode][prof] = {k: point[k] for k in ("clients", "windows", *_MEDIAN_KEYS)}
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


def _style(mode: str) -> str:
    return "-" if mode == "spec" else "--"


def plot_latency_cdf(runs: list[dict], path: Path, slo_ms: float | None = None) -> None:
    """CDF of per-request TPOT (left) and TTFT (right), one curve per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for run in runs:
        label = f"{run['mode']} {run['profile']['name']} x{run['clients']}"
        for ax, key in zip(axes, ("tpot_ms", "ttft_ms"), strict=True):
            values = np.sort(np.asarray(run["samples"][key], dtype=float))
            if len(values):
                ax.step(np.r_[values[0], values], np.arange(len(values) + 1) / len(values),
                        where="post", linestyle=_style(run["mode"]), label=label)
    for ax, title in zip(axes, ("time per output token (per request)", "time to first token"),
                         strict=True):
        ax.set_xscale("log")
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of requests")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
    if slo_ms is not None:
        axes[0].axvline(slo_ms, color="grey", linewidth=1)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_vs_clients(runs: list[dict], path: Path, slo_ms: float) -> None:
    """Throughput (left) and p50/p95 TPOT (right) against client count (medians over a
    point's windows)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    series: dict[tuple[str, str], list[dict]] = {}
    for point in points(runs):
        series.setdefault((point["mode"], point["profile"]), []).append(point)
    for (mode, prof), group in sorted(series.items()):
        group.sort(key=lambda p: p["clients"])
        xs = [p["clients"] for p in group]
        left.plot(xs, [p["tokens_per_s"] for p in group], _style(mode),
                  marker="o", label=f"{mode} {prof}")
        for q, marker in (("p50", "o"), ("p95", "^")):
            ys = [p[f"tpot_ms_{q}"] for p in group]
            right.plot(xs, [float("nan") if y is None else y for y in ys], _style(mode),
                       marker=marker, label=f"{mode} {prof} {q}")
    left.set_ylabel("committed tokens/s (all clients)")
    right.set_ylabel("TPOT ms")
    right.axhline(slo_ms, color="grey", linewidth=1)
    right.set_yscale("log")
    counts = sorted({r["clients"] for r in runs})
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xticks(counts)
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("clients")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_bench_fleet_args(p) -> None:
    from edge_client.fleet import add_common_args

    add_common_args(p)
    p.add_argument("--json", type=Path, required=True, metavar="PATH")
    p.add_argument("--clients", type=int, nargs="+", default=list(DEFAULT_CLIENTS),
                   help="client counts to sweep")
    p.add_argument("--profiles", nargs="+", default=list(DEFAULT_PROFILES))
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--duration", type=float, default=20.0, help="window per run, seconds")
    p.add_argument("--repeats", type=int, default=1,
                   help="windows per mode at each load, alternating spec and baseline")
    p.add_argument("--slo-ms", type=float, default=SLO_TPOT_P95_MS,
                   help="p95 TPOT a client count must stay under to count as served")
    p.add_argument("--keep-going", action="store_true",
                   help="run every client count even past the SLO")
    p.add_argument("--plots-dir", type=Path, default=None,
                   help="where the PNGs go (default: beside the JSON)")


def cmd_bench_fleet(args) -> int:
    from shared.paths import default_draft_dir

    if args.repeats < 1:
        raise SystemExit("--repeats must be >= 1")
    configs = [[config_from_args(args, n, prof, mode, args.duration)
                for _ in range(args.repeats) for mode in args.modes]
               for prof in args.profiles for n in sorted(args.clients)]
    started = time.time()
    with fleet_verifier(args, max(args.clients)) as verifier:
        runs = asyncio.run(sweep(verifier.address, configs,
                                 args.draft_dir or default_draft_dir(), args.replay_cache,
                                 args.slo_ms, args.keep_going))
    counts, figures = capacity(runs, args.slo_ms)
    ratios = never_worse(runs)
    plots_dir = args.plots_dir or args.json.parent
    stem = args.json.stem
    plots = {"latency_cdf": plots_dir / f"{stem}-latency-cdf.png",
             "vs_clients": plots_dir / f"{stem}-vs-clients.png"}
    # The CDF compares the modes at the largest client count both ran, per profile.
    cdf_runs = []
    for prof in args.profiles:
        both = [r for r in runs if r["profile"]["name"] == prof]
        common = set.intersection(*({r["clients"] for r in both if r["mode"] == m}
                                    for m in args.modes)) if both else set()
        if common:
            cdf_runs += [r for r in both if r["clients"] == max(common)]
    plot_latency_cdf(cdf_runs, plots["latency_cdf"], args.slo_ms)
    plot_vs_clients(runs, plots["vs_clients"], args.slo_ms)
    write_json(args.json, {
        "slo_tpot_p95_ms": args.slo_ms,
        "capacity": counts,
        "capacity_figures": figures,
        "never_worse": ratios,
        "workload": args.workload,
        "drafts": args.drafts,
        "draft_len": args.draft_len,
        "duration_s": args.duration,
        "repeats": args.repeats,
        "points": points(runs),
        "started_unix": started,
        "wall_s": time.time() - started,
        "plots": {k: str(v) for k, v in plots.items()},
        "verifier": verifier.report.as_dict(),
        "runs": runs,
    })
    for row in ratios:
        ratio = "-" if row["ratio"] is None else (
            f"{row['ratio']:.2f} ({row['ratio_min']:.2f}-{row['ratio_max']:.2f} over "
            f"{row['pairs']})")
        print(f"{row['profile']} x{row['clients']}: spec/baseline tokens/s {ratio}",
              file=sys.stderr)
    print(f"capacity (p95 TPOT <= {args.slo_ms:g} ms): {counts}", file=sys.stderr)
    return 0
