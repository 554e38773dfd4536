"""One verification round on the target model, for one session.

KV layout (per session, between rounds): the cache holds every committed token except the
last one. A round feeds ``committed[cache_len:] + [d_1 .. d_K]`` in one forward pass; the
last K+1 logits rows are p_1 .. p_{K+1} (p_i judges d_i, p_{K+1} gives the bonus). Usually
``committed[cache_len:]`` is just the last committed token; on the first round it is the whole
prompt, so opening a session with a draft costs one forward in total. After the decision the
cache is cropped back to the new ``committed[:-1]``: that crop is the rollback of the rejected
tail, done explicitly on every round.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from cloud_verifier.errors import ContextTooLong
from cloud_verifier.sessions import Session
from shared.sampling import target_probs
from shared.verification import sparse_to_dense, verify, verify_greedy

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DraftRound:
    """The drafts of one round, already validated against the vocabulary."""

    tokens: list[int]  # [K]
    # Sparse q per position as (token ids, probs); None when every draft is a point mass.
    q: list[tuple[list[int], list[float]]] | None


@dataclass(frozen=True)
class RoundOutcome:
    num_accepted: int
    next_token: int
    # Tokens this round appended to the session (d_1..d_n, next_token, cut at a finish).
    committed: list[int]
    finished: bool
    forward_ns: int


class VerifierEngine:
    """Runs rounds on a loaded target. Not thread-safe: the caller runs one round at a time."""

    def __init__(self, model: torch.nn.Module, vocab_size: int, max_context: int) -> None:
        self.model = model
        self.vocab_size = vocab_size
        self.max_context = max_context
        self.device = next(model.parameters()).device

    def check_room(self, session: Session, k: int) -> None:
        """A round may commit up to K+1 tokens; all of them must fit in the context."""
        needed = len(session.committed) + k + 1
        if needed > self.max_context:
            room = self.max_context - len(session.committed) - 1
            hint = f"send at most {room} drafts" if room >= 0 else "the session is full"
            raise ContextTooLong(
                f"committed length {len(session.committed)} + {k} drafts + 1 would exceed the "
                f"maximum context {self.max_context}; {hint}")

    def run_round(self, session: Session, draft: DraftRound) -> RoundOutcome:
        k = len(draft.tokens)
        self.check_room(session, k)
        t0 = time.perf_counter_ns()
        rows = self._forward(session, draft.tokens)  # [K+1, V] float32, cpu
        forward_ns = time.perf_counter_ns() - t0

        if session.sampling.is_greedy:
            n, next_token = verify_greedy(draft.tokens, rows)
        else:
            p = target_probs(rows, session.sampling)  # [K+1, V]
            q = None if draft.q is None else sparse_to_dense(
                [ids for ids, _ in draft.q], [ps for _, ps in draft.q], self.vocab_size)
            n, next_token = verify(draft.tokens, q, p, session.generator)

        appended, finished = self._commit(session, draft.tokens[:n] + [next_token])
        # Rollback: drop the rejected drafts' keys/values; keep committed[:-1].
        session.kv_cache.crop(len(session.committed) - 1)
        return RoundOutcome(n, next_token, appended, finished, forward_ns)

    def _forward(self, session: Session, drafts: list[int]) -> torch.Tensor:
        if session.kv_cache is None:
            session.kv_cache = DynamicCache()
        cache_len = session.cache_len
        inputs = session.committed[cache_len:] + drafts
        ids = torch.tensor([inputs], dtype=torch.long, device=self.device)
        try:
            with torch.inference_mode():
                out = self.model(input_ids=ids, past_key_values=session.kv_cache,
                                 use_cache=True, logits_to_keep=len(drafts) + 1)
        except BaseException:
            # Some layers may already hold the new keys: restore the pre-round cache.
            session.kv_cache.crop(cache_len)
            raise
        return out.logits[0, -(len(drafts) + 1):].float().cpu()

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
