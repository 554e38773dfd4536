"""``edge-client``: generate text with an edge draft and a cloud verifier; benchmark it."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
from pathlib import Path

from shared.paths import default_draft_dir


def _add_generation_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--draft-len", type=int, default=4, help="K, drafts per round")
    p.add_argument("--draft-dir", type=Path, default=None,
                   help=f"ONNX draft model directory (default: {default_draft_dir()})")
    p.add_argument("--drafter", choices=["model", "ngram", "combined"], default="model",
                   help="who drafts: the ONNX model, prompt lookup (n-gram) in the context, "
                        "or the n-gram when it matches and the model otherwise")


def _add_server_args(p: argparse.ArgumentParser) -> None:
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--server", metavar="HOST:PORT", help="a running verifier")
    where.add_argument("--embedded", action="store_true",
                       help="start a local verifier on a free loopback port for this run")
    p.add_argument("--target", default=None,
                   help="with --embedded: target checkpoint (default: prepared SmolLM2)")
    p.add_argument("--api-key", default=os.environ.get("EDGESPEC_API_KEY"),
                   help="bearer key for an authenticated verifier (env EDGESPEC_API_KEY)")
    p.add_argument("--rtt-ms", type=float, default=0.0,
                   help="inject this round-trip time into every call (network emulation)")
    p.add_argument("--transport", choices=["stream", "unary", "lookahead"], default="stream",
                   help="Verify rounds on one Session stream or as unary calls, or one "
                        "Lookahead stream (the verifier decodes back to back while the client "
                        "streams drafts ahead: no round trip per round)")


@contextlib.contextmanager
def verifier_address(args: argparse.Namespace):
    """The --server address, or a verifier started in-process for --embedded."""
    if not args.embedded:
        yield args.server
        return
    # the cloud side needs torch
    from cloud_verifier.server import EmbeddedVerifier, load_served_target

    with EmbeddedVerifier(load_served_target(args.target)) as verifier:
        yield verifier.address


def cmd_generate(args: argparse.Namespace) -> int:
    from edge_client.client import EdgeClient, GenerationConfig

    config = GenerationConfig(
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
        top_p=args.top_p, seed=args.seed, draft_len=args.draft_len, drafter=args.drafter)
    draft_dir = args.draft_dir or default_draft_dir()
    # With --json, stdout carries only the JSON object; the text streams to stderr.
    out = sys.stderr if args.json else sys.stdout
    with verifier_address(args) as address, EdgeClient(
            address, draft_dir, api_key=args.api_key, rtt_ms=args.rtt_ms,
            protocol=args.transport) as client:
        generation = client.generate(args.prompt, config, chat=not args.raw)
        for piece in generation.text():
            out.write(piece)
            out.flush()
        out.write("\n")
        stats = generation.stats.to_dict()
        if args.json:
            json.dump({"text": client.tokenizer.decode(generation.token_ids),
                       "token_ids": generation.token_ids, "stats": stats}, sys.stdout)
            sys.stdout.write("\n")
        else:
            print(f"[{stats['new_tokens']} tokens in {stats['wall_s']:.2f} s, "
                  f"{stats['tokens_per_s']:.1f} tok/s; acceptance {stats['acceptance_rate']:.2f}, "
                  f"{stats['tokens_per_round']:.2f} tokens/round, {stats['round_trips']} round "
                  f"trips, {stats['target_forwards']} target forwards]", file=sys.stderr)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from edge_client.bench import run_bench  # offline tool: needs torch

    return run_bench(args)


def cmd_bench_acceptance(args: argparse.Namespace) -> int:
    from edge_client.bench_acceptance import run_bench_acceptance  # offline tool: needs torch

    return run_bench_acceptance(args)


def cmd_fleet(args: argparse.Namespace) -> int:
    from edge_client.fleet import cmd_fleet as run_fleet_cli

    return run_fleet_cli(args)


def cmd_bench_fleet(args: argparse.Namespace) -> int:
    from edge_client.bench_fleet import cmd_bench_fleet as run_bench_fleet_cli

    return run_bench_fleet_cli(args)


def build_parser() -> argparse.ArgumentParser:
    from edge_client.bench_fleet import add_bench_fleet_args
    from edge_client.fleet import add_fleet_args

    parser = argparse.ArgumentParser(prog="edge-client", description=__doc__)
    parser.add_argument("--log-level", default="WARNING")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text through a verifier")
    _add_server_args(gen)
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--raw", action="store_true",
                     help="send the prompt as raw text, without the chat template")
    gen.add_argument("--json", action="store_true",
                     help="print one JSON object with text, token_ids and stats at the end")
    _add_generation_args(gen)
    gen.set_defaults(func=cmd_generate)

    bench = sub.add_parser("bench", help="target alone vs assisted generation vs edgespec")
    bench.add_argument("--json", type=Path, required=True, metavar="PATH")
    bench.add_argument("--prompts", type=int, default=8, help="number of built-in prompts")
    bench.add_argument("--max-new-tokens", type=int, default=48)
    bench.add_argument("--draft-len", type=int, default=4)
    bench.add_argument("--rtt-ms", type=float, default=50.0, help="RTT of the WAN case (d)")
    bench.add_argument("--draft-dir", type=Path, default=None)
    bench.add_argument("--draft-pt-dir", type=Path, default=None,
                       help="the same draft in PyTorch, for assisted generation")
    bench.add_argument("--target", default=None)
    bench.set_defaults(func=cmd_bench)

    acc = sub.add_parser("bench-acceptance",
                         help="acceptance of the model, n-gram and combined drafters on "
                              "held-out prompts, in-process")
    acc.add_argument("--json", type=Path, required=True, metavar="PATH")
    acc.add_argument("--prompts", type=int, default=None,
                     help="use only the first N held-out prompts (default: all)")
    acc.add_argument("--max-new-tokens", type=int, default=32)
    acc.add_argument("--draft-len", type=int, default=4, help="K of the measured rounds")
    acc.add_argument("--draft-dir", type=Path, default=None)
    acc.add_argument("--target", default=None)
    acc.add_argument("--threads", type=int, default=None,
                     help="torch and onnxruntime intra-op threads (default: their own)")
    acc.set_defaults(func=cmd_bench_acceptance)

    fleet = sub.add_parser("fleet", help="N simulated edge devices (network profiles, "
                                         "workloads) load-testing a verifier over gRPC")
    add_fleet_args(fleet)
    fleet.set_defaults(func=cmd_fleet)

    bench_fleet = sub.add_parser("bench-fleet", help="capacity sweep over client counts: "
                                                     "speculative vs cloud-only, per profile")
    add_bench_fleet_args(bench_fleet)
    bench_fleet.set_defaults(func=cmd_bench_fleet)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
