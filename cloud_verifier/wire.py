"""Protobuf <-> domain conversion, with validation of every request field.

This is the trust boundary: everything that leaves this module is range-checked, and every
problem raises InvalidRequest (or ContextTooLong) with a message a person can act on.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import numpy as np

from cloud_verifier.engine import DraftRound
from cloud_verifier.errors import ContextTooLong, InvalidRequest
from cloud_verifier.lookahead import Lookahead
from cloud_verifier.sessions import RoundResult, is_well_formed_session_id
from shared.pb import verifier_pb2 as pb
from shared.sampling import SamplingParams

# Probabilities may sum a little above 1 from float32 round-off on the device.
PROB_SUM_TOLERANCE = 1e-3
MAX_SEED = 2**63 - 1


@dataclass(frozen=True)
class Limits:
    vocab_size: int
    max_draft_len: int
    max_context: int


@dataclass(frozen=True)
class OpenParams:
    prompt: list[int]
    sampling: SamplingParams
    max_new_tokens: int
    stop_token_ids: frozenset[int]
    first_draft: DraftRound | None
    first_draft_digest: bytes


def _check_token_ids(ids, vocab_size: int, what: str) -> list[int]:
    values = list(ids)
    for i, t in enumerate(values):
        if t >= vocab_size:
            raise InvalidRequest(f"{what}[{i}] = {t} is out of range [0, {vocab_size})")
    return values


def parse_sampling(msg: pb.SamplingParams) -> SamplingParams:
    if not math.isfinite(msg.temperature) or msg.temperature < 0:
        raise InvalidRequest(f"sampling.temperature must be finite and >= 0, "
                             f"got {msg.temperature}")
    if not math.isfinite(msg.top_p) or not 0 <= msg.top_p <= 1:
        raise InvalidRequest(f"sampling.top_p must be in (0, 1] (0 = unset), got {msg.top_p}")
    if msg.seed > MAX_SEED:
        raise InvalidRequest(f"sampling.seed must be below 2**63, got {msg.seed}")
    return SamplingParams(temperature=float(msg.temperature), top_k=int(msg.top_k),
                          top_p=float(msg.top_p) if msg.top_p > 0 else 1.0, seed=int(msg.seed))


def draft_digest(msg: pb.Draft) -> bytes:
    """Identifies a round's content, so that a retry with other drafts is caught."""
    return hashlib.sha256(msg.SerializeToString(deterministic=True)).digest()


def parse_draft(msg: pb.Draft, limits: Limits) -> DraftRound:
    k = len(msg.token_ids)
    if k > limits.max_draft_len:
        raise InvalidRequest(f"draft has {k} tokens; this verifier accepts at most "
                             f"{limits.max_draft_len} per round")
    tokens = _check_token_ids(msg.token_ids, limits.vocab_size, "draft.token_ids")
    confidence = _parse_confidence(msg.confidence, k)
    if not msg.q:
        return DraftRound(tokens=tokens, q=None, confidence=confidence)
    if len(msg.q) != k:
        raise InvalidRequest(f"draft.q has {len(msg.q)} entries; it must be empty "
                             f"(point-mass drafts) or one per draft token ({k})")
    q = []
    for i, (token, dist) in enumerate(zip(tokens, msg.q, strict=True)):
        q.append(_parse_distribution(dist, token, i, limits.vocab_size))
    return DraftRound(tokens=tokens, q=q, confidence=confidence)


def _parse_confidence(values, k: int) -> list[float] | None:
    if not values:
        return None
    if len(values) != k:
        raise InvalidRequest(f"draft.confidence has {len(values)} entries; it must be empty "
                             f"or one per draft token ({k})")
    out = [float(c) for c in values]
    for i, c in enumerate(out):
        if not 0 <= c <= 1:  # also false for NaN
            raise InvalidRequest(f"draft.confidence[{i}] = {c} is not a probability in [0, 1]")
    return out


