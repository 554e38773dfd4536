"""The engine boundary: what a verification round needs from whatever runs the target.

Two engines implement it: ``cloud_verifier.engine.VerifierEngine`` (this project's packed
torch forward and KV store, the default) and ``cloud_verifier.vllm_engine.VllmEngine`` (the
target on vLLM, ``edgespec-verifier --engine vllm``). The batcher (``cloud_verifier.batcher``)
and the session table (``cloud_verifier.rounds``) talk to an engine only through
``TargetEngine``; the protocol, the clients and the benchmarks never see which one runs.

A round is: the session's committed tokens, K drafts d_1..d_K with their q (``DraftRound``),
one target pass that yields p_1..p_{K+1}, the decision (``RoundDecisions``, the same code for
both engines: lossless speculative sampling, greedy identity, token-healing masks), and the
commit of the accepted prefix plus one correction or bonus token (``RoundOutcome``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from cloud_verifier.batched_verification import round_uniforms, verify_batch
from cloud_verifier.errors import ContextTooLong, KVCacheFull
from cloud_verifier.features import FeatureServing
from cloud_verifier.kv_store import KVBudgetExceeded, KVStore
from cloud_verifier.sessions import Session, position_seed
from shared.feature_codec import EncodedFeature
from shared.token_spelling import TokenSpelling


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
    # Sessions that want features: the one that decided committed[feature_position] (the
    # last committed token).
    feature: EncodedFeature | None = None
    feature_position: int = 0


class TargetEngine(Protocol):
    """What the batcher and the session table call. ``run_batch`` runs on the torch thread,
    one at a time; the rest on the event loop."""

    vocab_size: int
    max_context: int
    kv: KVStore  # the memory the batcher's admission sees (vLLM's reports no budget)
    features: FeatureServing | None  # target features for the sessions that ask, or None
    spelling: TokenSpelling | None  # token bytes for token healing, or None

    def check_room(self, committed_len: int, k: int) -> None:
        """Raises ContextTooLong unless K drafts and a bonus fit in the context."""

    def reserve(self, session: Session, draft: DraftRound) -> None:
        """Gives the session room for the round (KVCacheFull when it cannot have it)."""

    def kv_growth_bytes(self, rounds: list[tuple[Session, DraftRound]]) -> int:
        """KV bytes these rounds would add."""

    def round_bytes(self, session: Session, draft: DraftRound) -> int:
        """KV bytes the round needs in all, counting what the session already holds."""

    def run_batch(self, rounds: list[tuple[Session, DraftRound]]
                  ) -> list[RoundOutcome | Exception]:
        """Scores and decides every round (one target pass where the engine can), commits
        each session's accepted prefix plus one token; a round that cannot run gets its
        exception instead."""

    def apply_edit(self, session: Session, keep: int, append: list[int]) -> None:
        """Rewrites an editable session's text to ``committed[:keep] + append``."""

    def release(self, session: Session) -> None:
        """Frees what the engine holds for the session."""


