"""Where a Continue stream ends: one rule for both ends of the wire.

The verifier stops decoding after this message, and a client reading the stream over the
bidirectional Session call (which stays open) must know it was the last one. Besides this
rule a stream also ends after ``max_tokens`` rounds.
"""

from __future__ import annotations

from shared.pb import verifier_pb2 as pb


def ends_stream(request: pb.ContinueRequest, result: pb.RoundResult) -> bool:
    """The generation finished, or the client asked to stop once drafting pays again and the
    server now suggests drafts."""
    return result.finished or (request.stop_when_drafting_pays
                               and result.suggested_draft_len > 0)