def _parse_distribution(dist: pb.SparseDistribution, drafted: int, i: int,
                        vocab_size: int) -> tuple[list[int], list[float]]:
    where = f"draft.q[{i}]"
    if len(dist.token_ids) != len(dist.probs):
        raise InvalidRequest(f"{where} has {len(dist.token_ids)} token_ids but "
                             f"{len(dist.probs)} probs")
    if not dist.token_ids:
        raise InvalidRequest(f"{where} is empty; it must contain the drafted token {drafted}")
    ids = np.fromiter(dist.token_ids, dtype=np.int64, count=len(dist.token_ids))
    probs = np.fromiter(dist.probs, dtype=np.float64, count=len(dist.probs))
    if ids.max() >= vocab_size:
        bad = int(ids[ids >= vocab_size][0])
        raise InvalidRequest(f"{where} token id {bad} is out of range [0, {vocab_size})")
    if np.unique(ids).size != ids.size:
        raise InvalidRequest(f"{where} lists a token id more than once")
    if not np.all(np.isfinite(probs)):
        raise InvalidRequest(f"{where} has a NaN or infinite probability")
    if np.any(probs < 0) or np.any(probs > 1):
        raise InvalidRequest(f"{where} has a probability outside [0, 1]")
    total = float(probs.sum())
    if total > 1 + PROB_SUM_TOLERANCE:
        raise InvalidRequest(f"{where} probabilities sum to {total:.6f} > 1")
    hit = np.nonzero(ids == drafted)[0]
    if hit.size == 0 or probs[hit[0]] <= 0:
        raise InvalidRequest(f"{where} gives the drafted token {drafted} no probability; "
                             "a draft token must be sampled from its q")
    return ids.tolist(), probs.tolist()


def parse_open(msg: pb.OpenSessionRequest, limits: Limits,
               default_stop_ids: frozenset[int]) -> OpenParams:
    if not msg.prompt_token_ids:
        raise InvalidRequest("prompt_token_ids is empty; send at least one token")
    prompt = _check_token_ids(msg.prompt_token_ids, limits.vocab_size, "prompt_token_ids")
    if len(prompt) + 1 > limits.max_context:
        raise ContextTooLong(f"prompt has {len(prompt)} tokens; the maximum context is "
                             f"{limits.max_context} including at least one new token")
    stop = _check_token_ids(msg.stop_token_ids, limits.vocab_size, "stop_token_ids")
    stop_ids = frozenset(stop) if stop else (frozenset() if msg.ignore_eos else default_stop_ids)
    has_draft = msg.HasField("first_draft")
    return OpenParams(
        prompt=prompt,
        sampling=parse_sampling(msg.sampling),
        max_new_tokens=int(msg.max_new_tokens),
        stop_token_ids=stop_ids,
        first_draft=parse_draft(msg.first_draft, limits) if has_draft else None,
        first_draft_digest=draft_digest(msg.first_draft) if has_draft else b"",
    )


def parse_session_id(session_id: str) -> str:
    if not is_well_formed_session_id(session_id):
        raise InvalidRequest("session_id must be the 32 lowercase hex characters returned "
                             "by OpenSession")
    return session_id


def result_to_pb(result: RoundResult) -> pb.RoundResult:
    return pb.RoundResult(
        round=result.round, num_accepted=result.num_accepted, next_token=result.next_token,
        committed_length=result.committed_length, finished=result.finished,
        target_forwards=result.target_forwards,
        timing=pb.Timing(queue_ns=result.queue_ns, forward_ns=result.forward_ns),
        suggested_draft_len=result.suggested_draft_len,
        draft_token_cost=result.draft_token_cost)


def parse_generate(msg: pb.GenerateRequest, limits: Limits,
                   default_stop_ids: frozenset[int]) -> OpenParams:
    """A cloud-only generation is a session without drafts."""
    return parse_open(pb.OpenSessionRequest(
        prompt_token_ids=msg.prompt_token_ids, sampling=msg.sampling,
        max_new_tokens=msg.max_new_tokens, stop_token_ids=msg.stop_token_ids,
        ignore_eos=msg.ignore_eos), limits, default_stop_ids)


def parse_lookahead(msg: pb.LookaheadDraft, limits: Limits, prompt_len: int,
                    committed_len: int) -> Lookahead:
    """A lookahead of a session whose prompt and committed lengths are these right now."""
    if not prompt_len <= msg.base_length <= committed_len:
        raise InvalidRequest(f"lookahead.base_length {msg.base_length} must be in "
                             f"[{prompt_len}, {committed_len}]: from the prompt length to "
                             "the committed length streamed so far")
    return Lookahead(int(msg.base_length), parse_draft(msg.draft, limits))
