"""Verification rounds on the target model, for one session or many at once.

KV layout (per session, between rounds): the session's KV buffer holds every committed token
except the last. A round feeds ``committed[kv.length:] + [d_1 .. d_K]``; the last K+1 logit
rows are p_1 .. p_{K+1} (p_i judges d_i, p_{K+1} gives the bonus). Usually the uncached tail is
just the last committed token; on the first round it is the whole prompt, so opening a session
with a draft costs one forward in total. After the decision ``kv.length`` is set to the new
``len(committed) - 1``: that is the rollback of the rejected tail, explicit on every round.

``run_batch`` verifies the rounds of many sessions in one packed forward
(``cloud_verifier.packed_forward``), then decides all of them at once on the device that holds
the logits (``cloud_verifier.batched_verification``) and reads the decisions back in one host
copy. Each session's uniforms come from its own generator, seeded from (session seed,
committed length), so batched results equal sessions run one at a time, and equal the
per-session reference (``cloud_verifier.verification``) bit for bit on the CPU.

Token healing (``Session.continue_with``, ``shared.token_spelling``): while a session's new
tokens have not yet spelled the bytes it must continue with, each of its rows is masked to
the tokens consistent with what is left of them, walking the round's drafts (a draft that is
not consistent is rejected by the mask itself: p gives it 0), before the decisions; the
committed tokens then advance what is left.

Target features (``cloud_verifier.features``): for each session that asked, the forward's
final-norm hidden state at the row that decided the session's last committed token (row j of
its K+1 decided the j+1-th token it appended) is copied to the host, for all of them at once
after the decisions, and encoded. Sessions that did not ask cost nothing; the logits and the
decisions are the same either way (the rows are what the LM head read).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, replace

import torch

from cloud_verifier.attention import check_attention, default_attention
from cloud_verifier.batched_verification import round_uniforms, verify_batch
from cloud_verifier.device_timer import ForwardTimer
from cloud_verifier.errors import ContextTooLong, KVCacheFull
from cloud_verifier.features import FeatureServing
from cloud_verifier.kv_store import KVBudgetExceeded, KVStore
from cloud_verifier.packed_forward import (
    Segment,
    packed_rows,
    sequential_logits,
    supports_packing,
)
from cloud_verifier.sessions import Session, position_seed
from shared.feature_codec import EncodedFeature
from shared.token_spelling import TokenSpelling

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
    # Sessions that want features: the one that decided committed[feature_position] (the
    # last committed token).
    feature: EncodedFeature | None = None
    feature_position: int = 0


def _sequential(model: torch.nn.Module, segments: list[Segment]) -> tuple[torch.Tensor, None]:
    return sequential_logits(model, segments), None


class VerifierEngine:
    """Runs rounds on a loaded target. Not thread-safe: one ``run_batch`` at a time."""

    def __init__(self, model: torch.nn.Module, vocab_size: int, max_context: int,
                 kv_budget_bytes: int | None = None, attention: str | None = None,
                 features: FeatureServing | None = None,
                 spelling: TokenSpelling | None = None) -> None:
        """``attention``: how a packed forward runs attention (``cloud_verifier.attention``);
        None picks the default for the model's device and dtype. ``features``: what the
        sessions that ask get (None: none is served; only a packed forward captures them).
        ``spelling``: the tokenizer's token bytes, for sessions that continue with given
        bytes (None: no session may)."""
        self.model = model
        self.spelling = spelling
        self._masks: dict[bytes, torch.Tensor] = {}  # rest -> [V] bool, True: not allowed
        param = next(model.parameters())
        self.attention = attention or default_attention(param.device, param.dtype)
        check_attention(self.attention, param.device)
        # -> (logits, final-norm hidden rows or None)
        self._forward = functools.partial(packed_rows, attention=self.attention) \
            if supports_packing(model) else _sequential
        self.features = features if supports_packing(model) else None
        if not supports_packing(model):
            log.warning("%s is not Llama-family: verifying one session per forward",
                        type(model).__name__)
        self.vocab_size = vocab_size
        self.max_context = max_context
        cfg = model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
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
            timer = ForwardTimer(self.kv.device)
            timer.start()
            logits, hidden = self._forward(self.model, segments)  # [sum(K+1), V], [.., d]
            timer.stop()
            batch = [rounds[i] for i in ready]
            decisions = self._decide(batch, logits)  # waits for the device: one host copy
            forward_ns = timer.elapsed_ns()
            batch_tokens = sum(len(s.tokens) for s in segments)
            offset, feature_rows = 0, []  # (result index, logits row of its feature)
            for i, segment, (session, draft), (n, next_token, valid) in zip(
                    ready, segments, batch, decisions, strict=True):
                results[i] = self._apply(session, draft, n, next_token, forward_ns,
                                         len(segments), batch_tokens,
                                         len(segment.tokens)) if valid else \
                    RuntimeError("the target's logits for this round have a NaN or no finite "
                                 "maximum")
                if valid and session.want_feature and self.features is not None:
                    feature_rows.append((i, offset + len(results[i].committed) - 1))
                offset += segment.num_logits
            if feature_rows:
                self._attach_features(results, hidden, feature_rows, rounds)
        return results  # type: ignore[return-value]

    def _attach_features(self, results: list, hidden: torch.Tensor,
                         feature_rows: list[tuple[int, int]],
                         rounds: list[tuple[Session, DraftRound]]) -> None:
        """Encodes each wanting session's feature row into its outcome (one host copy)."""
        index = torch.tensor([row for _, row in feature_rows], device=hidden.device)
        rows = hidden.index_select(0, index).float().cpu().numpy()
        for (i, _), feature in zip(feature_rows, self.features.encode(rows), strict=True):
            session = rounds[i][0]
            results[i] = replace(results[i], feature=feature,
                                             feature_position=len(session.committed) - 1)

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
