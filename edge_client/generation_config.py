"""What a generation or a document asks of the client: ``GenerationConfig``.

Sampling, drafting, the server's hints to follow, the fallback and the latency budget apply to
every generation; the settle, healing and preview settings to documents only
(edge_client.document).
"""

from __future__ import annotations

from dataclasses import dataclass

from edge_client.combined_drafter import DRAFTER_KINDS
from edge_client.core import FAIL, FALLBACKS
from edge_client.drafter import DraftSampling
from edge_client.generation_state import SessionParams

# A document's settle time inside a word until it knows the typist's pace
# (GenerationConfig.word_settle_ms): longer than most key intervals inside a word.
WORD_SETTLE_MS = 150.0


@dataclass(frozen=True)
class GenerationConfig:
    max_new_tokens: int = 64
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    draft_len: int = 4
    # Cap on each q's support (see DraftSampling), within the verifier's max_q_support.
    max_support: int = 64
    # Stop drafting a round once the drafts' joint confidence is below this (DraftSampling);
    # 0 drafts all draft_len. Lossless either way. 0.1: a draft that would be accepted less
    # than one time in ten costs the device a step and the verifier a row for little; with
    # the verifier and the device on separate cores it made greedy generation 1.14x faster
    # at 0.8 % more target forwards per token (docs/benchmarks.md "Stopping a round early").
    stop_confidence: float = 0.1
    stop_token_ids: tuple[int, ...] = ()  # empty: the verifier's eos tokens
    ignore_eos: bool = False
    # One of DRAFTER_KINDS: "combined" (the default: per position, a copy where the text so far
    # repeats two or more earlier tokens, the ONNX model elsewhere), "model", "ngram" (prompt
    # lookup alone), or "feature" (the client's feature head, fed the verifier's target
    # features: edge_client.feature_drafter). Combined drafting commits 1.77 tokens per round
    # to the model's 1.64 on the realistic set (docs/benchmarks.md "Combined drafting").
    drafter: str = "combined"
    # Adapt to the server and the network: cap K by the server's suggested_draft_len, and
    # choose drafting or cloud-side decoding by measured rate (edge_client.rate_chooser).
    # Both depend on load, so sampled outputs would no longer be a function of the seed
    # (they stay exact in distribution). None (the default): documents (edge_client.document)
    # follow the suggested K, so that an IME's session stops drafting when its drafts keep
    # being rejected (acceptance collapse), but do not choose by rate; generations do
    # neither. True: both do both; False: neither does either.
    follow_suggested_draft_len: bool | None = None
    # When the verifier is unreachable or too slow: "fail" (retry within the retry budget,
    # then raise VerifierUnavailable) or "draft-only" (the draft goes on alone, its tokens
    # marked unverified, and they are verified when the verifier is back; edge_client.core).
    fallback: str = FAIL
    # A latency budget: past it a generation ends with the verified tokens it has, plus the
    # draft's unverified continuation: the drafts on their way to the verifier, and with
    # fallback="draft-only" the draft alone up to max_new_tokens. A document's suggestion
    # (edge_client.document) is bounded by it: no drafting alone past it unless the
    # suggestion would be empty. None: no budget.
    budget_ms: float | None = None
    # Documents only: a suggestion waits this long for the typing to settle before it sends
    # any work; a newer keystroke (or cancel()) in that time ends it with no RPC and no
    # forward. An IME typing 80-200 ms a key then pays the verifier for the keys the user
    # pauses after, not for every key. Counted within budget_ms. 0: send at once.
    settle_ms: float = 0.0
    # Documents only: while the text ends inside a word (its last character a letter or
    # digit) a suggestion waits a little longer than the typist's usual gap between keys
    # inside a word (edge_client.typing_pace), this long until that is known, and within
    # half to twice this: a suggestion for a key inside a word is stale by the next key.
    # After a space or punctuation, where the user looks for the suggestion, it is sent at
    # once (unless settle_ms says otherwise). 0: no such wait.
    word_settle_ms: float = WORD_SETTLE_MS
    # Documents only: token healing (shared.token_spelling). A text that ends inside a word
    # or with a space is backed up to the word's start, and the suggestion must begin with
    # the bytes backed over, so that the target spells the word itself: after "Can we meet "
    # SmolLM2 suggests "in the" instead of "10 times?". It also lets a suggestion the user
    # types along stand (edge_client.document: type-through). Needs a byte-level tokenizer
    # and a verifier that takes continue_with (GetInfo.max_continue_with); off otherwise.
    heal: bool = True
    # Documents only: while a suggestion waits for the typing to settle, on_update is first
    # given the draft's own continuation (Suggestion.preview, its tokens unverified): a key
    # inside a word gets a suggestion at once, with no RPC and no forward, and the verified
    # suggestion replaces it if the typing settles. Greedy documents only, with any drafter
    # but the feature head (which has no target feature before the first round).
    preview: bool = True

    def __post_init__(self) -> None:
        if self.fallback not in FALLBACKS:
            raise ValueError(f"fallback must be one of {', '.join(FALLBACKS)}, "
                             f"got {self.fallback!r}")
        if self.budget_ms is not None and not self.budget_ms > 0:
            raise ValueError("budget_ms must be > 0 (or None)")
        if not self.settle_ms >= 0:
            raise ValueError("settle_ms must be >= 0")
        if not self.word_settle_ms >= 0:
            raise ValueError("word_settle_ms must be >= 0")
        if self.drafter not in DRAFTER_KINDS:
            raise ValueError(f"drafter must be one of {', '.join(DRAFTER_KINDS)}, "
                             f"got {self.drafter!r}")
        if self.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        if self.draft_len < 0:
            raise ValueError("draft_len must be >= 0")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")
        self.draft_sampling(self.max_support)  # checks stop_confidence

    def draft_sampling(self, q_support: int) -> DraftSampling:
        """How the device drafts, with q's support capped at ``q_support``."""
        return DraftSampling(self.temperature, self.top_k, self.top_p, q_support,
                             self.stop_confidence)

    def session_params(self) -> SessionParams:
        return SessionParams(max_new_tokens=self.max_new_tokens, temperature=self.temperature,
                             top_k=self.top_k, top_p=self.top_p, seed=self.seed,
                             stop_token_ids=tuple(self.stop_token_ids),
                             ignore_eos=self.ignore_eos)
