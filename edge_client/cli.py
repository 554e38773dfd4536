"""``edge-client``: generate text with the on-device draft and a cloud verifier.

The benchmarks and the load test are ``edgespec-bench`` (edge_client.bench); this command
is the device runtime alone. ``--embedded`` starts a verifier process (``edgespec-verifier``)
on a free loopback port for the run, so the device side never imports the cloud side.
"""

from __future__ import annotations

import argparse
import json
import sys
from importlib.metadata import version
from pathlib import Path

from edge_client.cli_args import add_generation_args, add_server_args, verifier_address


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
        print(f"[{generation.stats.describe()}]", file=sys.stderr)
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
