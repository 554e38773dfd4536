"""Which project functions and files one steady-state Verify round runs through, client and
server together: an embedded verifier, a greedy generation, and ``sys.setprofile`` on every
thread from the client's building of its third round's message to its applying of the reply
(drafting excluded).

    python -m edge_client.bench.round_path [--json PATH]

``--root``, ``--start``, ``--end`` and ``--protocol`` let the same tracer run over an older
checkout, e.g. for HEAD 17efb92 checked out in OLD:
``python edge_client/bench/round_path.py --root OLD --start verify_request --protocol stream``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="round_path", description=__doc__.splitlines()[0])
    p.add_argument("--root", default=str(Path(__file__).resolve().parents[2]))
    p.add_argument("--start", default="verify_message", help="function that starts a round")
    p.add_argument("--end", default="apply", help="function whose return ends it")
    p.add_argument("--protocol", default="rounds")
    p.add_argument("--json", type=Path, default=None, metavar="PATH")
    args = p.parse_args(argv)
    root = os.path.abspath(args.root)
    seen: set[tuple[str, str]] = set()
    state = {"on": False, "starts": 0}

    def ours(filename: str) -> bool:
        return (filename.startswith(root) and "site-packages" not in filename
                and "/pb/" not in filename)

    def profile(frame, event, arg):
        code = frame.f_code
        if not ours(code.co_filename):
            return
        if event == "call" and code.co_name == args.start:
            state["starts"] += 1
            state["on"] = state["starts"] == 3  # the third round: steady state
        if state["on"] and event == "call":
            seen.add((os.path.relpath(code.co_filename, root), code.co_qualname))
        if state["on"] and event == "return" and code.co_name == args.end:
            state["on"] = False

    sys.path.insert(0, root)  # the checkout being traced, whichever is installed
    # Before anything starts a thread, so that every thread is traced.
    threading.setprofile(profile)
    sys.setprofile(profile)
    from cloud_verifier.config import VerifierConfig
    from cloud_verifier.server import EmbeddedVerifier, load_served_target
    from edge_client.client import EdgeClient, GenerationConfig
    from shared.paths import default_draft_dir, default_target_dir

    with EmbeddedVerifier(load_served_target(default_target_dir()),
                          VerifierConfig(port=0)) as verifier, \
            EdgeClient(verifier.address, default_draft_dir(), protocol=args.protocol) as c:
        list(c.generate("Give me three tips for sleeping better.",
                        GenerationConfig(max_new_tokens=40)))
    sys.setprofile(None)
    threading.setprofile(None)
    files = sorted({f for f, _ in seen})
    report = {"files": len(files), "functions": len(seen), "file_list": files,
              "function_list": sorted(f"{f}:{q}" for f, q in seen)}
    print(f"one Verify round: {report['functions']} functions in {report['files']} files")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
