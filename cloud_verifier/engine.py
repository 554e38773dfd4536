"""Verification rounds on the target model, for one session or many at once.

KV layout (per session, between rounds): the session's KV buffer holds every committed token
except the last. A round feeds ``committed[kv.length:] + [d_1 .. d_K]``; the last K+1 logit
rows are p_1 .. p_{K+1} (p_i judges d_i, p_{K+1} gives the bonus). Usually the uncached tail is
just the last committed token; on the first round it is the whole prompt, so opening a session
with a draft costs one forward in total. After the decision ``kv.length`` is set to the new
``len(committed) - 1``: that is the rollback of the rejected tail, explicit on every round.

``run_batch`` verifies the rounds of many sessions in one packed forward
(``cloud_verifier.packed_forward``); the accept/reject decisions then run per session with the
session's own generator, in the same order as when run alone, so batched results equal
sessions run one at a time.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from cloud_verifier.errors import ContextTooLong, KVCacheFull
from cloud_verifier.kv_store import KVBudgetExceeded, KVStore
from cloud_verifier.packed_forward import (
    Segment,
    packed_forward,
    sequential_forward,
    supports_packing,
)
from cloud_verifier.sampling import target_probs
from cloud_verifier.sessions import Session, position_seed
from cloud_verifier.verification import sparse_to_dense, verify, verify_greedy

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DraftRound:
    """The drafts of one round, already validated against the vocabulary."""

    tokens: list[int]  # [K]
    # Sparse q per position as (token ids, probs); None when every draft is a point mass.
    q: list[tuple[list[int], list[float]]] | None
    # The draft's confidence in each d_i (shared.draft_length); None when not sent.
    confidence: list[float] | None = None

    def window(self, start: int, stop: int) -> DraftRound:
        """Drafts d_{start+1} .. d_stop with their q and confidences."""
        q, c = self.q, self.confidence
        return DraftRound(self.tokens[start:stop], None if q is None else q[start:stop],
                          None if c is None else c[start:stop])


# A round without drafts: one plain target step (K = 0).
NO_DRAFT = DraftRound([], None)


@dataclass(frozen=True)
class RoundOutcome:
    num_accepted: int
    next_token: int
    # Tokens this round appended to the session (d_1..d_n, next_token, cut at a finish).
    committed: list[int]
    finished: bool
    forward_ns: int
    batch_sessions: int = 1
    batch_tokens: int = 0
    fed_tokens: int = 0  # positions this round fed (uncached tail + drafts)


class VerifierEngine:
    """Runs rounds on a loaded target. Not thread-safe: one ``run_batch`` at a time."""

    def __init__(self, model: torch.nn.Module, vocab_size: int, max_context: int,
                 kv_budget_bytes: int | None = None) -> None:
        self.model = model
        self._forward = packed_forward if supports_packing(model) else sequential_forward
        if self._forward is sequential_forward:
            log.warning("%s is not Llama-family: verifying one session per forward",
                        type(model).__name__)
        self.vocab_size = vocab_size
        self.max_context = max_context
        cfg = model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        param = next(model.parameters())
        self.kv = KVStore(cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim,
                          param.dtype, param.device, kv_budget_bytes, max_context)

    def check_room(self, committed_len: int, k: int) -> None:
        """A round may commit up to K+1 tokens; all of them must fit in the context."""
        if committed_len + k + 1 > self.max_context:
            room = self.max_context - committed_len - 1
            hint = f"send at most {room} drafts" if room >= 0 else "the session is full"
            raise ContextTooLong(
                f"committed length {committed_len} + {k} drafts + 1 would exceed the "
                f"maximum context {self.max_context}; {hint}")

    def kv_growth_bytes(self, rounds: list[tuple[Session, DraftRound]]) -> int:
        """KV bytes these rounds would add (buffers that must be allocated or grown)."""
        return sum(self.kv.growth_bytes(s.kv, len(s.committed) + len(d.tokens))
                   for s, d in rounds)

    def apply_edit(self, session: Session, keep: int, append: list[int]) -> None:
        """Rewrites an editable session's text to ``committed[:keep] + append`` and rolls its
        KV cache back to the kept tokens (explicit: ``SessionKV.crop``). The next round feeds
        only what follows them: ``append`` plus its drafts."""
        if not 0 <= keep <= len(session.committed):
            raise ValueError(f"keep {keep} outside [0, {len(session.committed)}]")
        session.committed[keep:] = append
        if session.kv is not None:
            # The cache never covers the last committed token: its logits start the next round.
            session.kv.crop(min(keep, len(session.committed) - 1))

    def release(self, session: Session) -> None:
        self.kv.release(session.kv)
        session.kv = None

    def run_round(self, session: Session, draft: DraftRound) -> RoundOutcome:
        outcome = self.run_batch([(session, draft)])[0]
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    def run_batch(self, rounds: list[tuple[Session, DraftRound]]
                  ) -> list[RoundOutcome | Exception]:
        """One forward for all rounds; a round that cannot run gets its exception instead."""
        results: list[RoundOutcome | Exception | None] = [None] * len(rounds)
        ready: list[int] = []
        segments: list[Segment] = []
        for i, (session, draft) in enumerate(rounds):
            try:
                self.reserve(session, draft)
            except (ContextTooLong, KVCacheFull) as exc:
                results[i] = exc
                continue
            ready.append(i)
            segments.append(Segment(session.kv, session.committed[session.kv.length:]
                                    + draft.tokens, len(draft.tokens) + 1))
        if segments:
            t0 = time.perf_counter_ns()
            logits = self._forward(self.model, segments)  # each [K+1, V]
            forward_ns = time.perf_counter_ns() - t0
            batch_tokens = sum(len(s.tokens) for s in segments)
            for i, segment, rows in zip(ready, segments, logits, strict=True):
                session, draft = rounds[i]
                results[i] = self._decide(session, draft, rows.cpu(), forward_ns,
                                          len(segments), batch_tokens, len(segment.tokens))
        return results  # type: ignore[return-value]

    def reserve(self, session: Session, draft: DraftRound) -> None:
        """Checks the context and gives the session KV room for everything this round feeds
        (the cache covers committed[:-1]); a session without a cache gets one for its whole
        context, which the forward then recomputes."""
        self.check_room(len(session.committed), len(draft.tokens))
        try:
            session.kv = self.kv.ensure(session.kv, len(session.committed) + len(draft.tokens))
        except KVBudgetExceeded as exc:
            raise KVCacheFull(str(exc)) from None

    def round_bytes(self, session: Session, draft: DraftRound) -> int:
        """KV bytes the round needs in all, counting what the session already holds."""
        return (len(session.committed) + len(draft.tokens)) * self.kv.bytes_per_token

    def _decide(self, session: Session, draft: DraftRound, rows: torch.Tensor, forward_ns: int,
                batch_sessions: int, batch_tokens: int, fed: int) -> RoundOutcome:
        if session.sampling.is_greedy:
            n, next_token = verify_greedy(draft.tokens, rows)
        else:
            p = target_probs(rows, session.sampling)  # [K+1, V]
            q = None if draft.q is None else sparse_to_dense(
                [ids for ids, _ in draft.q], [ps for _, ps in draft.q], self.vocab_size)
            session.generator.manual_seed(position_seed(session.sampling.seed,
                                                        len(session.committed)))
            n, next_token = verify(draft.tokens, q, p, session.generator)
        appended, finished = self._commit(session, draft.tokens[:n] + [next_token])
        # Rollback: only committed[:-1] stays valid; later positions will be overwritten.
        session.kv.length = len(session.committed) - 1
        return RoundOutcome(n, next_token, appended, finished, forward_ns, batch_sessions,
                            batch_tokens, fed)

    def _commit(self, session: Session, tokens: list[int]) -> tuple[list[int], bool]:
        appended: list[int] = []
        for token in tokens:
            session.committed.append(token)
            appended.append(token)
            if token in session.stop_token_ids or (
                    session.max_new_tokens and session.num_generated >= session.max_new_tokens):
                session.finished = True
                break
        # A session that cannot take even a K = 0 round is done.
        if len(session.committed) + 1 > self.max_context:
            session.finished = True
        return appended, session.finished
