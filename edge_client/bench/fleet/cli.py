"""``edgespec-bench fleet`` (one run) and ``edgespec-bench sweep`` (the capacity sweep): their
arguments and commands. Defining the arguments imports nothing heavy; the commands import
the run (grpc, the draft runtime) and, with --embedded, the verifier (torch)."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

from edge_client.bench.fleet.config import (
    DEFAULT_DRAFTER,
    DEFAULT_STOP_CONFIDENCE,
    DRAFT_SOURCES,
    FLEET_DRAFTERS,
    MODES,
    PROTOCOLS,
    WORKLOADS,
    FleetConfig,
)
from edge_client.bench.fleet.netem import PROFILES

log = logging.getLogger(__name__)

DEFAULT_CLIENTS = (1, 2, 4, 8, 16, 32, 64)
DEFAULT_PROFILES = ("4g", "wifi")
SLO_TPOT_P95_MS = 200.0


def add_common_args(p: argparse.ArgumentParser) -> None:
    """Flags shared by ``fleet`` and ``sweep``."""
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--server", metavar="HOST:PORT",
                       help="a running verifier on this machine (loopback only)")
    where.add_argument("--embedded", action="store_true",
                       help="start a verifier in this process on a free loopback port")
    where.add_argument("--spawn", action="store_true",
                       help="start edgespec-verifier in a child process on a free loopback "
                            "port: the clients' CPU and GIL stay apart from the server's")
    p.add_argument("--model", default=None,
                   help="with --embedded/--spawn: the target checkpoint (default: prepared "
                        "SmolLM2)")
    p.add_argument("--max-sessions", type=int, default=None,
                   help="with --embedded/--spawn: session limit (default: max(64, 2 x "
                        "clients))")
    p.add_argument("--kv-budget-mb", type=float, default=None,
                   help="with --embedded/--spawn: the verifier's KV cache budget (default: "
                        "unbounded)")
    p.add_argument("--verifier-threads", type=int, default=None,
                   help="with --spawn: the verifier's torch threads (default: one per core)")
    p.add_argument("--verifier-arg", action="append", default=None, metavar="ARG",
                   help="with --embedded/--spawn: one more edgespec-verifier argument, e.g. "
                        "--verifier-arg=--prefix-cache-mb=0 (repeatable; given last)")
    p.add_argument("--draft-dir", type=Path, default=None,
                   help="ONNX draft directory; its tokenizer is used in both modes")
    p.add_argument("--workload", choices=WORKLOADS, default="chat")
    p.add_argument("--drafts", choices=DRAFT_SOURCES, default="replay",
                   help="spec mode: run the ONNX draft on each client, or replay drafts "
                        "recorded once from it (greedy only; keeps edge CPU out of the run)")
    p.add_argument("--protocol", choices=PROTOCOLS, default="lookahead",
                   help="spec mode: lookahead (the verifier decodes back to back while the "
                        "device streams drafts ahead; the default), or rounds (a Verify "
                        "round trip per round, with cloud-side Decodes when drafting does "
                        "not pay)")
    p.add_argument("--draft-len", type=int, default=4, help="K, drafts per round")
    p.add_argument("--drafter", choices=FLEET_DRAFTERS, default=DEFAULT_DRAFTER,
                   help="what each device drafts with (and the replay book records): the "
                        "product's drafter kinds (default: the product's, combined)")
    p.add_argument("--stop-confidence", type=float, default=DEFAULT_STOP_CONFIDENCE,
                   help="a round stops drafting below this joint confidence (default: the "
                        "product's)")
    p.add_argument("--no-confidence", action="store_true",
                   help="greedy drafts go without the draft's confidences, so the server's "
                        "suggested draft length alone decides how many it verifies (A/B)")
    p.add_argument("--no-adaptive", action="store_true",
                   help="rounds clients draft whenever the server's suggestion allows, "
                        "instead of choosing drafting or cloud-side decoding by measured rate")
    p.add_argument("--chat-tokens", type=int, default=128, help="max new tokens per chat answer")
    p.add_argument("--prompts", type=int, default=8,
                   help="distinct chat prompts / IME sentences the clients cycle through")
    p.add_argument("--ime-document", action="store_true",
                   help="IME: type the sentences as one document, so each prompt holds all "
                        "the text before it (long contexts; default: each sentence alone)")
    p.add_argument("--think-ms", type=float, default=None,
                   help="pause before each request (default: 0 chat, 300 IME)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--deadline", type=float, default=FleetConfig.deadline_s,
                   help="the longest wait for the verifier's next reply, seconds")
    p.add_argument("--retry-budget-s", type=float, default=FleetConfig.retry_budget_s,
                   help="a request fails after this long without a new token (retries back "
                        "off with jitter as the server asks)")
    p.add_argument("--max-requests", type=int, default=FleetConfig.max_requests,
                   help="per client; the run ends when every client is done or at --duration")
    p.add_argument("--replay-cache", type=Path, default=None,
                   help="recorded drafts file (default: $EDGESPEC_CACHE/fleet-replay/...)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def add_fleet_args(p: argparse.ArgumentParser) -> None:
    add_common_args(p)
    p.add_argument("--json", type=Path, required=True, metavar="PATH")
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--duration", type=float, default=30.0, help="measured window, seconds")
    p.add_argument("--profile", choices=list(PROFILES), default="4g")
    p.add_argument("--mode", choices=MODES, default="spec",
                   help="spec: speculative sessions; baseline: cloud-only decoding")
    p.add_argument("--plot", type=Path, default=None, metavar="PNG",
                   help="also write the latency CDF of this run")


def add_sweep_args(p: argparse.ArgumentParser) -> None:
    add_common_args(p)
    p.add_argument("--json", type=Path, required=True, metavar="PATH")
    p.add_argument("--clients", type=int, nargs="+", default=list(DEFAULT_CLIENTS),
                   help="client counts to sweep")
    p.add_argument("--profiles", nargs="+", choices=list(PROFILES),
                   default=list(DEFAULT_PROFILES))
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--duration", type=float, default=20.0, help="window per run, seconds")
    p.add_argument("--repeats", type=int, default=1,
                   help="windows per mode at each load, alternating spec and baseline")
    p.add_argument("--slo-ms", type=float, default=SLO_TPOT_P95_MS,
                   help="p95 TPOT a client count must stay under to count as served")
    p.add_argument("--keep-going", action="store_true",
                   help="run every client count even past the SLO")
    p.add_argument("--plots-dir", type=Path, default=None,
                   help="where the PNGs go (default: beside the JSON)")


def config_from_args(args: argparse.Namespace, clients: int, profile_name: str, mode: str,
                     duration_s: float) -> FleetConfig:
    return FleetConfig(
        clients=clients, duration_s=duration_s, profile=profile_name, workload=args.workload,
        mode=mode, drafts=args.drafts, protocol=args.protocol, draft_len=args.draft_len,
        drafter=args.drafter, stop_confidence=args.stop_confidence,
        confidence=not args.no_confidence, adaptive=not args.no_adaptive,
        chat_tokens=args.chat_tokens, ime_document=args.ime_document,
        prompts=args.prompts, think_ms=args.think_ms, temperature=args.temperature,
        seed=args.seed, deadline_s=args.deadline, retry_budget_s=args.retry_budget_s,
        max_requests=args.max_requests, progress=not args.no_progress)


def cmd_fleet(args: argparse.Namespace) -> int:
    from edge_client.bench.fleet.report import result_line, write_json
    from edge_client.bench.fleet.run import run_fleet
    from edge_client.bench.fleet.verifier import fleet_verifier
    from shared.paths import default_draft_dir

    try:
        config = config_from_args(args, args.clients, args.profile, args.mode, args.duration)
    except ValueError as err:
        raise SystemExit(f"edgespec-bench fleet: {err}") from None
    with fleet_verifier(args, args.clients) as verifier:
        result = run_fleet(verifier.address, config, args.draft_dir or default_draft_dir(),
                           args.replay_cache)
    result["verifier"] = verifier.report.as_dict()
    write_json(args.json, result)
    if args.plot is not None:
        try:
            from edge_client.bench.fleet.plots import plot_latency_cdf

            plot_latency_cdf([result], args.plot)
        except Exception as err:  # noqa: BLE001 - the result is saved; the plot is extra
            log.warning("fleet: plotting failed (%s: %s); %s has the results",
                        type(err).__name__, err, args.json)
    print(result_line(result), file=sys.stderr)
    return 0


def cmd_sweep(args: argparse.Namespace) -> int:
    import asyncio

    from edge_client.bench.fleet.sweep import sweep, write_sweep
    from edge_client.bench.fleet.verifier import fleet_verifier
    from shared.paths import default_draft_dir

    if args.repeats < 1:
        raise SystemExit("edgespec-bench sweep: --repeats must be >= 1")
    try:
        configs = [[config_from_args(args, n, prof, mode, args.duration)
                    for _ in range(args.repeats) for mode in args.modes]
                   for prof in args.profiles for n in sorted(args.clients)]
    except ValueError as err:
        raise SystemExit(f"edgespec-bench sweep: {err}") from None
    started = time.time()
    with fleet_verifier(args, max(args.clients)) as verifier:
        runs = asyncio.run(sweep(verifier.address, configs,
                                 args.draft_dir or default_draft_dir(), args.replay_cache,
                                 args.slo_ms, args.keep_going))
    settings = {"workload": args.workload, "drafts": args.drafts, "drafter": args.drafter,
                "stop_confidence": args.stop_confidence,
                "draft_len": args.draft_len, "duration_s": args.duration,
                "repeats": args.repeats}
    result = write_sweep(args.json, args.plots_dir, runs, args.slo_ms, settings,
                         verifier.report.as_dict(), started, args.profiles, args.modes)
    for row in result["never_worse"]:
        ratio = "-" if row["ratio"] is None else (
            f"{row['ratio']:.2f} ({row['ratio_min']:.2f}-{row['ratio_max']:.2f} over "
            f"{row['pairs']})")
        print(f"{row['profile']} x{row['clients']}: spec/baseline tokens/s {ratio}",
              file=sys.stderr)
    print(f"capacity (p95 TPOT <= {args.slo_ms:g} ms): {result['capacity']}", file=sys.stderr)
    return 0
