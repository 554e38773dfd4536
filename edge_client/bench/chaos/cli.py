"""``edgespec-bench chaos``: its arguments (importing nothing heavy) and its command, which
imports the run (grpc, the draft runtime)."""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

from edge_client.bench.chaos.scenarios import DECODINGS, SCENARIOS

PROMPT = "Explain how a bicycle stays upright, in a few sentences."


def add_chaos_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", type=Path, required=True, metavar="PATH")
    p.add_argument("--runs", type=int, default=20, help="runs per scenario")
    p.add_argument("--scenarios", nargs="+", choices=list(SCENARIOS), default=list(SCENARIOS))
    p.add_argument("--decodings", nargs="+", choices=list(DECODINGS), default=list(DECODINGS),
                   help="run r uses the (r mod n)-th of these")
    p.add_argument("--tokens", type=int, default=48, help="new tokens per generation")
    p.add_argument("--prompt", default=PROMPT)
    p.add_argument("--retry-budget-s", type=float, default=60.0,
                   help="the client's retry budget (plus three verifier start-ups)")
    p.add_argument("--model", default=None, help="the target checkpoint (default: prepared)")
    p.add_argument("--draft-dir", type=Path, default=None)
    p.add_argument("--verifier-arg", action="append", default=[], metavar="ARG",
                   help="one more edgespec-verifier argument, e.g. --verifier-arg=--engine=vllm "
                        "(repeatable; given last)")


def cmd_chaos(args: argparse.Namespace) -> int:
    if args.runs < 1 or args.tokens < 1:
        raise SystemExit("edgespec-bench chaos: --runs and --tokens must be >= 1")
    from edge_client.bench.chaos.run import RunSettings, format_table, run_chaos

    settings = RunSettings(args.draft_dir, args.prompt, args.tokens, args.retry_budget_s)
    report = asyncio.run(run_chaos(args.model, settings, args.scenarios, args.decodings,
                                   args.runs, args.verifier_arg))
    print(format_table(report["table"]))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0 if report["ok"] else 1
