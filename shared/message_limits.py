"""gRPC message size limits derived from the protocol's caps, for both ends of the wire.

A limit is the size of the largest message a well-behaved peer can send under the caps the
verifier advertises in GetInfo (max_context, max_draft_len, max_q_support,
max_stop_token_ids, vocab_size), built field by field with every value at its largest, plus
a little slack for fields a newer peer may add. Anything bigger is refused by gRPC itself
(RESOURCE_EXHAUSTED) before a byte of it is parsed, so a bad request costs the verifier at
most one maximal valid message to look at.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.pb import verifier_pb2 as pb

# Room for fields a newer peer may send and this one ignores.
SLACK_BYTES = 4096
# The largest max_draft_len a verifier may be configured with (cloud_verifier.config).
MAX_DRAFT_LEN_CEILING = 256
# GetInfo carries names and eos ids that no cap bounds; a reply past this is not a verifier.
INFO_REPLY_BYTES = 64 * 1024
# The largest target hidden size whose features a verifier serves (Step.feature, fp16: two
# bytes a value, the largest codec), so that a client can size its limit before GetInfo.
MAX_FEATURE_HIDDEN = 16384
_UINT32 = 2**32 - 1
_UINT64 = 2**64 - 1


@dataclass(frozen=True)
class ProtocolCaps:
    vocab_size: int
    max_context: int
    max_draft_len: int
    max_q_support: int
    max_stop_token_ids: int


def _largest_draft(caps: ProtocolCaps) -> pb.Draft:
    top = caps.vocab_size - 1
    k, support = caps.max_draft_len, min(caps.max_q_support, caps.vocab_size)
    draft = pb.Draft(token_ids=[top] * k, confidence=[1.0] * k)
    for _ in range(k):
        draft.q.add(token_ids=[top] * support, probs=[1.0] * support)
    return draft


def _largest_start(caps: ProtocolCaps) -> dict:
    """What an open and a Generate share, at its largest."""
    top = caps.vocab_size - 1
    return dict(prompt_token_ids=[top] * caps.max_context,
                sampling=pb.SamplingParams(temperature=1e30, top_k=_UINT32, top_p=1.0,
                                           seed=2**64 - 1),
                max_new_tokens=_UINT32, stop_token_ids=[top] * caps.max_stop_token_ids,
                ignore_eos=True)


def max_request_bytes(caps: ProtocolCaps) -> int:
    """The largest SessionRequest or GenerateRequest a client may send."""
    open_message = pb.SessionRequest(open=pb.OpenSession(
        **_largest_start(caps), drafting=pb.DRAFTING_LOOKAHEAD,
        first_draft=_largest_draft(caps)))
    lookahead = pb.SessionRequest(lookahead=pb.LookaheadDraft(
        base_length=_UINT32, draft=_largest_draft(caps)))
    generate = pb.GenerateRequest(**_largest_start(caps))
    largest = max(m.ByteSize() for m in (open_message, lookahead, generate))
    return largest + SLACK_BYTES


def max_reply_bytes(max_draft_len: int) -> int:
    """The largest SessionResponse or GenerateResponse a verifier may send, or GetInfo's
    allowance if that is more."""
    step = pb.Step(round=_UINT32, token_ids=[_UINT32] * (max_draft_len + 1),
                   num_drafted=_UINT32, num_accepted=_UINT32, committed_length=_UINT32,
                   finished=True, target_forwards=_UINT32,
                   timing=pb.Timing(queue_ns=_UINT64, forward_ns=_UINT64),
                   suggested_draft_len=_UINT32, draft_token_cost=1e30,
                   feature=pb.Feature(position=_UINT32, values=bytes(2 * MAX_FEATURE_HIDDEN)))
    reply = pb.SessionResponse(session_id="f" * 64, step=step)
    return max(reply.ByteSize() + SLACK_BYTES, INFO_REPLY_BYTES)
