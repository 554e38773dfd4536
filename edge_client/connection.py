"""One device's connection to a verifier: the channel, the metadata every call carries, the
deadlines, and the retry discipline (what is retried, how long to wait, when to give up).

What is retried is read from the status's machine-readable details (shared.errors), never
from its text:

- an eviction, a TTL expiry or an idle stream (SESSION_EVICTED, SESSION_EXPIRED,
  STREAM_IDLE, or any status with the reopen hint in its ErrorInfo): reopen with the
  committed context at once;
- overload or drain (RESOURCE_EXHAUSTED / UNAVAILABLE with RetryInfo): wait the server's
  delay, doubled per attempt without progress, with "equal jitter", then reopen;
- a lost connection or stream (UNAVAILABLE, DEADLINE_EXCEEDED, CANCELLED, INTERNAL or UNKNOWN
  with no ErrorInfo: the transport said it, not the verifier): the same back-off from
  ``RetryPolicy.base_delay_s``.

Everything else (bad input, authentication, a bug the verifier reports) is raised. A
generation gives up when it has made no progress for ``RetryPolicy.budget_s``.

The channel is TLS when given ``ClientTls`` (with a client certificate for mutual TLS), and
plaintext only to a loopback address unless ``insecure`` says so: the API key and the
prompt would cross the network in the clear.
"""

from __future__ import annotations

import asyncio
import hashlib
import ipaddress
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np

from edge_client.errors import EdgeError, RequestRejected, VerifierUnavailable
from edge_client.link import Link
from shared import errors
from shared.message_limits import MAX_DRAFT_LEN_CEILING, max_reply_bytes
from shared.pb import verifier_pb2 as pb
from shared.pb import verifier_pb2_grpc as pb_grpc

# The largest reply a verifier can send under any configuration (shared.message_limits).
# What the device sends is bounded by the caps GetInfo advertises, which the verifier
# enforces with its own receive limit.
MAX_RECEIVE_BYTES = max_reply_bytes(MAX_DRAFT_LEN_CEILING)
_TRANSPORT_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                              grpc.StatusCode.CANCELLED, grpc.StatusCode.INTERNAL,
                              grpc.StatusCode.UNKNOWN})
KEEPALIVE_S = 10.0
_REOPEN_AT_ONCE = frozenset({errors.SESSION_EVICTED, errors.SESSION_EXPIRED,
                             errors.STREAM_IDLE})
_RETRY_REASONS = _REOPEN_AT_ONCE | {errors.OVERLOADED, errors.DRAINING}


@dataclass(frozen=True)
class Deadlines:
    """Every call and stream has one."""

    call_s: float = 10.0  # a unary call (GetInfo)
    reply_s: float = 30.0  # the longest wait for the next message on a stream
    # A stream's own gRPC deadline. A generation that outlives it reopens, losing nothing.
    stream_s: float = 600.0

    def __post_init__(self) -> None:
        if min(self.call_s, self.reply_s, self.stream_s) <= 0:
            raise ValueError("deadlines must be > 0")


@dataclass(frozen=True)
class RetryPolicy:
    base_delay_s: float = 0.1  # the first wait when the server gives no RetryInfo
    max_delay_s: float = 5.0
    budget_s: float = 60.0  # give up after this long without a new token

    def __post_init__(self) -> None:
        if self.base_delay_s < 0 or self.max_delay_s < self.base_delay_s or self.budget_s < 0:
            raise ValueError("need 0 <= base_delay_s <= max_delay_s and budget_s >= 0")


@dataclass(frozen=True)
class ClientTls:
    """TLS to the verifier: ``ca`` verifies its certificate (None: the system's roots);
    ``cert`` and ``key`` are this device's, for a verifier that asks (mutual TLS);
    ``server_name`` overrides the name checked in its certificate (default: the host)."""

    ca: Path | None = None
    cert: Path | None = None
    key: Path | None = None
    server_name: str | None = None

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ValueError("a client certificate and its key go together")

    def credentials(self) -> grpc.ChannelCredentials:
        def read(path: Path | None) -> bytes | None:
            return None if path is None else Path(path).read_bytes()

        return grpc.ssl_channel_credentials(root_certificates=read(self.ca),
                                            private_key=read(self.key),
                                            certificate_chain=read(self.cert))


class PlaintextRefused(EdgeError, ValueError):
    """A plaintext channel was asked for to a host other than this machine."""


