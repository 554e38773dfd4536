"""Domain errors of the verifier, each with the status a client sees.

Code below the service raises these and knows nothing of gRPC calls; each class names its
status code and its ``ErrorInfo`` reason (shared.errors), and the interceptor
(cloud_verifier.interceptors) turns a raised one into that rich status. The message is shown
to the caller, so it must say what to fix; clients act on the reason, never on the text.
"""

from __future__ import annotations

import grpc

from shared import errors as reasons

# Back-off the verifier asks for (RetryInfo) when it is overloaded or draining.
RETRY_AFTER_S = 0.2


class VerifierError(Exception):
    """Base class. ``metadata`` goes into ErrorInfo (e.g. {"field": "open.prompt_token_ids"})."""

    code = grpc.StatusCode.INTERNAL
    reason = reasons.INTERNAL
    retry_after_s: float | None = None
    # The session was closed with nothing lost: ErrorInfo carries the reopen hint.
    reopen = False

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.metadata: dict[str, str] = {} if field is None else {"field": field}
        if self.reopen:
            self.metadata[reasons.REOPEN] = reasons.REOPEN_WITH_CONTEXT


class InvalidRequest(VerifierError):
    """A field is malformed or out of range; ``field`` names it."""

    code = grpc.StatusCode.INVALID_ARGUMENT
    reason = reasons.INVALID_ARGUMENT


class FeaturesUnavailable(InvalidRequest):
    """The open asked for target features and this verifier serves none."""

    reason = reasons.FEATURES_UNAVAILABLE


class ContextTooLong(VerifierError):
    """The session would grow past the maximum context."""

    code = grpc.StatusCode.OUT_OF_RANGE
    reason = reasons.CONTEXT_TOO_LONG


class SessionEvicted(VerifierError):
    """The session's KV memory was taken for others; the client reopens with its context."""

    code = grpc.StatusCode.NOT_FOUND
    reason = reasons.SESSION_EVICTED
    reopen = True


class SessionExpired(VerifierError):
    """The session sat idle past its TTL; the client reopens with its context."""

    code = grpc.StatusCode.NOT_FOUND
    reason = reasons.SESSION_EXPIRED
    reopen = True


class StreamIdle(VerifierError):
    """A stream sent no open in time, or its reader left a Step unread too long; its session
    (if any) is closed and the client reopens with its context."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED
    reason = reasons.STREAM_IDLE
    reopen = True


class RoundOutOfOrder(VerifierError):
    """A message in the wrong place: a round number that is not the session's next one, a
    message the session's drafting mode does not take, a second open, or a message after
    the session finished."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    reason = reasons.OUT_OF_ORDER


class Busy(VerifierError):
    """The verifier cannot take this now; waiting helps."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    reason = reasons.OVERLOADED
    retry_after_s = RETRY_AFTER_S


class TooManySessions(Busy):
    """The session table is full."""


class KVCacheFull(Busy):
    """The KV memory budget cannot hold this round."""


class Overloaded(Busy):
    """Too many rounds are queued for the model."""


class Draining(VerifierError):
    """The server is shutting down and takes no new sessions: reopen on another replica."""

    code = grpc.StatusCode.UNAVAILABLE
    reason = reasons.DRAINING
    retry_after_s = RETRY_AFTER_S


class Unauthenticated(VerifierError):
    """Missing or unknown API key."""

    code = grpc.StatusCode.UNAUTHENTICATED
    reason = reasons.UNAUTHENTICATED
