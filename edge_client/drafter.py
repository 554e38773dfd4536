"""The draft loop on the device: propose K tokens with the ONNX draft and record the exact
sparse q each one was sampled from; keep the draft KV cache in step with what the verifier
committed.

Cache invariant: the draft cache holds a prefix of ``committed`` plus, right after a
proposal, the drafts d_1..d_{K-1} (d_K is sampled but never fed). Before every proposal,
``resync`` crops the cache to the longest prefix it shares with the committed tokens, and
never past ``committed[:-1]`` because the next draft needs the logits after the last
committed token. The tokens not yet cached (the correction or bonus token, and after a fully
accepted round also d_K) are then fed in one forward. That feed of d_K is the step many
implementations forget.

With a ``lookup`` (the combined drafter: ``edge_client.ngram_drafter.ContextLookup``), each
position asks the lookup first and the model only where it has nothing, so a round can mix
copied tokens and model tokens. The model is fed lazily: only when its logits are needed,
everything since its cache's end in one forward; a round the lookup drafts whole runs no
model forward. In sampling mode a copied token travels as the point mass it was drawn from,
q = {token: 1}. The choice per position depends on the context alone, not on what is drawn
there, so verification stays lossless.

Token healing (``spell``: the tokenizer's spelling and the bytes the new tokens must still
begin with, ``shared.token_spelling``): while bytes are left to spell, a copy must be
consistent with them and the model's row is restricted to the consistent tokens before q is
taken, as the verifier restricts the target's; drafting stops where no drafted column is.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from edge_client.draft_model import OnnxDraftModel
from edge_client.sampling import sample, truncated_distribution
from shared.token_spelling import TokenSpelling

# What a proposal must spell first: the spelling table and the bytes left (b"": nothing).
Spell = tuple[TokenSpelling, bytes]


@dataclass(frozen=True)
class DraftSampling:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    # Cap on q's support, so the wire payload stays small whatever the temperature.
    max_support: int = 64
    # Stop a round's drafting once the drafts' joint confidence (the product of each draft's
    # confidence: its q's top probability, or a copy's measured hit rate) is below this; at
    # least one draft is always made. 0 drafts all K. A function of q, never of the drawn
    # token, so lossless (docs/design.md).
    stop_confidence: float = 0.0

    def __post_init__(self) -> None:
        if not 0 <= self.stop_confidence < 1:
            raise ValueError(f"stop_confidence must be in [0, 1), got {self.stop_confidence}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class Proposal:
    tokens: list[int]  # [K]
    # Per position (ids, probs) of the q sampled from; None for argmax (point-mass) drafts.
    q: list[tuple[np.ndarray, np.ndarray]] | None
    # The draft's probability of each greedy d_i (shared.draft_length); None if not known.
    confidence: list[float] | None = None

    def prefix(self, k: int) -> Proposal:
        q, c = self.q, self.confidence
        return Proposal(self.tokens[:k], None if q is None else q[:k],
                        None if c is None else c[:k])


# A per-position proposal that needs no model: (token, chance it is the target's) or None.
Lookup = Callable[[Sequence[int]], "tuple[int, float] | None"]
_POINT_MASS = np.ones(1, dtype=np.float32)


class ModelDrafter:
    def __init__(self, model: OnnxDraftModel, sampling: DraftSampling,
                 rng: np.random.Generator, lookup: Lookup | None = None) -> None:
        self.model = model
        self.sampling = sampling
        self.rng = rng
        self.lookup = lookup
        self.cache = model.new_cache()
        self._fed: list[int] = []  # the tokens whose keys/values the cache holds
        self.forward_calls = 0
        self._columns: dict[bytes, np.ndarray] = {}  # rest -> drafted columns allowed

    def resync(self, committed: list[int]) -> int:
        """Explicit rollback: crop to the prefix shared with ``committed[:-1]``."""
        limit = min(len(self._fed), len(committed) - 1)
        keep = 0
        while keep < limit and self._fed[keep] == committed[keep]:
            keep += 1
        if keep < len(self._fed):
            self.cache.crop(keep)
            del self._fed[keep:]
        return keep

    def propose(self, committed: list[int], k: int, spell: Spell | None = None) -> Proposal:
        """Drafts k tokens after ``committed`` (k = 0 only resyncs); with ``spell``, tokens
        that begin to spell its bytes (fewer, if the draft has none)."""
        self.resync(committed)
        if k == 0:
            return Proposal([], None)
        spelling, rest = spell if spell is not None else (None, b"")
        context = list(committed)  # committed + the drafts so far
        tokens: list[int] = []
        q: list[tuple[np.ndarray, np.ndarray]] = []
        confidence: list[float] = []
        s = self.sampling
        joint = 1.0  # the product of the drafts' confidences so far
        for _ in range(k):
            if tokens and joint < s.stop_confidence:
                break
            hit = self.lookup(context) if self.lookup is not None else None
            if hit is not None and rest and spelling.advance(rest, hit[0]) is None:
                hit = None
            if hit is not None:
                token, sure = hit
                q.append((np.array([token], dtype=np.int64), _POINT_MASS))
            else:
                # The cache holds a prefix of context, never all of it: resync keeps it short
                # of the last committed token, and each draft joins context before it is fed.
                logits, vocab = self._feed(context[len(self._fed):])
                if rest:
                    allowed = self._allowed_columns(spelling, rest, vocab)
                    if not allowed.any():
                        break
                    logits = np.where(allowed, logits, -np.inf)
                if s.is_greedy:
                    token = int(vocab[np.argmax(logits)])
                    sure = top_probability(logits)
                else:
                    cols, probs = truncated_distribution(logits, s.temperature, s.top_k,
                                                         s.top_p, s.max_support)
                    ids = vocab[cols]
                    token = sample(ids, probs, self.rng)
                    sure = float(probs[0])  # q's top probability, whatever was drawn
                    q.append((ids, probs))
            confidence.append(sure)
            joint *= sure
            tokens.append(token)
            context.append(token)
            if rest:
                rest = spelling.advance(rest, token)
        if s.is_greedy:
            return Proposal(tokens, None, confidence)
        return Proposal(tokens, q)

    def _allowed_columns(self, spelling: TokenSpelling, rest: bytes,
                         vocab: np.ndarray) -> np.ndarray:
        """Which of the draft's columns (full ids ``vocab``) are consistent with ``rest``."""
        mask = self._columns.get(rest)
        if mask is None:
            mask = np.isin(vocab, spelling.allowed(rest))
            if len(self._columns) >= 256:
                self._columns.clear()
            self._columns[rest] = mask
        return mask

    def _feed(self, tokens: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """Feeds ``tokens``; the last row of logits over the draft's own vocabulary and the
        full ids of its columns (OnnxDraftModel.forward_compact)."""
        logits, vocab = self.model.forward_compact(self.cache, tokens)  # [n, M], [M]
        self._fed.extend(tokens)
        self.forward_calls += 1
        return logits[-1], vocab


def top_probability(logits: np.ndarray) -> float:
    """The softmax probability of the argmax: a greedy draft's confidence in its token.
    float32 exponentials (summed in float64): a confidence steers how far to draft, never
    what q is, and float64 exponentials of a 49k row cost a draft step a fifth of its time."""
    z = np.asarray(logits, dtype=np.float32)
    e = np.exp(z - z.max())
    return float(1.0 / e.sum(dtype=np.float64))
