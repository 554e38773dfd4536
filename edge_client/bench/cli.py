"""``edgespec-bench``: the offline benchmarks of the edge side (they import torch).

    edgespec-bench edge --json PATH        # target alone vs assisted generation vs edgespec
    edgespec-bench acceptance --json PATH  # what the target accepts of each drafter's output

The benchmark modules are imported only when their subcommand runs, so ``--help`` and
``--version`` load no torch.
"""

from __future__ import annotations

import argparse
import logging
from importlib.metadata import version
from pathlib import Path


def cmd_edge(args: argparse.Namespace) -> int:
    from edge_client.bench.edge import run_bench

    return run_bench(args)


def cmd_acceptance(args: argparse.Namespace) -> int:
    from edge_client.bench.acceptance import run_bench_acceptance

    return run_bench_acceptance(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="edgespec-bench", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"edgespec {version('edgespec')}")
    parser.add_argument("--log-level", default="WARNING")
    sub = parser.add_subparsers(dest="command", required=True)

    edge = sub.add_parser("edge", help="target alone vs assisted generation vs edgespec")
    edge.add_argument("--json", type=Path, required=True, metavar="PATH")
    edge.add_argument("--prompts", type=int, default=8, help="number of built-in prompts")
    edge.add_argument("--max-new-tokens", type=int, default=48)
    edge.add_argument("--draft-len", type=int, default=4)
    edge.add_argument("--rtt-ms", type=float, default=50.0, help="RTT of the WAN case (d)")
    edge.add_argument("--draft-dir", type=Path, default=None)
    edge.add_argument("--draft-pt-dir", type=Path, default=None,
                      help="the same draft in PyTorch, for assisted generation")
    edge.add_argument("--target", default=None)
    edge.set_defaults(func=cmd_edge)

    acc = sub.add_parser("acceptance",
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
    acc.set_defaults(func=cmd_acceptance)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
