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
from dataclasses import replace

import torch

from cloud_verifier.attention import check_attention, default_attention
from cloud_verifier.device_timer import ForwardTimer
from cloud_verifier.errors import ContextTooLong, KVCacheFull
from cloud_verifier.features import FeatureServing
from cloud_verifier.kv_store import KVStore
from cloud_verifier.packed_forward import (
    Segment,
    packed_rows,
    sequential_logits,
    supports_packing,
)
from cloud_verifier.sessions import Session
from cloud_verifier.target_engine import DraftRound, RoundEngine, RoundOutcome
from shared.token_spelling import TokenSpelling

log = logging.getLogger(__name__)


def _sequential(model: torch.nn.Module, segments: list[Segment]) -> tuple[torch.Tensor, None]:
    return sequential_logits(model, segments), None


class VerifierEngine(RoundEngine):
    """The built-in engine (``cloud_verifier.target_engine.TargetEngine``): rounds on a loaded
    torch target. Not thread-safe: one ``run_batch`` at a time."""

    def __init__(self, model: torch.nn.Module, vocab_size: int, max_context: int,
                 kv_budget_bytes: int | None = None, attention: str | None = None,
                 features: FeatureServing | None = None,
                 spelling: TokenSpelling | None = None) -> None:
        """``attention``: how a packed forward runs attention (``cloud_verifier.attention``);
        None picks the default for the model's device and dtype. ``features``: what the
        sessions that ask get (None: none is served; only a packed forward captures them).
        ``spelling``: the tokenizer's token bytes, for sessions that continue with given
        bytes (None: no session may)."""
        super().__init__()
        self.model = model
        self.spelling = spelling
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
