"""The typing run's PNG: the CDF of key-to-suggestion latency per mode (matplotlib, Agg).
Imported only when plotting, after the JSON is written."""

from __future__ import annotations

from pathlib import Path

PANELS = (("first_token_ms", "key press to first suggested token"),
          ("suggest_ms", "key press to whole suggestion"))


def plot_latency_cdf(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    profile = report["settings"]["profile"]
    for name, mode in report["modes"].items():
        if not mode["available"]:
            continue
        keys = mode["aggregate"]["keystrokes"]
        for ax, (key, _) in zip(axes, PANELS, strict=True):
            values = np.sort(np.asarray(mode["samples"][key], dtype=float))
            if len(values) and keys:
                # Over all keys: the curve stops short of 1 by the keys that got nothing.
                ax.step(np.r_[values[0], values], np.arange(len(values) + 1) / keys,
                        where="post", label=f"{name} ({len(values)}/{keys} keys)")
    for ax, (_, title) in zip(axes, PANELS, strict=True):
        ax.set_xscale("log")
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of keystrokes")
        ax.set_ylim(0, 1)
        ax.set_title(f"{title} ({profile})")
        ax.axvline(120, color="grey", linewidth=1)
        ax.grid(True, which="both", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
