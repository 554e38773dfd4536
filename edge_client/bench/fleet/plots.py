"""The fleet's plots (matplotlib, Agg): latency CDFs of runs, and a sweep's figures against
the client count. Imported only when plotting, after the JSON is written."""

from __future__ import annotations

from pathlib import Path

from edge_client.bench.fleet.points import points


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
