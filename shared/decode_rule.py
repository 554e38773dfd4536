"""Where a Decode ends: one rule for both ends of the wire.

The verifier stops decoding after this Step, and the client, reading the Session stream
(which stays open for its next message), must know that it was the last one.
"""

from __future__ import annotations

from shared.pb import verifier_pb2 as pb


def ends_decode(decode: pb.Decode, step: pb.Step) -> bool:
    """Whether ``step`` is the last Step of ``decode``: the generation finished, or the client
    asked to stop once drafting pays and the server now suggests drafts, or the Decode has
    run its ``max_tokens`` rounds (its rounds are numbered from ``decode.round``)."""
    return (step.finished
            or (decode.stop_when_drafting_pays and step.suggested_draft_len > 0)
            or step.round + 1 >= decode.round + decode.max_tokens)