def is_loopback_address(address: str) -> bool:
    """True for ``localhost:port``, ``127.x.x.x:port``, ``[::1]:port`` and ``unix:`` paths."""
    if address.startswith(("unix:", "unix-abstract:")):
        return True
    target = address.removeprefix("dns:///").removeprefix("ipv4:").removeprefix("ipv6:")
    if "," in target:  # an ipv4:/ipv6: address list: every address must be loopback
        return all(is_loopback_address(part) for part in target.split(","))
    if target.startswith("["):
        host = target[1:target.find("]")]
    elif target.count(":") == 1:
        host = target.split(":", 1)[0]
    else:
        host = target  # no port, or a bare IPv6 address
    host = host.lower()
    if host in ("localhost", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def is_retryable(details: errors.ErrorDetails) -> bool:
    if details.reopen_with_context:
        return True
    if details.reason is not None:
        return details.reason in _RETRY_REASONS
    return details.code in _TRANSPORT_CODES


def reopens_at_once(details: errors.ErrorDetails) -> bool:
    return details.reopen_with_context or details.reason in _REOPEN_AT_ONCE


def lost_connection(details: errors.ErrorDetails) -> bool:
    """The failure says nothing about the session: the verifier may have restarted."""
    return details.reason is None or details.reason == errors.DRAINING


class Backoff:
    """Waits between attempts of one generation; ``progress()`` resets it."""

    def __init__(self, policy: RetryPolicy, rng: np.random.Generator) -> None:
        self.policy = policy
        self.rng = rng
        self.attempt = 0
        self.since = time.monotonic()
        self.waited_s = 0.0

    def progress(self) -> None:
        self.attempt = 0
        self.since = time.monotonic()

    async def wait(self, details: errors.ErrorDetails) -> None:
        """Waits before the next attempt, or raises VerifierUnavailable past the budget."""
        if not is_retryable(details):
            raise RequestRejected(details)
        if time.monotonic() - self.since > self.policy.budget_s:
            raise VerifierUnavailable(
                f"no progress for {self.policy.budget_s:.0f} s; last error "
                f"{details.code.name}: {details.message}")
        attempt, self.attempt = self.attempt, self.attempt + 1
        if reopens_at_once(details) and attempt == 0:
            return
        base = details.retry_after_s if details.retry_after_s is not None \
            else self.policy.base_delay_s
        wait = min(self.policy.max_delay_s, base * 2 ** attempt)
        wait = float(self.rng.uniform(wait / 2, wait))
        self.waited_s += wait
        await asyncio.sleep(wait)


class Connection:
    """An asyncio gRPC channel to one verifier. ``routing_key`` names a generation: every call
    of it carries the same key (reopens included), so a gateway keeps it on one replica.
    ``tls``: a TLS channel; without it the channel is plaintext, which is refused for an
    address off this machine unless ``insecure``."""

    def __init__(self, address: str, api_key: str | None = None,
                 deadlines: Deadlines = Deadlines(), retry: RetryPolicy = RetryPolicy(),
                 link: Link | None = None, tls: ClientTls | None = None,
                 insecure: bool = False, keepalive_s: float = KEEPALIVE_S) -> None:
        if tls is None and not insecure and not is_loopback_address(address):
            raise PlaintextRefused(
                f"refusing a plaintext channel to {address}, off this machine: the API key "
                "and the prompt would travel in the clear. Use TLS (--tls-ca, or ClientTls), "
                "or say insecure (--insecure) if the network is trusted")
        self.address = address
        self.deadlines = deadlines
        self.retry = retry
        self.link = link or Link()
        self._auth = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        if keepalive_s <= 0:
            raise ValueError("keepalive_s must be > 0")
        options = [
            ("grpc.max_receive_message_length", MAX_RECEIVE_BYTES),
            # A silent partition or a frozen verifier is noticed by pings, not by waiting;
            # the verifier permits pings this often (its --min-client-ping, 5 s by default).
            ("grpc.keepalive_time_ms", int(keepalive_s * 1000)),
            ("grpc.keepalive_timeout_ms", int(min(5.0, keepalive_s) * 1000)),
            # Every ping times out as a keepalive ping does: without this, a ping already in
            # flight (the flow-control ping sent with the first stream) blocks keepalive's
            # own and waits gRPC's default 60 s, so a silent partition took ~61 s to notice
            # (tests/test_chaos.py).
            ("grpc.http2.ping_timeout_ms", int(min(5.0, keepalive_s) * 1000)),
            ("grpc.http2.max_pings_without_data", 0),
            # Reconnect soon after a restart instead of gRPC's default back-off (up to 120 s);
            # the generation's own back-off paces the attempts.
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 1_000),
            # gRPC also takes this as the shortest connection attempt: at 100 ms a handshake
            # slower than that (a loaded verifier, an RTT above ~70 ms) failed connect() at
            # once. A refused connection still fails at once and is retried after the back-off.
            ("grpc.min_reconnect_backoff_ms", 5_000),
        ]
        if tls is not None and tls.server_name:
            options.append(("grpc.ssl_target_name_override", tls.server_name))
        self.channel = (grpc.aio.secure_channel(address, tls.credentials(), options=options)
                        if tls is not None
                        else grpc.aio.insecure_channel(address, options=options))
        self.stub = pb_grpc.VerifierServiceStub(self.channel)
        self.routing_key = new_routing_key()  # for calls outside a generation

    def metadata(self, routing_key: str | None = None) -> tuple[tuple[str, str], ...]:
        return self._auth + ((errors.ROUTING_KEY, routing_key or self.routing_key),)

    async def info(self) -> pb.GetInfoResponse:
        try:
            return await self.stub.GetInfo(pb.GetInfoRequest(), timeout=self.deadlines.call_s,
                                           metadata=self.metadata())
        except grpc.aio.AioRpcError as err:
            details = errors.details_of(err)
            if is_retryable(details):
                raise VerifierUnavailable(f"the verifier at {self.address} is unreachable: "
                                          f"{details.code.name} {details.message}") from err
            raise RequestRejected(details) from err

    async def close(self) -> None:
        await self.channel.close()


def new_routing_key() -> str:
    return secrets.token_hex(16)


def document_routing_key(document: str) -> str:
    """The routing key of every generation over one document (an IME text field, a chat):
    a gateway hashing it sends them all to the replica whose prefix cache holds the text
    typed so far. A digest, so the gateway's logs never see the document's name."""
    return hashlib.sha256(document.encode()).hexdigest()[:32]
