"""The verifier process: gRPC server with health and reflection, graceful drain, CLI.

Drain (SIGTERM, ``VerifierServer.drain``): health turns NOT_SERVING at once and stays
observable on the open port for at least ``drain_s``; new sessions get UNAVAILABLE
(DRAINING), while running sessions go on, Verify rounds included. Generations get up to
``grace_s`` from the signal to finish; those still running then end with DRAINING (and
RetryInfo), so their clients reopen on another replica with their committed context.
SIGHUP re-reads the API key file and the certificates (docs/security.md); the API port
serves TLS, or plaintext on loopback only unless ``--insecure`` (cloud_verifier.tls).

Message size limits come from the protocol's caps (shared.message_limits), not a round
number: a request past the largest valid one is refused by gRPC before it is parsed.

Modules that import torch are imported where they are used, so that ``edgespec-verifier
--help`` and ``--version`` answer at once on a machine where importing torch takes seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import logging
import os
import signal
import threading
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from cloud_verifier import torch_thread
from cloud_verifier.auth import ENV_VAR, KeyFileError, KeyRing, default_tenant, parse_env
from cloud_verifier.config import VerifierConfig
from cloud_verifier.draft_policy import DEFAULT_SESSION_COST, DEFAULT_TOKEN_COST
from cloud_verifier.interceptors import SERVICE_NAME, interceptors
from cloud_verifier.metrics import VerifierMetrics
from cloud_verifier.quotas import Quota
from cloud_verifier.tls import (
    PlaintextRefused,
    ReloadableCredentials,
    ServerTls,
    check_plaintext,
    is_loopback,
)
from cloud_verifier.undecodable import UndecodableInterceptor
from shared.feature_codec import DEFAULT_CODEC, codec_named
from shared.message_limits import max_reply_bytes, max_request_bytes
from shared.pb import verifier_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from cloud_verifier.target_engine import TargetEngine
    from cloud_verifier.target_model import LoadedTarget

log = logging.getLogger(__name__)
# Health and reflection replies (file descriptors) share the send limit with the service.
MIN_SEND_BYTES = 1024 * 1024
# Streams still running after an evacuation get this long to end before the server stops.
EVACUATE_S = 2.0


def load_served_target(path: str | Path | None = None, device: str | None = None,
                       dtype: str | None = None) -> LoadedTarget:
    """``load_target`` on the thread the verifier's forwards run on (``torch_thread``)."""
    from cloud_verifier.target_model import load_target

    return torch_thread.run(load_target, path, device=device, dtype=dtype)


def builtin_engine(target: LoadedTarget, config: VerifierConfig, max_context: int
                   ) -> TargetEngine:
    """This project's engine on the loaded torch target."""
    from cloud_verifier.engine import VerifierEngine
    from cloud_verifier.features import feature_serving
    from cloud_verifier.packed_forward import packed_weights, supports_packing

    packed = supports_packing(target.model)
    if packed:  # now, not in the first client's forward
        torch_thread.run(packed_weights, target.model)
    # The weights fingerprint once, here: GetInfo only repeats it.
    features = torch_thread.run(feature_serving, target.model, config.feature_codec,
                                packed) if config.serve_features else None
    return VerifierEngine(target.model, target.vocab_size, max_context,
                          config.kv_budget_bytes, features=features, spelling=target.spelling)


