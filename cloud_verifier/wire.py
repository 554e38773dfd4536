"""Protobuf <-> domain conversion, with validation of every request field.

This is the trust boundary: everything that leaves this module is range-checked, and every
problem raises InvalidRequest (naming the field, for ErrorInfo) or ContextTooLong with a
message a person can act on. Lengths are checked before contents, and contents with numpy,
so that a bad request costs little more than its decoding; ``is_large`` says which
requests are still worth checking off the event loop (cloud_verifier.service).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from cloud_verifier.errors import ContextTooLong, FeaturesUnavailable, InvalidRequest
from cloud_verifier.lookahead import Lookahead
from cloud_verifier.rounds import RoundResult
from cloud_verifier.sampling import SamplingParams
from cloud_verifier.session_params import EditParams, OpenParams
from cloud_verifier.target_engine import NO_DRAFT, DraftRound
from shared.message_limits import ProtocolCaps
from shared.pb import verifier_pb2 as pb
from shared.token_spelling import MAX_CONTINUE_WITH, TokenSpelling

# Probabilities may sum a little above 1 from float32 round-off on the device.
PROB_SUM_TOLERANCE = 1e-3
ROUNDS = pb.DRAFTING_ROUNDS
LOOKAHEAD = pb.DRAFTING_LOOKAHEAD


# Repeated fields past this many entries in all are checked on a worker thread.
LARGE_REQUEST_ENTRIES = 4096


@dataclass(frozen=True)
class Limits:
    vocab_size: int
    max_draft_len: int
    max_context: int
    max_q_support: int = 256  # entries of one q; also bounds the message size limit
    max_stop_token_ids: int = 64
    serves_features: bool = False  # GetInfo has a FeatureCapability
    # The tokenizer's token bytes: sessions may continue with given bytes (None: they may not).
    spelling: TokenSpelling | None = None

    @property
    def max_continue_with(self) -> int:
        return 0 if self.spelling is None else MAX_CONTINUE_WITH

    def caps(self) -> ProtocolCaps:
        return ProtocolCaps(self.vocab_size, self.max_context, self.max_draft_len,
                            self.max_q_support, self.max_stop_token_ids)


def _check_token_ids(ids, vocab_size: int, where: str) -> list[int]:
    """The ids as a list, all in [0, vocab_size) (uint32 on the wire: never negative)."""
    values = np.fromiter(ids, dtype=np.int64, count=len(ids))
    bad = np.flatnonzero(values >= vocab_size)
    if bad.size:
        i = int(bad[0])
        raise InvalidRequest(f"{where}[{i}] = {int(values[i])} is out of range "
                             f"[0, {vocab_size})", field=where)
    return values.tolist()


def is_large(msg) -> bool:
    """Whether an OpenSession or GenerateRequest is big enough that checking it would hold
    the event loop up noticeably."""
    entries = len(msg.prompt_token_ids) + len(msg.stop_token_ids)
    if isinstance(msg, pb.OpenSession) and msg.HasField("first_draft"):
        entries += sum(len(d.token_ids) for d in msg.first_draft.q)
    return entries > LARGE_REQUEST_ENTRIES


def parse_sampling(msg: pb.SamplingParams, where: str = "sampling") -> SamplingParams:
    if not math.isfinite(msg.temperature) or msg.temperature < 0:
        raise InvalidRequest(f"{where}.temperature must be finite and >= 0, "
                             f"got {msg.temperature}", field=f"{where}.temperature")
    if not math.isfinite(msg.top_p) or not 0 <= msg.top_p <= 1:
        raise InvalidRequest(f"{where}.top_p must be in (0, 1] (0 = unset), got {msg.top_p}",
                             field=f"{where}.top_p")
    # seed is a uint64 and every value it can carry is valid (position_seed mixes all 64 bits).
    return SamplingParams(temperature=float(msg.temperature), top_k=int(msg.top_k),
                          top_p=float(msg.top_p) if msg.top_p > 0 else 1.0, seed=int(msg.seed))


def parse_draft(msg: pb.Draft, limits: Limits, where: str = "draft") -> DraftRound:
    k = len(msg.token_ids)
    if k > limits.max_draft_len:
        raise InvalidRequest(f"{where} has {k} tokens; this verifier accepts at most "
                             f"{limits.max_draft_len} per round", field=f"{where}.token_ids")
    tokens = _check_token_ids(msg.token_ids, limits.vocab_size, f"{where}.token_ids")
    confidence = _parse_confidence(msg.confidence, k, f"{where}.confidence")
    if not msg.q:
        return DraftRound(tokens=tokens, q=None, confidence=confidence)
    if len(msg.q) != k:
        raise InvalidRequest(f"{where}.q has {len(msg.q)} entries; it must be empty "
                             f"(point-mass drafts) or one per draft token ({k})",
                             field=f"{where}.q")
    q = []
    for i, (token, dist) in enumerate(zip(tokens, msg.q, strict=True)):
        q.append(_parse_distribution(dist, token, f"{where}.q[{i}]", limits.vocab_size,
                                     limits.max_q_support))
    return DraftRound(tokens=tokens, q=q, confidence=confidence)


def _parse_confidence(values, k: int, where: str) -> list[float] | None:
    if not values:
        return None
    if len(values) != k:
        raise InvalidRequest(f"{where} has {len(values)} entries; it must be empty "
                             f"or one per draft token ({k})", field=where)
    out = [float(c) for c in values]
    for i, c in enumerate(out):
        if not 0 <= c <= 1:  # also false for NaN
            raise InvalidRequest(f"{where}[{i}] = {c} is not a probability in [0, 1]",
                                 field=where)
    return out


def _parse_distribution(dist: pb.SparseDistribution, drafted: int, where: str,
                        vocab_size: int, max_support: int) -> tuple[list[int], list[float]]:
    def bad(message: str) -> InvalidRequest:
        return InvalidRequest(f"{where} {message}", field=where)

    if len(dist.token_ids) != len(dist.probs):
        raise bad(f"has {len(dist.token_ids)} token_ids but {len(dist.probs)} probs")
    if not dist.token_ids:
        raise bad(f"is empty; it must contain the drafted token {drafted}")
    if len(dist.token_ids) > max_support:
        raise bad(f"lists {len(dist.token_ids)} tokens; this verifier accepts at most "
                  f"{max_support} per position (GetInfo max_q_support): truncate q")
    ids = np.fromiter(dist.token_ids, dtype=np.int64, count=len(dist.token_ids))
    probs = np.fromiter(dist.probs, dtype=np.float64, count=len(dist.probs))
    if ids.max() >= vocab_size:
        raise bad(f"token id {int(ids[ids >= vocab_size][0])} is out of range "
                  f"[0, {vocab_size})")
    if np.unique(ids).size != ids.size:
        raise bad("lists a token id more than once")
    if not np.all(np.isfinite(probs)):
        raise bad("has a NaN or infinite probability")
    if np.any(probs < 0) or np.any(probs > 1):
        raise bad("has a probability outside [0, 1]")
    total = float(probs.sum())
    if total > 1 + PROB_SUM_TOLERANCE:
        raise bad(f"probabilities sum to {total:.6f} > 1")
    hit = np.nonzero(ids == drafted)[0]
    if hit.size == 0 or probs[hit[0]] <= 0:
        raise bad(f"gives the drafted token {drafted} no probability; a draft token must be "
                  "sampled from its q")
    return ids.tolist(), probs.tolist()


def _parse_start(prompt_ids, sampling: pb.SamplingParams, max_new_tokens: int, stop_ids,
                 ignore_eos: bool, limits: Limits, default_stop_ids: frozenset[int],
                 where: str) -> tuple[list[int], SamplingParams, frozenset[int]]:
    """What an open and a Generate share: prompt, sampling, stop tokens."""
    if not prompt_ids:
        raise InvalidRequest(f"{where}prompt_token_ids is empty; send at least one token",
                             field=f"{where}prompt_token_ids")
    if len(prompt_ids) + 1 > limits.max_context:
        raise ContextTooLong(f"prompt has {len(prompt_ids)} tokens; the maximum context is "
                             f"{limits.max_context} including at least one new token",
                             field=f"{where}prompt_token_ids")
    if len(stop_ids) > limits.max_stop_token_ids:
        raise InvalidRequest(f"{where}stop_token_ids lists {len(stop_ids)} ids; at most "
                             f"{limits.max_stop_token_ids} are accepted",
                             field=f"{where}stop_token_ids")
    prompt = _check_token_ids(prompt_ids, limits.vocab_size, f"{where}prompt_token_ids")
    stop = _check_token_ids(stop_ids, limits.vocab_size, f"{where}stop_token_ids")
    stops = frozenset(stop) if stop else (frozenset() if ignore_eos else default_stop_ids)
    return prompt, parse_sampling(sampling, f"{where}sampling"), stops


def parse_open(msg: pb.OpenSession, limits: Limits,
               default_stop_ids: frozenset[int]) -> OpenParams:
    prompt, sampling, stops = _parse_start(
        msg.prompt_token_ids, msg.sampling, msg.max_new_tokens, msg.stop_token_ids,
        msg.ignore_eos, limits, default_stop_ids, "open.")
    if msg.drafting not in (ROUNDS, LOOKAHEAD):
        raise InvalidRequest("open.drafting must be DRAFTING_ROUNDS or DRAFTING_LOOKAHEAD",
                             field="open.drafting")
    if msg.HasField("first_draft"):
        first = parse_draft(msg.first_draft, limits, "open.first_draft")
    else:
        first = NO_DRAFT if msg.drafting == ROUNDS else None
    if msg.editable and msg.drafting != ROUNDS:
        raise InvalidRequest("open.editable needs DRAFTING_ROUNDS", field="open.editable")
    if msg.want_feature and not limits.serves_features:
        raise FeaturesUnavailable("open.want_feature: this verifier serves no target features "
                                  "(its GetInfo has no feature capability); draft with an "
                                  "independent draft", field="open.want_feature")
    continue_with = parse_continue_with(msg.continue_with, limits, "open.continue_with")
    if continue_with and msg.drafting != ROUNDS:
        raise InvalidRequest("open.continue_with needs DRAFTING_ROUNDS",
                             field="open.continue_with")
    return OpenParams(prompt, sampling, int(msg.max_new_tokens), stops, msg.drafting, first,
                      bool(msg.editable), bool(msg.want_feature), continue_with)


def parse_continue_with(value: bytes, limits: Limits, where: str) -> bytes:
    """The bytes a session's new tokens must begin with (token healing), checked."""
    value = bytes(value)
    if not value:
        return b""
    if limits.spelling is None:
        raise InvalidRequest(f"{where}: this verifier's tokenizer does not spell text as "
                             "bytes (GetInfo max_continue_with is 0); send the text's own "
                             "tokens instead", field=where)
    if len(value) > limits.max_continue_with:
        raise InvalidRequest(f"{where} has {len(value)} bytes; at most "
                             f"{limits.max_continue_with} are accepted (GetInfo "
                             "max_continue_with)", field=where)
    if not limits.spelling.allowed(value).size:
        raise InvalidRequest(f"{where}: no token of this vocabulary begins to spell these "
                             "bytes", field=where)
    return value


