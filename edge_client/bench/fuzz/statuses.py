"""Which statuses a fuzzed call may end with: the documented ones.

The reasons are the proto's ``ErrorReason`` values (``shared.errors.REASONS``); the code each
one travels with is docs/protocol.md's error table, copied here so that the benchmark runs
from an installed package too (tests/test_fuzz.py parses the table and checks that this copy
equals it). A fuzzed call may end OK, or with a documented (code, ErrorInfo reason) pair,
except ``INTERNAL``: the table documents it as a bug in the verifier, which is what a fuzzer
is looking for. A status without an ErrorInfo of the edgespec domain is undocumented.
"""

from __future__ import annotations

import re

import grpc

from shared import errors

# ErrorInfo reason -> status code, as docs/protocol.md's "Errors" table says.
DOCUMENTED_CODES: dict[str, grpc.StatusCode] = {
    errors.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    errors.CONTEXT_TOO_LONG: grpc.StatusCode.OUT_OF_RANGE,
    errors.SESSION_EVICTED: grpc.StatusCode.NOT_FOUND,
    errors.SESSION_EXPIRED: grpc.StatusCode.NOT_FOUND,
    errors.OUT_OF_ORDER: grpc.StatusCode.FAILED_PRECONDITION,
    errors.OVERLOADED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.DRAINING: grpc.StatusCode.UNAVAILABLE,
    errors.UNAUTHENTICATED: grpc.StatusCode.UNAUTHENTICATED,
    errors.INTERNAL: grpc.StatusCode.INTERNAL,
    errors.STREAM_IDLE: grpc.StatusCode.DEADLINE_EXCEEDED,
    errors.FEATURES_UNAVAILABLE: grpc.StatusCode.INVALID_ARGUMENT,
}
assert set(DOCUMENTED_CODES) == errors.REASONS, "every ErrorReason has a documented code"
# Documented, but a verifier bug: a fuzzed input must never produce it.
BUG_REASONS = frozenset({errors.INTERNAL})
OK = "OK"


def outcome_name(code: grpc.StatusCode | None, reason: str | None) -> str:
    """``OK``, ``CODE/REASON`` or ``CODE/-`` (no edgespec ErrorInfo)."""
    if code is None or code == grpc.StatusCode.OK:
        return OK
    return f"{code.name}/{reason or '-'}"


def documented(code: grpc.StatusCode | None, reason: str | None) -> bool:
    """Whether a fuzzed call may end so."""
    if code is None or code == grpc.StatusCode.OK:
        return True
    return (reason is not None and reason not in BUG_REASONS
            and DOCUMENTED_CODES.get(reason) == code)


def undecodable_answered_right(code: grpc.StatusCode | None, reason: str | None,
                               authenticated: bool) -> bool:
    """A payload that does not decode is bad input: INVALID_ARGUMENT, or UNAUTHENTICATED
    when the call carried no valid key (authentication may come first)."""
    if (code, reason) == (grpc.StatusCode.INVALID_ARGUMENT, errors.INVALID_ARGUMENT):
        return True
    return not authenticated and (code, reason) == (grpc.StatusCode.UNAUTHENTICATED,
                                                    errors.UNAUTHENTICATED)


def parse_error_table(markdown: str) -> dict[str, str]:
    """reason -> code name from docs/protocol.md's "Bad input | Status | ErrorInfo reason"
    table: each row's status is the first `CODE` of its second cell, its reasons the
    ErrorReason names among the `...` of its third."""
    table: dict[str, str] = {}
    in_table = False
    for line in markdown.splitlines():
        if line.startswith("| Bad input | Status |"):
            in_table = True
            continue
        if in_table and not line.startswith("|"):
            break
        if not in_table or line.startswith("|---"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        codes = re.findall(r"`([A-Z_]+)`", cells[1])
        for reason in re.findall(r"`([A-Z_]+)`", cells[2]):
            if reason in errors.REASONS:
                table.setdefault(reason, codes[0])
    return table
