"""``edgespec-bench ime``: its arguments (importing nothing heavy) and its command."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from dataclasses import asdict
from pathlib import Path

from edge_client.bench.fleet.netem import PROFILES
from edge_client.bench.ime.typist import TypingProfile

log = logging.getLogger(__name__)

MODE_NAMES = ("edit", "reopen", "cloud-only")  # edge_client.bench.ime.modes.MODES


def add_ime_args(p: argparse.ArgumentParser) -> None:
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--server", metavar="HOST:PORT",
                       help="a running verifier (no outage drill: the benchmark cannot stop it)")
    where.add_argument("--embedded", action="store_true",
                       help="start a verifier process on free loopback ports for the run; the "
                            "outage drill kills and restarts it")
    p.add_argument("--profile", choices=list(PROFILES), default="wifi",
                   help="the emulated network of every mode (the fleet's profiles)")
    p.add_argument("--duration", type=float, default=60.0, metavar="S",
                   help="seconds of typing per mode in the measured phase (the modes take "
                        "turns, field by field, on the same keys)")
    p.add_argument("--json", type=Path, required=True, metavar="PATH")
    p.add_argument("--plot", type=Path, default=None, metavar="PNG",
                   help="the latency CDF per mode (default: beside the JSON, .png)")
    p.add_argument("--modes", nargs="+", choices=MODE_NAMES, default=list(MODE_NAMES))
    p.add_argument("--model", default=None,
                   help="with --embedded: the target checkpoint (default: prepared SmolLM2)")
    p.add_argument("--verifier-arg", action="append", default=None, metavar="ARG",
                   help="with --embedded: one more edgespec-verifier argument (repeatable)")
    p.add_argument("--metrics-url", default=None, metavar="URL",
                   help="with --server: its Prometheus endpoint, for the server-side forwards "
                        "and tokens computed (default: the client's own counts)")
    p.add_argument("--draft-dir", type=Path, default=None)
    p.add_argument("--draft-threads", type=int, default=None,
                   help="onnxruntime intra-op threads of the draft (default: its own)")
    p.add_argument("--draft-len", type=int, default=4, help="K, drafts per round")
    p.add_argument("--messages", type=Path, default=None, metavar="PATH",
                   help="the messages to type, one a line (default: the benchmark's own)")
    p.add_argument("--typo-rate", type=float, default=0.03,
                   help="per letter: mistyped, then erased with a backspace")
    p.add_argument("--linger-ms", type=float, default=TypingProfile.linger_ms,
                   help="after a message's last key, how long the user waits for its "
                        "suggestion before sending")
    p.add_argument("--fallback", choices=("fail", "draft-only"), default="draft-only",
                   help="edit sessions while the verifier is away")
    p.add_argument("--budget-ms", type=float, default=None,
                   help="edit sessions' latency budget per suggestion (default: none)")
    p.add_argument("--settle-ms", type=float, default=0.0,
                   help="every mode waits this long after a key before asking for a "
                        "suggestion; a newer key cancels the wait, with no work sent "
                        "(edit sessions: GenerationConfig.settle_ms; default 0)")
    p.add_argument("--word-settle-ms", type=float, default=None,
                   help="every mode waits after a key inside a word as a document does, "
                        "from this default (edge_client.typing_pace; default: edit sessions "
                        "the product's GenerationConfig.word_settle_ms, reopen and "
                        "cloud-only, today's clients, none)")
    p.add_argument("--no-follow-suggested-k", action="store_true",
                   help="edit sessions draft K every round instead of following the "
                        "verifier's suggested K (which is 0, plain decoding, when drafting "
                        "does not pay)")
    p.add_argument("--no-heal", action="store_true",
                   help="edit sessions send the text's own tokens: no token healing and no "
                        "type-through (GenerationConfig.heal=False)")
    p.add_argument("--no-preview", action="store_true",
                   help="edit sessions show nothing while they wait for the typing: no "
                        "draft preview (GenerationConfig.preview=False)")
    p.add_argument("--no-outage", action="store_true", help="skip the outage drill")
    p.add_argument("--outage-modes", nargs="+", choices=MODE_NAMES, default=None,
                   help="the modes the drill runs for (default: every mode measured)")
    p.add_argument("--outage-after", type=float, default=3.0, metavar="S",
                   help="drill: seconds of typing before the verifier is killed")
    p.add_argument("--outage", type=float, default=5.0, metavar="S",
                   help="drill: seconds between the kill and the restart")
    p.add_argument("--recovery", type=float, default=6.0, metavar="S",
                   help="drill: seconds of typing after the verifier serves again")
    p.add_argument("--retry-budget-s", type=float, default=60.0,
                   help="a suggestion fails after this long without a new token")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def cmd_ime(args: argparse.Namespace) -> int:
    from edge_client.bench.ime.modes import edit_sessions_available
    from edge_client.bench.ime.report import build_report, summary_lines, write_json
    from edge_client.bench.ime.run import ImeConfig, run_ime
    from edge_client.bench.ime.typist import load_messages
    from edge_client.bench.ime.verifier import SpawnedVerifier, VerifierHandle
    from edge_client.local_verifier import VerifierStartError

    modes, unavailable = tuple(dict.fromkeys(args.modes)), {}
    if "edit" in modes and not edit_sessions_available():
        unavailable["edit"] = ("this client has no edit-session API (AsyncEdgeClient.document) "
                               "yet; edit sessions were not measured")
        modes = tuple(m for m in modes if m != "edit")
    try:
        messages = load_messages(args.messages)
        config = ImeConfig(modes=modes, profile=args.profile, duration_s=args.duration,
                           seed=args.seed, draft_len=args.draft_len,
                           fallback=args.fallback == "draft-only", budget_ms=args.budget_ms,
                           follow_suggested_k=not args.no_follow_suggested_k,
                           settle_ms=args.settle_ms, word_settle_ms=args.word_settle_ms,
                           heal=not args.no_heal, preview=not args.no_preview,
                           drill=not args.no_outage,
                           drill_modes=tuple(args.outage_modes) if args.outage_modes else None,
                           outage_after_s=args.outage_after,
                           outage_s=args.outage, recovery_s=args.recovery,
                           retry_budget_s=args.retry_budget_s,
                           draft_threads=args.draft_threads, progress=not args.no_progress,
                           typing=TypingProfile(typo_rate=args.typo_rate,
                                                linger_ms=args.linger_ms))
    except (ValueError, OSError) as err:
        raise SystemExit(f"edgespec-bench ime: {err}") from None
    if args.embedded:
        try:
            verifier = SpawnedVerifier(args.model, args.verifier_arg)
        except VerifierStartError as err:
            raise SystemExit(f"edgespec-bench ime: --embedded: {err}") from None
    else:
        verifier = VerifierHandle(args.server, args.metrics_url)
    try:
        result = asyncio.run(run_ime(verifier, args.draft_dir, config, messages))
    finally:
        verifier.stop()
    settings = {k: v for k, v in asdict(config).items() if k not in ("progress",)}
    settings.update(messages=str(args.messages or "edge_client/bench/ime/messages.txt"),
                    model=args.model, draft_dir=str(args.draft_dir) if args.draft_dir else None)
    drill = ("ran" if result.drills else "skipped: --no-outage" if args.no_outage
             else "skipped: --server (the benchmark cannot stop a verifier it did not start)")
    report = build_report(result, settings,
                          {"embedded": bool(args.embedded), "startup_s": verifier.startup_s,
                           "metrics": verifier.metrics_url is not None, "outage_drill": drill},
                          unavailable)
    write_json(args.json, report)
    plot = args.plot or args.json.with_suffix(".png")
    try:
        from edge_client.bench.ime.plots import plot_latency_cdf

        plot_latency_cdf(report, plot)
    except Exception as err:  # noqa: BLE001 - the results are saved; the plot is extra
        log.warning("ime: plotting failed (%s: %s); %s has the results",
                    type(err).__name__, err, args.json)
    for line in summary_lines(report):
        print(line, file=sys.stderr)
    return 0