def parse_edit(msg: pb.Edit, limits: Limits, where: str = "verify.edit") -> EditParams:
    """The edit's own fields; whether it fits the session (keep_length, the context) is
    checked against the session when it is applied (RoundRunner)."""
    append = _check_token_ids(msg.append_token_ids, limits.vocab_size,
                              f"{where}.append_token_ids")
    if msg.keep_length + len(append) < 1:
        raise InvalidRequest(f"{where} leaves no text: keep_length + append_token_ids must be "
                             "at least 1 token", field=f"{where}.keep_length")
    if msg.keep_length + len(append) + 1 > limits.max_context:
        raise ContextTooLong(f"{where} makes the text {msg.keep_length + len(append)} tokens; "
                             f"the maximum context is {limits.max_context} including at least "
                             "one new token", field=f"{where}.append_token_ids")
    return EditParams(int(msg.keep_length), append, int(msg.suggestion),
                      int(msg.max_new_tokens),
                      parse_continue_with(msg.continue_with, limits, f"{where}.continue_with"))


def parse_generate(msg: pb.GenerateRequest, limits: Limits,
                   default_stop_ids: frozenset[int]) -> OpenParams:
    """A cloud-only generation is a session without drafts."""
    prompt, sampling, stops = _parse_start(
        msg.prompt_token_ids, msg.sampling, msg.max_new_tokens, msg.stop_token_ids,
        msg.ignore_eos, limits, default_stop_ids, "")
    return OpenParams(prompt, sampling, int(msg.max_new_tokens), stops, ROUNDS, None)