class RoundEngine:
    """What both engines share: room checks, KV reservation through the engine's ledger, edits,
    and the decision and commit of rounds from the target's rows.

    Subclasses set ``vocab_size``, ``max_context``, ``spelling`` and ``kv`` (a ledger with
    ``ensure``, ``growth_bytes`` and ``release``, as ``cloud_verifier.kv_store.KVStore``), and
    their ``run_batch`` calls ``_decide`` with the rows p_1..p_{K+1} of every round, stacked
    ``[sum(K+1), V]``, then ``_apply`` per round."""

    vocab_size: int
    max_context: int
    spelling: TokenSpelling | None
    kv: KVStore

    def __init__(self) -> None:
        self._masks: dict[bytes, torch.Tensor] = {}  # rest -> [V] bool, True: not allowed

    def check_room(self, committed_len: int, k: int) -> None:
        """A round may commit up to K+1 tokens; all of them must fit in the context."""
        if committed_len + k + 1 > self.max_context:
            room = self.max_context - committed_len - 1
            hint = f"send at most {room} drafts" if room >= 0 else "the session is full"
            raise ContextTooLong(
                f"committed length {committed_len} + {k} drafts + 1 would exceed the "
                f"maximum context {self.max_context}; {hint}")

    def run_round(self, session: Session, draft: DraftRound) -> RoundOutcome:
        outcome = self.run_batch([(session, draft)])[0]
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    def _decide(self, rounds: list[tuple[Session, DraftRound]], logits: torch.Tensor
                ) -> list[tuple[int, int, bool]]:
        """(n, next token, valid) per round, decided together on the logits' device."""
        self._mask_spelling(rounds, logits)
        k_max = max(len(d.tokens) for _, d in rounds)
        uniforms = []  # [B, Kmax+1]: drawn here, from each session's own generator
        for session, draft in rounds:
            row = [0.0] * (k_max + 1)
            if not session.sampling.is_greedy:
                k = len(draft.tokens)
                session.generator.manual_seed(position_seed(session.sampling.seed,
                                                            len(session.committed)))
                row[:k + 1] = round_uniforms(session.generator, k).tolist()
            uniforms.append(row)
        return verify_batch(logits, [d.tokens for _, d in rounds], [d.q for _, d in rounds],
                            [s.sampling for s, _ in rounds],
                            torch.tensor(uniforms, dtype=torch.float64)).tolist()

    def _mask_spelling(self, rounds: list[tuple[Session, DraftRound]],
                       logits: torch.Tensor) -> None:
        """Restricts the rows of sessions that must still spell bytes (in place; the forward
        made the logits under inference mode, which alone may write them)."""
        if not any(session.continue_with for session, _ in rounds):
            return
        with torch.inference_mode():
            self._mask_rows(rounds, logits)

    def _mask_rows(self, rounds: list[tuple[Session, DraftRound]],
                   logits: torch.Tensor) -> None:
        offset = 0
        for session, draft in rounds:
            rest = session.continue_with
            for j in range(len(draft.tokens) + 1):
                if not rest:
                    break
                logits[offset + j].masked_fill_(self._disallowed(rest, logits), float("-inf"))
                if j < len(draft.tokens):
                    rest = self.spelling.advance(rest, draft.tokens[j])
                    if rest is None:  # this draft is rejected here: later rows do not count
                        break
            offset += len(draft.tokens) + 1

    def _disallowed(self, rest: bytes, logits: torch.Tensor) -> torch.Tensor:
        mask = self._masks.get(rest)
        if mask is None:
            mask = torch.ones(logits.shape[1], dtype=torch.bool)
            allowed = self.spelling.allowed(rest)
            mask[torch.from_numpy(allowed[allowed < logits.shape[1]])] = False
            mask = mask.to(logits.device)
            if len(self._masks) >= 256:
                self._masks.clear()
            self._masks[rest] = mask
        return mask

    def _apply(self, session: Session, draft: DraftRound, n: int, next_token: int,
               forward_ns: int, batch_sessions: int, batch_tokens: int, fed: int
               ) -> RoundOutcome:
        appended, finished = self._commit(session, draft.tokens[:n] + [next_token])
        # Rollback: only committed[:-1] stays valid; later positions will be overwritten.
        session.kv.length = len(session.committed) - 1
        return RoundOutcome(n, next_token, appended, finished, forward_ns, batch_sessions,
                            batch_tokens, fed)

    def _commit(self, session: Session, tokens: list[int]) -> tuple[list[int], bool]:
        appended: list[int] = []
        for token in tokens:
            if session.continue_with:
                # The masks guarantee a consistent token; None would be a bug in them.
                rest = self.spelling.advance(session.continue_with, token)
                if rest is None:
                    raise RuntimeError("a committed token breaks the session's spelling")
                session.continue_with = rest
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
