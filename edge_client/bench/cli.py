"""``edgespec-bench``: the benchmarks and the load test of edgespec.

    edgespec-bench e2e --json PATH         # target alone vs assisted generation vs edgespec
    edgespec-bench acceptance --json PATH  # what the target accepts of each drafter's output
    edgespec-bench fleet --spawn --json PATH   # N simulated devices load-testing a verifier
    edgespec-bench sweep --spawn --json PATH   # capacity sweep: spec vs cloud-only
    edgespec-bench ime --embedded --profile wifi --duration 60 --json PATH   # typing latency
    edgespec-bench chaos --runs 20 --json PATH  # faults and verifier restarts: 0 tokens lost
    edgespec-bench fuzz --requests 10000 --json PATH  # Hypothesis against a live verifier
    edgespec-bench serve                   # first token through edge-client serve's HTTP API
    edgespec-bench keyboard --png PATH     # the keyboard page in chromium, real models

One name per concept on every subcommand: ``--json PATH``, ``--model`` (a target
checkpoint), ``--draft-dir``, ``--protocol``. The benchmark modules are imported only when
their subcommand runs, so ``--help`` and ``--version`` load no torch.
"""

from __future__ import annotations

import argparse
from importlib.metadata import version
from pathlib import Path

MODEL_HELP = "the target checkpoint (default: prepared SmolLM2)"


def cmd_e2e(args: argparse.Namespace) -> int:
    from edge_client.bench.edge import run_bench

    return run_bench(args)


def cmd_acceptance(args: argparse.Namespace) -> int:
    from edge_client.bench.acceptance import run_bench_acceptance

    return run_bench_acceptance(args)


def cmd_fleet(args: argparse.Namespace) -> int:
    from edge_client.bench.fleet.cli import cmd_fleet as run

    return run(args)


def cmd_sweep(args: argparse.Namespace) -> int:
    from edge_client.bench.fleet.cli import cmd_sweep as run

    return run(args)


def cmd_ime(args: argparse.Namespace) -> int:
    from edge_client.bench.ime.cli import cmd_ime as run

    return run(args)


def cmd_chaos(args: argparse.Namespace) -> int:
    from edge_client.bench.chaos.cli import cmd_chaos as run

    return run(args)


def cmd_fuzz(args: argparse.Namespace) -> int:
    from edge_client.bench.fuzz.cli import cmd_fuzz as run

    return run(args)


def build_parser() -> argparse.ArgumentParser:
    from edge_client.bench.chaos.cli import add_chaos_args
    from edge_client.bench.fleet.cli import add_fleet_args, add_sweep_args
    from edge_client.bench.fuzz.cli import add_fuzz_args
    from edge_client.bench.ime.cli import add_ime_args

    parser = argparse.ArgumentParser(prog="edgespec-bench", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"edgespec {version('edgespec')}")
    parser.add_argument("--log-level", default="WARNING")
    sub = parser.add_subparsers(dest="command", required=True)

    e2e = sub.add_parser("e2e", help="target alone vs assisted generation vs edgespec, "
                                     "end to end on the same prompts")
    e2e.add_argument("--json", type=Path, required=True, metavar="PATH")
    e2e.add_argument("--prompts", type=int, default=8, help="number of built-in prompts")
    e2e.add_argument("--max-new-tokens", type=int, default=48)
    e2e.add_argument("--draft-len", type=int, default=4)
    e2e.add_argument("--rtt-ms", type=float, default=50.0, help="RTT of the WAN case (d)")
    e2e.add_argument("--draft-dir", type=Path, default=None)
    e2e.add_argument("--draft-pt-dir", type=Path, default=None,
                     help="the same draft in PyTorch, for assisted generation")
    # The benchmark modules read the checkpoint as args.target.
    e2e.add_argument("--model", dest="target", default=None, help=MODEL_HELP)
    e2e.set_defaults(func=cmd_e2e)

    acc = sub.add_parser("acceptance",
                         help="acceptance of the model, n-gram and combined drafters on the "
                              "realistic eval set by category and on the held-out split, "
                              "in-process")
    acc.add_argument("--json", type=Path, required=True, metavar="PATH")
    acc.add_argument("--sets", nargs="+", choices=("realistic", "heldout"),
                     default=["realistic", "heldout"],
                     help="prompt sets to measure, reported realistic first (default: both)")
    acc.add_argument("--prompts", type=int, default=None, metavar="N",
                     help="at most N evenly spaced prompts per category of the realistic "
                          "set, and N evenly spaced held-out prompts (default: all)")
    acc.add_argument("--heldout-prompts", type=int, default=None, metavar="N",
                     help="N evenly spaced held-out prompts (default: --prompts)")
    acc.add_argument("--max-new-tokens", type=int, default=32)
    acc.add_argument("--draft-len", type=int, default=4, help="K of the measured rounds")
    acc.add_argument("--draft-dir", type=Path, default=None)
    acc.add_argument("--model", dest="target", default=None, help=MODEL_HELP)
    acc.add_argument("--threads", type=int, default=None,
                     help="torch and onnxruntime intra-op threads (default: their own)")
    acc.set_defaults(func=cmd_acceptance)

    fleet = sub.add_parser("fleet", help="N simulated edge devices (network profiles, "
                                         "workloads) load-testing a verifier over gRPC")
    add_fleet_args(fleet)
    fleet.set_defaults(func=cmd_fleet)

    sweep = sub.add_parser("sweep", help="capacity sweep over client counts: speculative vs "
                                         "cloud-only, per network profile")
    add_sweep_args(sweep)
    sweep.set_defaults(func=cmd_sweep)

    ime = sub.add_parser("ime", help="typing benchmark: keystroke-to-suggestion latency of "
                                     "edit sessions, a session per key, and cloud-only, with "
                                     "an outage drill")
    add_ime_args(ime)
    ime.set_defaults(func=cmd_ime)

    chaos = sub.add_parser("chaos", help="network faults and verifier kills under a "
                                         "generation: tokens lost or duplicated, outputs "
                                         "identical to a fault-free run")
    add_chaos_args(chaos)
    chaos.set_defaults(func=cmd_chaos)

    fuzz = sub.add_parser("fuzz", help="Hypothesis-drawn requests against a live verifier: "
                                       "only documented statuses, no crash, RSS bounded, an "
                                       "honest session unchanged")
    add_fuzz_args(fuzz)
    fuzz.set_defaults(func=cmd_fuzz)

    from edge_client.bench.serve_bench import add_serve_bench_args, cmd_serve_bench

    serve = sub.add_parser("serve", help="first-token latency through edge-client serve's "
                                         "OpenAI API vs the library, and of a follow-up chat "
                                         "turn (needs the serve extra and openai)")
    add_serve_bench_args(serve)
    serve.set_defaults(func=cmd_serve_bench)

    from edge_client.bench.keyboard_page import add_keyboard_args, cmd_keyboard

    keyboard = sub.add_parser("keyboard", help="the keyboard demo page in headless chromium "
                                               "with the real models: time from a key to "
                                               "its suggestion, and a screenshot")
    add_keyboard_args(keyboard)
    keyboard.set_defaults(func=cmd_keyboard)
    return parser


def main(argv: list[str] | None = None) -> int:
    from edge_client.errors import run_command

    return run_command("edgespec-bench", build_parser().parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
