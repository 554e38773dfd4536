"""What the edge client raises, so that an app (and the CLI) can tell failures apart."""

from __future__ import annotations

from shared.errors import ErrorDetails


class EdgeError(RuntimeError):
    """Base class of the client's own errors."""


class IncompatibleVerifier(EdgeError):
    """The verifier's model does not share this client's tokenizer or vocabulary."""


class VerifierUnavailable(EdgeError):
    """The verifier could not be reached, or made no progress, within the retry budget."""


class RequestRejected(EdgeError):
    """The verifier refused the request for a reason retrying cannot fix (bad input, an
    unknown API key, a context too long); ``details`` has the status and its reason."""

    def __init__(self, details: ErrorDetails) -> None:
        super().__init__(f"{details.code.name}"
                         + (f" ({details.reason})" if details.reason else "")
                         + f": {details.message}")
        self.details = details


def run_command(prog: str, args) -> int:
    """Runs a parsed command (``args.func(args)``, logging at ``args.log_level``): an
    EdgeError becomes one line on stderr and exit code 2, not a traceback."""
    import logging
    import sys

    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except EdgeError as err:
        print(f"{prog}: {type(err).__name__}: {err}", file=sys.stderr)
        return 2
