"""python -m edge_client.bench.learning_curve: the table and the plot from a run's per-category
evaluations, the starting weights' row first, and a clear error for a run without them."""

from __future__ import annotations

import json

import pytest

from edge_client.bench.learning_curve import curve, main, table


def _rec(step, tokens, alpha):
    return {"step": step, "tokens_seen": tokens,
            "heldout": {"greedy_alpha": alpha, "tokens_per_round": 1.5 + alpha},
            "by_category": {"email": alpha - 0.1, "ime": alpha + 0.1, "all": alpha}}


def test_the_curve_starts_at_the_starting_weights_and_prints_every_category(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    lines = [{"step": 10, "loss": 1.0}, _rec(50, 150_000, 0.4), _rec(50, 150_000, 0.45),
             _rec(100, 300_000, 0.5)]  # step 50 twice: a resumed run's record replaces it
    (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    start = tmp_path / "start.json"
    start.write_text(json.dumps(_rec(0, 0, 0.42)))
    rows = curve(run, start)
    assert [r["step"] for r in rows] == [0, 50, 100]
    assert rows[1]["by_category"]["all"] == 0.45
    text = table(rows)
    assert text.splitlines()[0] == ("| step | tokens seen | greedy alpha | tokens/round K=4 | "
                                    "email | ime |")
    assert "| 100 | 300,000 | 0.500 | 2.00 | 0.400 | 0.600 |" in text
    png = tmp_path / "curve.png"
    assert main([str(run), "--start", str(start), "--png", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| 0 | 0 | 0.420 |" in capsys.readouterr().out


def test_a_run_without_per_category_evaluations_is_refused(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.0}) + "\n")
    with pytest.raises(SystemExit, match="no per-category evaluation"):
        curve(tmp_path)


def test_runs_that_continue_one_another_make_one_curve(tmp_path):
    """A second run trained from the first's weights: its tokens count on from the first's
    last evaluation, its rows are named after it."""
    first, second = tmp_path / "v8a", tmp_path / "v8b"
    for run, recs in ((first, [_rec(50, 100_000, 0.43), _rec(100, 200_000, 0.44)]),
                      (second, [_rec(50, 120_000, 0.45)])):
        run.mkdir()
        (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in recs))
    rows = curve([first, second])
    assert [r["step"] for r in rows] == [50, 100, "v8b:50"]
    assert [r["tokens_seen"] for r in rows] == [100_000, 200_000, 320_000]
    assert "| v8b:50 | 320,000 | 0.450 |" in table(rows)
