"""``edgespec-bench fuzz``: its arguments (importing nothing heavy) and its command."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

PROMPT = "Give me three tips for sleeping better."


def add_fuzz_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", type=Path, required=True, metavar="PATH")
    p.add_argument("--requests", type=int, default=10_000, help="fuzzed requests (calls)")
    p.add_argument("--seed", type=int, default=0, help="Hypothesis seed: same seed, same "
                                                       "requests")
    p.add_argument("--prompt", default=PROMPT, help="the honest session's prompt")
    p.add_argument("--model", default=None, help="the target checkpoint (default: prepared)")
    p.add_argument("--draft-dir", type=Path, default=None,
                   help="the honest session's draft (default: shipped)")
    p.add_argument("--verifier-arg", action="append", default=[], metavar="ARG",
                   help="one more edgespec-verifier argument, e.g. --verifier-arg=--engine=vllm "
                        "(repeatable; given last)")


def cmd_fuzz(args: argparse.Namespace) -> int:
    from edge_client.bench.fuzz.run import run_fuzz
    from edge_client.bench.fuzz.strategies import any_requests
    from edge_client.bench.fuzz.target import FuzzTarget, HonestSession

    if args.requests < 1:
        raise SystemExit("edgespec-bench fuzz: --requests must be >= 1")
    target = FuzzTarget(args.model, extra=args.verifier_arg)
    try:
        with HonestSession(target, args.draft_dir, args.prompt) as honest:
            report = run_fuzz(target, any_requests(target.limits, target.api_key),
                              args.requests, args.seed, honest)
    finally:
        target.close()
    report["config"] = {"model": args.model, "target": target.info.target_model,
                        "verifier_args": args.verifier_arg,
                        "verifier_startup_s": round(target.startup_s, 1)}
    for name, held in report["properties"].items():
        print(f"{name:30s} {'held' if held else 'FAILED'}")
    print(f"{report['requests']} requests ({report['messages']} messages) in "
          f"{report['wall_s']:.0f} s; undocumented statuses {report['undocumented']['count']}, "
          f"hangs {report['hangs']}, server tracebacks {report['server_tracebacks']}, "
          f"RSS max {report['rss_mb']['max']} MB (bound {report['rss_mb']['bound']:.0f}), "
          f"honest runs {report['honest']['runs']} ({report['honest']['mismatches']} changed)")
    for example in report["undocumented"]["examples"][:5]:
        print("  undocumented:", example)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0 if not report["failed_properties"] else 1
