"""``python -m edge_client.bench.learning_curve RUN [RUN ...] [--start FILE] [--png PATH]``: a
training run's learning curve on the realistic set, greedy alpha against target tokens seen,
overall and per category, as a Markdown table (and a PNG).

It reads what ``train --heldout <realistic dir>`` logged (``metrics.jsonl``: ``tokens_seen``,
``heldout``, ``by_category`` at every evaluation; see ``bench.realistic_data``). ``--start``
adds the starting weights' row (the same record, measured before step 1), so the curve begins
where the run began. Several runs are one curve when each started from the one before
(``train --init-from``): a later run's tokens and steps count on from where the earlier ended, and
its rows are named ``RUNNAME:step``."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _run_rows(run: Path) -> list[dict]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x]
    # a resumed run evaluates again the steps after its checkpoint: the later record counts
    return list({r["step"]: r for r in rows if "by_category" in r}.values())


def curve(run: Path | list[Path], start: Path | None = None) -> list[dict]:
    runs = [run] if isinstance(run, Path) else list(run)
    rows = _run_rows(runs[0])
    for later in runs[1:]:  # each continues the last: count its tokens and steps on from there
        base = rows[-1] if rows else {"step": 0, "tokens_seen": 0}
        rows += [{**r, "step": f"{later.name}:{r['step']}",
                  "tokens_seen": r["tokens_seen"] + base["tokens_seen"]}
                 for r in _run_rows(later)]
    if start is not None:
        rows.insert(0, json.loads(start.read_text()))
    if not rows:
        raise SystemExit(f"{runs[0]}/metrics.jsonl has no per-category evaluation (train with "
                         "--heldout pointing at a realistic_data directory)")
    return rows


def table(rows: list[dict]) -> str:
    cats = [c for c in rows[0]["by_category"] if c != "all"]
    head = ["step", "tokens seen", "greedy alpha", "tokens/round K=4", *cats]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        bc = r["by_category"]
        lines.append("| " + " | ".join([str(r["step"]), f"{r['tokens_seen']:,}",
                                        f"{bc['all']:.3f}",
                                        f"{r['heldout']['tokens_per_round']:.2f}",
                                        *(f"{bc[c]:.3f}" for c in cats)]) + " |")
    return "\n".join(lines)


def plot(rows: list[dict], png: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [r["tokens_seen"] / 1e6 for r in rows]
    fig, ax = plt.subplots(figsize=(8, 4.2))
    for cat in rows[0]["by_category"]:
        y = [r["by_category"][cat] for r in rows]
        ax.plot(x, y, marker="o", lw=3 if cat == "all" else 1, alpha=1 if cat == "all" else 0.6,
                label=cat, color="black" if cat == "all" else None)
    ax.axhline(0.55, ls="--", color="grey", lw=1)
    ax.text(x[-1], 0.553, "goal 0.55", ha="right", va="bottom", fontsize=8, color="grey")
    ax.set_xlabel("target tokens seen in training (millions)")
    ax.set_ylabel("greedy alpha, realistic set (PyTorch, teacher-forced)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))  # off the lines
    ax.grid(alpha=0.3)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", type=Path, nargs="+", help="a run, or runs each started from the last")
    ap.add_argument("--start", type=Path, default=None,
                    help="a JSON record of the starting weights (step 0)")
    ap.add_argument("--png", type=Path, default=None)
    ap.add_argument("--title", default="greedy alpha against training tokens")
    args = ap.parse_args(argv)
    rows = curve(args.run, args.start)
    print(table(rows))
    if args.png is not None:
        plot(rows, args.png, args.title)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
