"""The arguments and the verifier address that ``edge-client``'s subcommands share.

Its own module so that the subcommands (generate, chat, serve) import it and not each other.
"""

from __future__ import annotations

import argparse
import contextlib
import os
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