def parse_lookahead(msg: pb.LookaheadDraft, limits: Limits, prompt_len: int,
                    committed_len: int) -> Lookahead:
    """A lookahead of a session whose prompt and committed lengths are these right now."""
    if not prompt_len <= msg.base_length <= committed_len:
        raise InvalidRequest(f"lookahead.base_length {msg.base_length} must be in "
                             f"[{prompt_len}, {committed_len}]: from the prompt length to "
                             "the committed length streamed so far",
                             field="lookahead.base_length")
    return Lookahead(int(msg.base_length), parse_draft(msg.draft, limits, "lookahead.draft"))


def check_decode(msg: pb.Decode) -> pb.Decode:
    if msg.max_tokens < 1:
        raise InvalidRequest("decode.max_tokens must be at least 1", field="decode.max_tokens")
    return msg


def step_to_pb(result: RoundResult, suggestion: bool = True) -> pb.Step:
    """The wire form of a round; ``suggestion=False`` leaves suggested_draft_len and
    draft_token_cost absent (Generate, where drafting is not on the table)."""
    step = pb.Step(
        round=result.round, token_ids=result.token_ids, num_drafted=result.num_drafted,
        num_accepted=result.num_accepted, committed_length=result.committed_length,
        finished=result.finished, target_forwards=result.target_forwards,
        timing=pb.Timing(queue_ns=result.queue_ns, forward_ns=result.forward_ns),
        suggestion=result.suggestion, fed_tokens=result.fed_tokens)
    if result.feature is not None:
        step.feature.position = result.feature_position
        step.feature.values = result.feature.values
        step.feature.scales.extend(result.feature.scales)
    if suggestion:
        step.suggested_draft_len = result.suggested_draft_len
        if result.draft_token_cost is not None:
            step.draft_token_cost = result.draft_token_cost
    return step
