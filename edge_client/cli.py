"""``edge-client``: generate text with the on-device draft and a cloud verifier.

The benchmarks and the load test are ``edgespec-bench`` (edge_client.bench); this command
is the device runtime alone. ``--embedded`` starts a verifier process (``edgespec-verifier``)
on a free loopback port for the run, so the device side never imports the cloud side.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from importlib.metadata import version
from pathlib import Path

from shared.paths import default_draft_dir

PROTOCOL_HELP = ("rounds: a Verify round trip per round of drafts; lookahead: the verifier "
                 "decodes back to back while the device streams drafts ahead (no round trip "
                 "in the loop); cloud: the target decodes every token (no drafts)")


def add_generation_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--draft-len", type=int, default=4, help="K, drafts per round")
    p.add_argument("--stop-confidence", type=float, default=0.1, metavar="C",
                   help="stop a round's drafting once the drafts' joint confidence is below "
                        "C (default 0.1; 0: always draft --draft-len)")
    p.add_argument("--draft-dir", type=Path, default=None,
                   help=f"ONNX draft model directory (default: {default_draft_dir()})")
    p.add_argument("--drafter", choices=["combined", "model", "ngram", "feature"],
                   default="combined",
                   help="who drafts: per position a copy where the text repeats two or more "
                        "earlier tokens and the ONNX model elsewhere (combined, the default), "
                        "the model alone, prompt lookup (n-gram) alone, or a feature head fed "
                        "the verifier's target features (needs --feature-head)")
    p.add_argument("--feature-head", type=Path, default=None, metavar="DIR",
                   help="feature head directory (edgespec-distill export-head) for "
                        "--drafter feature; it must have been trained on the verifier's target")
    p.add_argument("--protocol", choices=["rounds", "lookahead", "cloud"], default="rounds",
                   help=PROTOCOL_HELP)
    p.add_argument("--fallback", choices=["fail", "draft-only"], default="fail",
                   help="when the verifier is unreachable or too slow: fail (retry, then give "
                        "up), or go on with the draft alone, its tokens marked unverified and "
                        "verified when the verifier is back (rounds protocol)")
    p.add_argument("--budget-ms", type=float, default=None,
                   help="latency budget: end with the tokens verified by then, plus the "
                        "draft's unverified continuation")


def add_server_args(p: argparse.ArgumentParser) -> None:
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--server", metavar="HOST:PORT", help="a running verifier")
    where.add_argument("--embedded", action="store_true",
                       help="start a local verifier process on a free loopback port for this "
                            "run (needs the cloud extra)")
    p.add_argument("--model", default=None,
                   help="with --embedded: the target checkpoint (default: prepared SmolLM2)")
    p.add_argument("--api-key", default=os.environ.get("EDGESPEC_API_KEY"),
                   help="bearer key for an authenticated verifier (env EDGESPEC_API_KEY)")
    p.add_argument("--tls-ca", type=Path, default=None,
                   help="PEM CA bundle that signed the verifier's certificate: use TLS "
                        "(plaintext is for loopback addresses, or --insecure)")
    p.add_argument("--tls-cert", type=Path, default=None,
                   help="this device's PEM certificate, for a verifier that asks (mTLS)")
    p.add_argument("--tls-key", type=Path, default=None, help="PEM private key of --tls-cert")
    p.add_argument("--insecure", action="store_true",
                   help="allow a plaintext channel to a non-loopback verifier")
    p.add_argument("--rtt-ms", type=float, default=0.0,
                   help="inject this round-trip time into every message (network emulation)")
    p.add_argument("--retry-budget-s", type=float, default=60.0,
                   help="give up after this long without a new token (verifier down, "
                        "overloaded); retries back off with jitter as the server asks")


@contextlib.contextmanager
def verifier_address(args: argparse.Namespace):
    if args.embedded:
        from edge_client.local_verifier import VerifierStartError, local_verifier

        try:
            with local_verifier(args.model) as address:
                yield address
        except VerifierStartError as err:
            raise SystemExit(f"edge-client: --embedded: {err}") from err
    else:
        yield args.server


def cmd_generate(args: argparse.Namespace) -> int:
    from edge_client.client import EdgeClient, GenerationConfig
    from edge_client.connection import ClientTls, RetryPolicy
    from edge_client.live_text import LiveText
    from edge_client.offline_start import offline_wait_s

    config = GenerationConfig(
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
        top_p=args.top_p, seed=args.seed, draft_len=args.draft_len, drafter=args.drafter,
        stop_confidence=args.stop_confidence,
        fallback=args.fallback, budget_ms=args.budget_ms)
    # With --json -, stdout carries only the JSON object; the text streams to stderr.
    out = sys.stderr if args.json == "-" else sys.stdout
    if (args.tls_cert is None) != (args.tls_key is None):
        raise SystemExit("edge-client: --tls-cert and --tls-key go together")
    if (args.drafter == "feature") != (args.feature_head is not None):
        raise SystemExit("edge-client: --drafter feature and --feature-head DIR go together "
                         "(no trained head is shipped yet)")
    tls = (ClientTls(args.tls_ca, args.tls_cert, args.tls_key)
           if args.tls_ca or args.tls_cert else None)
    with verifier_address(args) as address, EdgeClient(
            address, args.draft_dir, api_key=args.api_key, tls=tls, insecure=args.insecure,
            rtt_ms=args.rtt_ms, protocol=args.protocol, fallback=args.fallback,
            retry=RetryPolicy(budget_s=args.retry_budget_s),
            feature_head=args.feature_head,
            offline_after_s=offline_wait_s(args.budget_ms)) as client:
        generation = client.generate(args.prompt, config, chat=not args.raw)
        chunks = []
        live = LiveText(client.tokenizer, out)  # unverified text shows at once, marked
        for chunk in generation.chunks():
            chunks.append({"token_ids": chunk.token_ids, "verified": chunk.verified,
                           "replaces": chunk.replaces})
            live.push(chunk.token_ids, chunk.verified, chunk.replaces)
        live.finish()
        stats = generation.stats.to_dict()
        if args.json:
            report = {"text": client.tokenizer.decode(generation.token_ids),
                      "token_ids": generation.token_ids,
                      "unverified_text": client.tokenizer.decode(generation.unverified_ids),
                      "unverified_token_ids": generation.unverified_ids,
                      "chunks": chunks, "stats": stats}
            if args.json == "-":
                json.dump(report, sys.stdout)
                sys.stdout.write("\n")
            else:
                Path(args.json).parent.mkdir(parents=True, exist_ok=True)
                Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        print(f"[{stats['new_tokens']} tokens in {stats['wall_s']:.2f} s, "
              f"{stats['tokens_per_s']:.1f} tok/s; acceptance {stats['acceptance_rate']:.2f}, "
              f"{stats['tokens_per_round']:.2f} tokens/round, {stats['round_trips']} round "
              f"trips, {stats['target_forwards']} target forwards, {stats['reopens']} "
              "reopens]", file=sys.stderr)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from edge_client.chat import cmd_chat as run

    return run(args)


def cmd_bench_ime(args: argparse.Namespace) -> int:
    """``edge-client bench-ime ARGS`` runs ``edgespec-bench ime ARGS``: the benchmark lives
    with the others (edge_client.bench, the bench extra) and is imported only here."""
    try:
        from edge_client.bench.cli import main as bench_main
    except ImportError as err:
        raise SystemExit(f"edge-client bench-ime: needs the benchmarks (pip install "
                         f"'edgespec[bench]'): {err}") from None
    return bench_main(["--log-level", args.log_level, "ime", *args.bench_args])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="edge-client", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"edgespec {version('edgespec')}")
    parser.add_argument("--log-level", default="WARNING")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text through a verifier")
    add_server_args(gen)
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--raw", action="store_true",
                     help="send the prompt as raw text, without the chat template")
    gen.add_argument("--json", metavar="PATH", default=None,
                     help="write one JSON object with text, token_ids and stats to PATH "
                          "('-': stdout, the text then streams to stderr)")
    add_generation_args(gen)
    gen.set_defaults(func=cmd_generate)
    chat = sub.add_parser("chat", help="an interactive multi-turn chat through a verifier")
    add_server_args(chat)
    add_generation_args(chat)
    chat.set_defaults(func=cmd_chat)
    from edge_client.chat import add_chat_args
    add_chat_args(chat)
    # Its arguments are edgespec-bench ime's, parsed there (main passes them through).
    bench = sub.add_parser("bench-ime", add_help=False,
                           help="the typing benchmark: edgespec-bench ime (same arguments; "
                                "needs the bench extra)")
    bench.set_defaults(func=cmd_bench_ime)
    from edge_client.serve.runner import add_serve_args, cmd_serve

    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP API and a keyboard demo "
                                         "page on this device (needs the serve extra)")
    add_server_args(serve)
    add_serve_args(serve)
    serve.set_defaults(func=cmd_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    from edge_client.errors import run_command

    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.command != "bench-ime" and rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    args.bench_args = rest
    return run_command("edge-client", args)


if __name__ == "__main__":
    raise SystemExit(main())
