"""Domain errors of the verifier. The gRPC service maps each one to a status code;
nothing below the service layer knows about gRPC."""

from __future__ import annotations


class VerifierError(Exception):
    """Base class: the message is shown to the caller, so it must say what to fix."""


class InvalidRequest(VerifierError):
    """A field is malformed or out of range (INVALID_ARGUMENT)."""


class ContextTooLong(VerifierError):
    """The session would grow past the maximum context (OUT_OF_RANGE)."""


class SessionNotFound(VerifierError):
    """Unknown, expired, closed, or owned by someone else (NOT_FOUND)."""


class RoundOutOfOrder(VerifierError):
    """The round number is not the next one nor a retry of the last one (FAILED_PRECONDITION)."""


class TooManySessions(VerifierError):
    """The session table is full (RESOURCE_EXHAUSTED)."""


class Draining(VerifierError):
    """The server is shutting down and takes no new sessions (UNAVAILABLE)."""


class Unauthenticated(VerifierError):
    """Missing or unknown API key (UNAUTHENTICATED)."""


class KVCacheFull(VerifierError):
    """The KV memory budget cannot hold this round (RESOURCE_EXHAUSTED)."""


class Overloaded(VerifierError):
    """Too many rounds are queued for the model (RESOURCE_EXHAUSTED)."""
