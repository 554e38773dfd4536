"""``edgespec-bench keyboard``: the keyboard demo page as a user meets it, with the real
models, in headless Chromium (edge_client.bench.browser).

The IME fragments of the realistic set are typed into the page of ``edge-client serve`` key
by key (``--key-delay-ms`` apart, a quick typist), each followed by a space, and after that
last key the page is watched (polled every 5 ms) for the first suggestion shown (verified or
marked draft-only), the first verified text, and the whole suggestion. Prints medians and
p95s of those times, and with ``--png`` saves a screenshot of the last fragment's whole
suggestion (the figure in docs/clients.md).

The verifier is the prepared SmolLM2 on a loopback port (or ``--server``), the draft the
shipped one, the page's own suggestion length (edge_client.serve.keyboard).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import statistics
import time
from pathlib import Path

log = logging.getLogger(__name__)

SHOWN = """() => (document.getElementById('ghost').textContent
    + document.getElementById('ghost-draft').textContent).length > 0"""
VERIFIED = "() => document.getElementById('ghost').textContent.length > 0"
FINAL = "() => document.getElementById('ghost').dataset.final === 'yes'"
POLL_MS = 5


def add_keyboard_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--server", metavar="HOST:PORT", help="a running verifier (default: "
                   "start one with the prepared SmolLM2 on a loopback port)")
    p.add_argument("--draft-dir", type=Path, default=None, help="ONNX draft (default: the "
                   "shipped draft)")
    p.add_argument("--fragments", type=int, default=12, help="IME fragments of the "
                   "realistic set to type")
    p.add_argument("--key-delay-ms", type=float, default=40.0, help="between two keys")
    p.add_argument("--png", type=Path, default=None, help="save a screenshot here")
    p.add_argument("--json", type=Path, default=None, metavar="PATH")


def _since(page, condition: str, t0: float, timeout_ms: float = 30_000) -> float:
    page.wait_for_function(condition, polling=POLL_MS, timeout=timeout_ms)
    return (time.perf_counter() - t0) * 1000


def _summary(values: list[float]) -> dict:
    ordered = sorted(values)
    p95 = ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]
    return {"median_ms": round(statistics.median(values), 1), "p95_ms": round(p95, 1),
            "n": len(values)}


def type_fragment(page, text: str, key_delay_ms: float) -> dict:
    """Types ``text`` and a space into a cleared field; the times after the space."""
    page.fill("#input", "")
    page.keyboard.type(text, delay=key_delay_ms)
    page.keyboard.type(" ")
    t0 = time.perf_counter()
    shown = _since(page, SHOWN, t0)
    verified = _since(page, VERIFIED, t0)
    final = _since(page, FINAL, t0)
    suggestion = page.evaluate("document.getElementById('ghost').textContent")
    return {"text": text, "shown_ms": round(shown, 1), "verified_ms": round(verified, 1),
            "final_ms": round(final, 1), "suggestion": suggestion}


def cmd_keyboard(args: argparse.Namespace) -> int:
    from edge_client.bench.browser import chromium_path, open_page, wait_for_status
    from edge_client.bench.eval_set import load_eval
    from edge_client.local_verifier import local_verifier
    from edge_client.serve.openai_api import ServeOptions
    from edge_client.serve.runner import ServerThread, build_app

    executable = chromium_path()
    if executable is None:
        raise SystemExit("edgespec-bench keyboard: needs chromium (apt-get install chromium)")
    fragments = [p.raw for p in load_eval(["ime"])][:args.fragments]
    if not fragments:
        raise SystemExit("--fragments must be at least 1")
    rows = []
    with contextlib.ExitStack() as stack:
        address = args.server or stack.enter_context(local_verifier())
        server = stack.enter_context(ServerThread(build_app(
            address, args.draft_dir, {}, ServeOptions())))
        page, errors = stack.enter_context(open_page(
            server.base_url + "/", executable, viewport={"width": 900, "height": 420}))
        wait_for_status(page, "connected", timeout_ms=60_000)
        page.focus("#input")
        type_fragment(page, "Hello", 0)  # warm: the first paint and the first session
        for text in fragments:
            rows.append(type_fragment(page, text, args.key_delay_ms))
            log.info("%s", rows[-1])
        if args.png is not None:
            args.png.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(args.png))
        if errors:
            raise SystemExit(f"the page logged errors: {errors}")
    result = {name: _summary([r[f"{name}_ms"] for r in rows])
              for name in ("shown", "verified", "final")}
    for name, what in (("shown", "first suggestion shown"), ("verified", "first verified text"),
                       ("final", "whole suggestion")):
        s = result[name]
        print(f"after the space, {what + ':':24s} median {s['median_ms']:7.1f} ms, "
              f"p95 {s['p95_ms']:7.1f} ms (n={s['n']})")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"summary": result, "fragments": rows}, indent=1))
    return 0
