"""Machine-readable errors and call metadata: one definition for both ends of the wire.

A status that a client acts on carries ``google.rpc.ErrorInfo`` (domain ``edgespec.v1``, a
reason from ``ErrorReason`` in the proto) and, where waiting helps, ``google.rpc.RetryInfo``,
packed into the standard ``grpc-status-details-bin`` trailer by grpcio-status. Clients read
the reason and the delay (``details_of``), never the message text.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import grpc
from google.protobuf import duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from shared.pb import verifier_pb2 as pb

DOMAIN = "edgespec.v1"
# Metadata key of the client's routing key (see the proto): a gateway keeps one key's calls
# on one replica.
ROUTING_KEY = "edgespec-routing-key"
ROUTING_KEY_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_PREFIX = "ERROR_REASON_"

# The reasons, as ErrorInfo carries them: the ErrorReason names without their prefix.
REASONS = frozenset(name[len(_PREFIX):] for name in pb.ErrorReason.keys()
                    if name != "ERROR_REASON_UNSPECIFIED")
INVALID_ARGUMENT = "INVALID_ARGUMENT"
CONTEXT_TOO_LONG = "CONTEXT_TOO_LONG"
SESSION_EVICTED = "SESSION_EVICTED"
SESSION_EXPIRED = "SESSION_EXPIRED"
OUT_OF_ORDER = "OUT_OF_ORDER"
OVERLOADED = "OVERLOADED"
DRAINING = "DRAINING"
UNAUTHENTICATED = "UNAUTHENTICATED"
INTERNAL = "INTERNAL"
STREAM_IDLE = "STREAM_IDLE"
FEATURES_UNAVAILABLE = "FEATURES_UNAVAILABLE"
assert {INVALID_ARGUMENT, CONTEXT_TOO_LONG, SESSION_EVICTED, SESSION_EXPIRED, OUT_OF_ORDER,
        OVERLOADED, DRAINING, UNAUTHENTICATED, INTERNAL, STREAM_IDLE,
        FEATURES_UNAVAILABLE} == REASONS

# The reopen hint: ErrorInfo.metadata[REOPEN] == REOPEN_WITH_CONTEXT on every status whose
# session the verifier closed without losing anything the client has (eviction, TTL expiry,
# an idle stream). The client opens a new session with its committed context at once, so
# one rule covers these reasons and any later one that carries the hint.
REOPEN = "reopen"
REOPEN_WITH_CONTEXT = "committed_context"


def rich_status(code: grpc.StatusCode, message: str, reason: str,
                retry_after_s: float | None = None,
                metadata: dict[str, str] | None = None) -> grpc.Status:
    """A status with ErrorInfo (and RetryInfo when ``retry_after_s`` is given), ready for
    ``context.abort(status.code, status.details, status.trailing_metadata)``."""
    if reason not in REASONS:
        raise ValueError(f"unknown error reason {reason!r}")
    info = error_details_pb2.ErrorInfo(reason=reason, domain=DOMAIN, metadata=metadata or {})
    status = status_pb2.Status(code=getattr(code_pb2, code.name), message=message)
    status.details.add().Pack(info)
    if retry_after_s is not None:
        delay = duration_pb2.Duration()
        delay.FromNanoseconds(int(max(0.0, retry_after_s) * 1e9))
        status.details.add().Pack(error_details_pb2.RetryInfo(retry_delay=delay))
    return rpc_status.to_status(status)


@dataclass(frozen=True)
class ErrorDetails:
    """What a failed call says, for a client to act on."""

    code: grpc.StatusCode
    reason: str | None  # None: the status carried no ErrorInfo of our domain
    retry_after_s: float | None  # None: no RetryInfo
    message: str
    metadata: dict[str, str]

    @property
    def reopen_with_context(self) -> bool:
        return self.metadata.get(REOPEN) == REOPEN_WITH_CONTEXT


def details_of(err: grpc.RpcError) -> ErrorDetails:
    """Reads ErrorInfo and RetryInfo from a failed call (sync or asyncio)."""
    code = err.code() if callable(getattr(err, "code", None)) else grpc.StatusCode.UNKNOWN
    message = (err.details() if callable(getattr(err, "details", None)) else "") or ""
    reason: str | None = None
    retry: float | None = None
    metadata: dict[str, str] = {}
    for key, value in _trailing(err):
        if key != "grpc-status-details-bin":
            continue
        status = status_pb2.Status.FromString(value)
        for detail in status.details:
            if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
                info = error_details_pb2.ErrorInfo()
                detail.Unpack(info)
                if info.domain == DOMAIN:
                    reason, metadata = info.reason, dict(info.metadata)
            elif detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
                hint = error_details_pb2.RetryInfo()
                detail.Unpack(hint)
                retry = hint.retry_delay.ToNanoseconds() / 1e9
    return ErrorDetails(code, reason, retry, message, metadata)


def _trailing(err: grpc.RpcError) -> list[tuple[str, bytes]]:
    getter = getattr(err, "trailing_metadata", None)
    if not callable(getter):
        return []
    try:
        return [(k, v) for k, v in (getter() or ())]
    except Exception:  # noqa: BLE001 - a call without trailers has no details
        return []