class VerifierServer:
    """A running verifier bound to one loaded target."""

    def __init__(self, target: LoadedTarget, config: VerifierConfig,
                 engine: TargetEngine | None = None) -> None:
        """``engine``: the target's engine (``cloud_verifier.vllm_engine``); None builds the
        built-in one on ``target.model``."""
        from cloud_verifier.service import ModelInfo, VerifierService

        max_context = min(config.max_context or target.max_context, target.max_context)
        check_plaintext(config.host, config.tls, config.insecure)  # before the model work
        self.config = config
        self.keys = KeyRing({**{d: default_tenant(d) for d in config.api_key_digests},
                             **dict(config.api_keys)}, config.api_keys_file)
        self.metrics = VerifierMetrics()
        self.service = VerifierService(
            engine or builtin_engine(target, config, max_context), config,
            ModelInfo(target.name, target.vocab_size, target.tokenizer_fingerprint,
                      tuple(target.eos_token_ids)),
            self.metrics)
        self.health = health.aio.HealthServicer()
        self._server: grpc.aio.Server | None = None
        self._tasks: list[asyncio.Task] = []
        self.port: int | None = None
        self.metrics_port: int | None = None
        self._certificates: ReloadableCredentials | None = None

    def grpc_options(self) -> list[tuple[str, int]]:
        """Message size limits from the caps, and keepalive both ways."""
        c = self.config
        return [
            ("grpc.max_receive_message_length", max_request_bytes(self.service.limits.caps())),
            ("grpc.max_send_message_length", max(max_reply_bytes(c.max_draft_len),
                                                 MIN_SEND_BYTES)),
            # Ping a quiet client to notice a dead one (and free its sessions).
            ("grpc.keepalive_time_ms", int(c.keepalive_s * 1000)),
            ("grpc.keepalive_timeout_ms", int(min(20.0, c.keepalive_s) * 1000)),
            ("grpc.http2.max_pings_without_data", 0),
            # Clients ping every 10 s (edge_client.connection), on quiet streams too: gRPC's
            # default (one ping per 5 min without data) would answer them with GOAWAY
            # too_many_pings, cutting every session on the connection. Faster pingers still
            # get it after gRPC's default two strikes.
            ("grpc.http2.min_ping_interval_without_data_ms", int(c.min_client_ping_s * 1000)),
            ("grpc.keepalive_permit_without_calls", 1),
        ]

    async def start(self) -> int:
        server = grpc.aio.server(
            interceptors=[*interceptors(self.keys, self.metrics),
                          UndecodableInterceptor(self.metrics)],
            options=self.grpc_options())
        pb_grpc.add_VerifierServiceServicer_to_server(self.service, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
        address = f"{self.config.host}:{self.config.port}"
        tls = self.config.tls
        if tls is None:
            self.port = server.add_insecure_port(address)
        else:
            self._certificates = ReloadableCredentials(tls)
            self.port = server.add_secure_port(address, self._certificates.credentials)
        if self.port == 0:
            raise OSError(f"could not bind {address}")
        await server.start()
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        if self.config.metrics_port is not None:
            self.metrics_port = self.metrics.serve_http(self.config.metrics_port,
                                                        self.config.metrics_host)
        if not self.keys.enabled and not is_loopback(self.config.host):
            log.warning("serving on %s without API keys: anyone who reaches the port may "
                        "use the verifier (--api-keys-file, %s)", self.config.host, ENV_VAR)
        self._tasks = [
            asyncio.ensure_future(self.service.batcher.run_forever()),
            asyncio.ensure_future(
                self.service.expire_forever(min(30.0, self.config.session_ttl_s / 4))),
        ]
        self._server = server
        log.info("verifier serving %s on %s:%d (%s%s)", self.service.info.name,
                 self.config.host, self.port,
                 "plaintext" if tls is None else "mTLS" if tls.client_ca else "TLS",
                 ", API keys" if self.keys.enabled else ", no authentication")
        return self.port

    def reload(self) -> bool:
        """SIGHUP: re-reads the API key file (streams of removed keys end at their next reply,
        other sessions are untouched) and the TLS files (for new connections). What fails to
        load is kept as it was and logged; returns whether everything reloaded."""
        keys = self.keys.reload() if self.config.api_keys_file is not None else True
        certificates = True if self._certificates is None else self._certificates.reload()
        return keys and certificates

    async def _set_health(self, status) -> None:
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)

    async def begin_drain(self) -> None:
        """Stop taking new sessions and tell health checkers; running sessions go on."""
        self.service.draining = True
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)

    async def drain(self) -> None:
        """SIGTERM: the drain of the module docstring, then stop."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        await self.begin_drain()
        log.info("draining: NOT_SERVING; %d streams running", self.service.streams.count)
        finished = await self.service.streams.wait_none(self.config.grace_s)
        if not finished:
            log.info("drain: %d streams still running after %g s; telling them to reopen "
                     "elsewhere", self.service.streams.count, self.config.grace_s)
            self.service.streams.evacuate()
            await self.service.streams.wait_none(EVACUATE_S)
        # Health stays observable for drain_s, however soon the streams ended.
        await asyncio.sleep(max(0.0, started + self.config.drain_s - loop.time()))
        await self.stop(0)

    async def stop(self, grace_s: float | None = None) -> None:
        await self.begin_drain()
        if self._server is not None:
            await self._server.stop(self.config.grace_s if grace_s is None else grace_s)
        await self.service.finish_background()
        self.metrics.stop_http()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        log.info("verifier stopped")

    async def wait(self) -> None:
        assert self._server is not None
        await self._server.wait_for_termination()


class EmbeddedVerifier:
    """A verifier on a loopback port, in a background thread with its own event loop.

    Used by ``edge-client generate --embedded`` and by tests::

        with EmbeddedVerifier(target) as verifier:
            client = EdgeClient(verifier.address, ...)
    """

    def __init__(self, target: LoadedTarget, config: VerifierConfig | None = None,
                 engine: TargetEngine | None = None) -> None:
        self.server = VerifierServer(target, config or VerifierConfig(port=0), engine)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="verifier",
                                        daemon=True)

    @property
    def address(self) -> str:
        return f"{self.server.config.host}:{self.server.port}"

    def call(self, coro):
        """Runs a coroutine on the server's loop and waits for it."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def __enter__(self) -> EmbeddedVerifier:
        self._thread.start()
        self.call(self.server.start())
        return self

    def __exit__(self, *exc) -> None:
        self.call(self.server.stop(0.5))
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, VerifierConfig]:
    p = argparse.ArgumentParser(prog="edgespec-verifier",
                                description="Cloud verifier for edge speculative decoding.")
    p.add_argument("--version", action="version", version=f"edgespec {_version()}")
    p.add_argument("--model", default=None,
                   help="local Hugging Face causal-LM checkpoint (default: SmolLM2-135M-Instruct "
                        "prepared by edgespec-prepare)")
    p.add_argument("--engine", choices=["builtin", "vllm"], default="builtin",
                   help="what runs the target: this project's engine (default) or vLLM "
                        "(the vllm extra; docs/vllm-engine.md)")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="--engine vllm: GPUs the target is split over")
    p.add_argument("--vllm-block-size", type=int, default=None,
                   help="--engine vllm: prefix-cache block size (default: 32 on CPUs, where "
                        "vLLM's own is 128; vLLM's on GPUs); a round prefills at most K + 1 "
                        "+ one block")
    p.add_argument("--vllm-kv-cache-gb", type=float, default=None,
                   help="--engine vllm on CPUs: GiB of KV cache (VLLM_CPU_KVCACHE_SPACE)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="--engine vllm on GPUs: share of GPU memory vLLM may take")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: auto)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads for the target (default: torch's, one per core)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="default: bfloat16 on cuda when supported, float32 on cpu")
    p.add_argument("--host", default="127.0.0.1",
                   help="address of the API port; other than loopback it needs TLS "
                        "(--tls-cert, --tls-key) or --insecure")
    p.add_argument("--port", type=int, default=50051)
    p.add_argument("--tls-cert", type=Path, default=None,
                   help="PEM certificate chain of the API port (with --tls-key)")
    p.add_argument("--tls-key", type=Path, default=None, help="PEM private key of --tls-cert")
    p.add_argument("--tls-client-ca", type=Path, default=None,
                   help="PEM CA bundle: clients must present a certificate it signed (mTLS)")
    p.add_argument("--insecure", action="store_true",
                   help="allow plaintext on a non-loopback --host (e.g. behind a proxy on this "
                        "host that terminates TLS): API keys and prompts travel in the clear")
    p.add_argument("--max-draft-len", type=int, default=16)
    p.add_argument("--max-context", type=int, default=None)
    p.add_argument("--max-sessions", type=int, default=64)
    p.add_argument("--max-batch-tokens", type=int, default=512,
                   help="new tokens per batched forward across sessions")
    p.add_argument("--gather-window-ms", type=float, default=0.0,
                   help="wait this long for more rounds before a forward")
    p.add_argument("--max-queued-rounds", type=int, default=256,
                   help="rounds waiting for the model beyond which RESOURCE_EXHAUSTED is sent")
    p.add_argument("--verify-token-cost", type=float, default=DEFAULT_TOKEN_COST,
                   help="cost of a verified token relative to a forward's fixed cost, for the "
                        "suggested draft length (python -m cloud_verifier.bench.verify_cost); "
                        "the prior of the online fit unless --fixed-verify-cost")
    p.add_argument("--verify-session-cost", type=float, default=DEFAULT_SESSION_COST,
                   help="cost of one more session in a forward, relative to its fixed cost")
    p.add_argument("--fixed-verify-cost", action="store_true",
                   help="use the two costs above as they are, without fitting them online to "
                        "the server's own forwards")
    p.add_argument("--kv-budget-mb", type=float, default=None,
                   help="bytes of target KV cache all sessions may hold (default: unbounded)")
    p.add_argument("--kv-wait", type=float, default=10.0,
                   help="seconds a round may wait for KV memory that older sessions hold "
                        "before it gets RESOURCE_EXHAUSTED")
    p.add_argument("--prefix-cache-mb", type=float, default=256.0,
                   help="KV cache of closed sessions kept for new prompts that start with the "
                        "same tokens (per API key; counted in --kv-budget-mb and freed first "
                        "under memory pressure); 0 disables prefix caching")
    p.add_argument("--session-ttl", type=float, default=300.0, help="idle seconds")
    p.add_argument("--grace", type=float, default=25.0,
                   help="seconds running generations get to finish after SIGTERM; the rest "
                        "are then told to reopen elsewhere (DRAINING)")
    p.add_argument("--drain-notice", type=float, default=5.0,
                   help="seconds health reports NOT_SERVING, port open, after SIGTERM "
                        "before the server stops (at least)")
    p.add_argument("--max-q-support", type=int, default=256,
                   help="entries of one draft position's q accepted (GetInfo max_q_support)")
    p.add_argument("--open-timeout", type=float, default=10.0,
                   help="seconds a Session stream may take to send its open")
    p.add_argument("--stalled-reader", type=float, default=60.0,
                   help="seconds a reply may sit unread before its stream is closed")
    p.add_argument("--keepalive", type=float, default=60.0,
                   help="seconds between the server's pings of a quiet client")
    p.add_argument("--min-client-ping", type=float, default=5.0,
                   help="shortest interval between client pings the server tolerates")
    p.add_argument("--api-keys-file", type=Path, default=None,
                   help="file of API keys, one 'KEY [TENANT]' a line, re-read on SIGHUP; "
                        f"enables authentication (so does {ENV_VAR}; see docs/security.md)")
    p.add_argument("--quota-sessions", type=int, default=None,
                   help="open sessions one tenant may hold (default: no limit but "
                        "--max-sessions, shared fairly when full)")
    p.add_argument("--quota-queued-rounds", type=int, default=None,
                   help="rounds one tenant may have waiting for the model (default: no "
                        "limit but --max-queued-rounds)")
    p.add_argument("--quota-tokens-per-s", type=float, default=None,
                   help="target tokens a second one tenant may use: prompt tokens not in the "
                        "prefix cache, draft tokens, one per step (default: no limit)")
    p.add_argument("--quota-token-burst", type=float, default=None,
                   help="tokens a tenant may use at once before --quota-tokens-per-s paces "
                        "it (default: one second's worth)")
    p.add_argument("--max-new-tokens-cap", type=int, default=2048,
                   help="most new tokens of one session: what max_new_tokens = 0 means, and "
                        "the most a client may ask for; 0: only the context limits it")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="Prometheus HTTP port (no authentication)")
    p.add_argument("--metrics-host", default="127.0.0.1",
                   help="address of the metrics port (default loopback: a scraper on this "
                        "host or pod)")
    p.add_argument("--no-features", dest="features", action="store_false",
                   help="send no target features (GetInfo advertises none; opens that ask "
                        "for them get INVALID_ARGUMENT FEATURES_UNAVAILABLE)")
    p.add_argument("--feature-codec", default=DEFAULT_CODEC,
                   help="wire form of the target features: fp16 (default) or int8-g<G> "
                        "(shared.feature_codec; a feature head reads only the one it was "
                        "trained on)")
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    if args.verify_token_cost < 0 or args.verify_session_cost < 0:
        p.error("--verify-token-cost and --verify-session-cost must be >= 0")
    if args.kv_wait < 0:
        p.error("--kv-wait must be >= 0")
    if args.prefix_cache_mb < 0:
        p.error("--prefix-cache-mb must be >= 0")
    if args.threads is not None and args.threads < 1:
        p.error("--threads must be >= 1")
    if args.tensor_parallel_size < 1:
        p.error("--tensor-parallel-size must be >= 1")
    if args.engine == "vllm" and args.kv_budget_mb is not None:
        p.error("--kv-budget-mb is the built-in engine's; vLLM sizes its own KV cache "
                "(--vllm-kv-cache-gb, --gpu-memory-utilization)")
    for flag in ("grace", "drain_notice", "open_timeout", "stalled_reader", "keepalive",
                 "min_client_ping"):
        if not getattr(args, flag) > 0:
            p.error(f"--{flag.replace('_', '-')} must be > 0")
    if args.max_q_support < 1:
        p.error("--max-q-support must be >= 1")
    if (args.tls_cert is None) != (args.tls_key is None):
        p.error("--tls-cert and --tls-key go together")
    if args.tls_client_ca is not None and args.tls_cert is None:
        p.error("--tls-client-ca needs --tls-cert and --tls-key")
    if args.max_new_tokens_cap < 0:
        p.error("--max-new-tokens-cap must be >= 0")
    try:
        codec_named(args.feature_codec)
    except ValueError as err:
        p.error(str(err))
    tls = None if args.tls_cert is None else ServerTls(args.tls_cert, args.tls_key,
                                                       args.tls_client_ca)
    try:
        check_plaintext(args.host, tls, args.insecure)
        env_keys = parse_env(os.environ.get(ENV_VAR, ""))
        if args.api_keys_file is not None:
            KeyRing(path=args.api_keys_file)  # fail now, with the reason
        quota = Quota(sessions=args.quota_sessions, queued_rounds=args.quota_queued_rounds,
                      tokens_per_s=args.quota_tokens_per_s,
                      token_burst=args.quota_token_burst)
        if tls is not None:
            tls.certificate_configuration()
    except (PlaintextRefused, KeyFileError, ValueError) as err:
        p.error(str(err))
    config = VerifierConfig(
        host=args.host, port=args.port, max_draft_len=args.max_draft_len,
        max_context=args.max_context, max_sessions=args.max_sessions,
        max_batch_tokens=args.max_batch_tokens, gather_window_s=args.gather_window_ms / 1000,
        max_queued_rounds=args.max_queued_rounds, verify_token_cost=args.verify_token_cost,
        verify_session_cost=args.verify_session_cost, fit_verify_cost=not args.fixed_verify_cost,
        kv_budget_bytes=None if args.kv_budget_mb is None else int(args.kv_budget_mb * 2**20),
        kv_wait_s=args.kv_wait, prefix_cache_bytes=int(args.prefix_cache_mb * 2**20),
        session_ttl_s=args.session_ttl, grace_s=args.grace, drain_s=args.drain_notice,
        max_q_support=args.max_q_support, open_timeout_s=args.open_timeout,
        stalled_reader_s=args.stalled_reader, keepalive_s=args.keepalive,
        min_client_ping_s=args.min_client_ping,
        api_keys=tuple(env_keys.items()), api_keys_file=args.api_keys_file, tls=tls,
        insecure=args.insecure, quota=quota, max_new_tokens_cap=args.max_new_tokens_cap or None,
        metrics_port=args.metrics_port, metrics_host=args.metrics_host,
        serve_features=args.features, feature_codec=args.feature_codec)
    return args, config


def _version() -> str:
    try:
        return importlib.metadata.version("edgespec")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout, not installed
        return "unknown"


async def _serve(server: VerifierServer) -> None:
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGHUP, server.reload)  # before health says SERVING
    await server.start()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("signal received: draining")
    await server.drain()


def main(argv: list[str] | None = None) -> int:
    args, config = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.threads:
        import torch

        torch_thread.run(torch.set_num_threads, args.threads)
    if args.engine == "vllm":
        from cloud_verifier.vllm_engine import VllmSettings, load_vllm_engine

        target, engine = load_vllm_engine(args.model, config.max_context, VllmSettings(
            dtype=args.dtype or "float32", tensor_parallel_size=args.tensor_parallel_size,
            block_size=args.vllm_block_size, kv_cache_gb=args.vllm_kv_cache_gb,
            gpu_memory_utilization=args.gpu_memory_utilization, threads=args.threads))
    else:
        target = load_served_target(args.model, device=args.device, dtype=args.dtype)
        engine = None
    asyncio.run(_serve(VerifierServer(target, config, engine)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
