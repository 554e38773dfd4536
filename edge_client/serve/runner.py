"""Running the HTTP server: ``edge-client serve`` (binding rules, uvicorn), and
``ServerThread``, the same app on a free loopback port in a background thread (tests and
benchmarks).

Binding follows the project's plaintext rule (as the verifier's ``check_plaintext``): plain
HTTP only on a loopback address; elsewhere HTTPS (``--https-cert``/``--https-key``), or
``--http-insecure`` when a proxy on this host terminates TLS. Off loopback a bearer key
(``--http-api-key``) is required too: the API spends the device's verifier quota.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import logging
import os
import re
import threading
from pathlib import Path

from edge_client.connection import is_loopback_address
from edge_client.errors import EdgeError
from edge_client.serve.requests import ApiError

log = logging.getLogger(__name__)


class BindRefused(EdgeError, ValueError):
    """An address other machines can reach, without TLS or without a key."""


def check_bind(host: str, https: bool, insecure: bool, api_key: str | None) -> None:
    if is_loopback_address(host):
        return
    if not https and not insecure:
        raise BindRefused(
            f"refusing to serve plain HTTP on {host!r}, which other machines can reach: "
            "prompts and answers would travel in the clear. Give --https-cert and "
            "--https-key, bind 127.0.0.1, or pass --http-insecure if a proxy on this host "
            "terminates TLS")
    if not api_key:
        raise BindRefused(f"serving on {host!r} needs --http-api-key (or env "
                          "EDGESPEC_SERVE_API_KEY): anyone who can reach it spends this "
                          "device's verifier quota")


# A browser cannot set headers on a WebSocket, so the keyboard page sends its key as one of
# the subprotocols it offers: ``edgespec.bearer.<key>`` (never echoed back by the server).
BEARER_SUBPROTOCOL = "edgespec.bearer."
# RFC 6455 subprotocols are RFC 7230 tokens: a key with other characters could not travel.
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")


def check_api_key(api_key: str | None) -> None:
    if api_key is not None and not _TOKEN.fullmatch(api_key):
        raise BindRefused("--http-api-key may hold only letters, digits and !#$%&'*+-.^_`|~ "
                          "(the keyboard page sends it as a WebSocket subprotocol token)")


def _presented_key_ok(scope, expected: bytes) -> bool:
    """The Authorization header, or for a WebSocket the bearer subprotocol entry."""
    headers = dict(scope.get("headers") or ())
    if hmac.compare_digest(headers.get(b"authorization", b""), b"Bearer " + expected):
        return True
    # uvicorn parses every Sec-WebSocket-Protocol header into this list.
    offered = [entry.encode() for entry in scope.get("subprotocols") or ()]
    prefix = BEARER_SUBPROTOCOL.encode()
    # Every entry is compared, so the time taken does not say which one was the key.
    return sum(hmac.compare_digest(entry, prefix + expected) for entry in offered) > 0


async def _refuse_socket(scope, receive, send) -> None:
    """Accept, then close with 1008 (policy violation) and a reason. A close before the
    accept would answer the upgrade with HTTP 403, which a page sees as code 1006, the same
    as an unreachable server; 1008 lets the keyboard page say that the key is missing."""
    from edge_client.serve.keyboard import chosen_subprotocol

    if (await receive())["type"] != "websocket.connect":
        return
    await send({"type": "websocket.accept", "subprotocol": chosen_subprotocol(scope)})
    await send({"type": "websocket.close", "code": 1008,
                "reason": "a valid API key is required"})


def require_key(app, api_key: str | None):
    """ASGI middleware: the key on every HTTP request and WebSocket but the page at /."""
    if not api_key:
        return app
    from starlette.responses import JSONResponse

    check_api_key(api_key)
    expected = api_key.encode()

    async def guarded(scope, receive, send):
        if scope["type"] in ("http", "websocket") and scope.get("path", "/") != "/":
            if not _presented_key_ok(scope, expected):
                if scope["type"] == "websocket":
                    await _refuse_socket(scope, receive, send)
                    return
                err = ApiError(401, "a valid API key is required (Authorization: Bearer)",
                               code="invalid_api_key")
                await JSONResponse(err.body(), status_code=401)(scope, receive, send)
                return
        await app(scope, receive, send)

    return guarded


def build_app(address: str, draft_dir, client_options: dict, serve_options):
    """The whole app: the OpenAI API and the keyboard demo over one client."""
    from edge_client.client import AsyncEdgeClient
    from edge_client.serve import keyboard, openai_api

    return openai_api.create_app(
        lambda: AsyncEdgeClient(address, draft_dir, **client_options), serve_options,
        extra_routes=keyboard.ROUTES)


class ServerThread:
    """The app under uvicorn on 127.0.0.1 and a free port, in a thread with its own loop::

        with ServerThread(app) as server:
            openai.OpenAI(base_url=server.base_url + "/v1", api_key="-")
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0,
                 ssl_certfile: Path | None = None, ssl_keyfile: Path | None = None) -> None:
        import uvicorn

        self.app = app
        self.scheme = "https" if ssl_certfile else "http"
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port,
                                                    log_level="warning", lifespan="on",
                                                    ws="websockets-sansio",
                                                    ssl_certfile=ssl_certfile,
                                                    ssl_keyfile=ssl_keyfile))
        self._thread = threading.Thread(target=self._run, name="edge-serve", daemon=True)
        self._error: BaseException | None = None

    def _run(self) -> None:
        try:
            asyncio.run(self.server.serve())
        except BaseException as err:  # noqa: BLE001 - reported by __enter__
            self._error = err

    @property
    def base_url(self) -> str:
        host, port = self.server.servers[0].sockets[0].getsockname()[:2]
        return f"{self.scheme}://{host}:{port}"

    def __enter__(self) -> ServerThread:
        self._thread.start()
        while not self.server.started:
            if not self._thread.is_alive():
                raise RuntimeError(f"the HTTP server did not start: {self._error!r}")
            self._thread.join(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=30)


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1; any other needs HTTPS "
                        "or --http-insecure, and --http-api-key)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--https-cert", type=Path, default=None, help="PEM certificate: HTTPS")
    p.add_argument("--https-key", type=Path, default=None, help="PEM key of --https-cert")
    p.add_argument("--http-insecure", action="store_true",
                   help="allow plain HTTP off loopback (a TLS proxy on this host)")
    p.add_argument("--http-api-key", default=os.environ.get("EDGESPEC_SERVE_API_KEY"),
                   help="bearer key HTTP clients must send (env EDGESPEC_SERVE_API_KEY)")
    p.add_argument("--served-model-name", default=None,
                   help="the model id of /v1/models (default: the verifier's target)")
    # How the device drafts: its choice, not the HTTP client's.
    p.add_argument("--draft-dir", type=Path, default=None, help="ONNX draft model directory")
    p.add_argument("--draft-len", type=int, default=4, help="K, drafts per round")
    p.add_argument("--drafter", choices=["combined", "model", "ngram"], default="combined")
    p.add_argument("--stop-confidence", type=float, default=0.1, metavar="C")
    p.add_argument("--protocol", choices=["rounds", "lookahead", "cloud"], default="rounds")


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        import uvicorn
    except ImportError as err:
        raise SystemExit(f"edge-client serve: needs the serve extra (pip install "
                         f"'edgespec[edge,serve]'): {err}") from None
    from edge_client.cli_args import verifier_address
    from edge_client.connection import ClientTls, RetryPolicy
    from edge_client.serve.openai_api import ServeOptions

    if (args.https_cert is None) != (args.https_key is None):
        raise SystemExit("edge-client serve: --https-cert and --https-key go together")
    if (args.tls_cert is None) != (args.tls_key is None):
        raise SystemExit("edge-client: --tls-cert and --tls-key go together")
    if not 0 <= args.port < 65536:
        raise SystemExit(f"edge-client serve: --port must be in [0, 65535], got {args.port}")
    check_bind(args.host, args.https_cert is not None, args.http_insecure, args.http_api_key)
    check_api_key(args.http_api_key)
    tls = (ClientTls(args.tls_ca, args.tls_cert, args.tls_key)
           if args.tls_ca or args.tls_cert else None)
    options = ServeOptions(model_id=args.served_model_name, draft_len=args.draft_len,
                           drafter=args.drafter, stop_confidence=args.stop_confidence)
    with verifier_address(args) as address:
        app = build_app(address, args.draft_dir, dict(
            api_key=args.api_key, tls=tls, insecure=args.insecure, rtt_ms=args.rtt_ms,
            protocol=args.protocol, retry=RetryPolicy(budget_s=args.retry_budget_s)), options)
        log.warning("serving the OpenAI API on %s://%s:%d/v1 (verifier %s)",
                    "https" if args.https_cert else "http", args.host, args.port, address)
        uvicorn.run(require_key(app, args.http_api_key), host=args.host, port=args.port,
                    log_level=args.log_level.lower(), ws="websockets-sansio",
                    ssl_certfile=args.https_cert, ssl_keyfile=args.https_key)
    return 0
