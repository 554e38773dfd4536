"""The distilled draft committed in edge_client/drafts, the default, loads as the edge loads
it and speaks the target's vocabulary."""

from __future__ import annotations

import json

import numpy as np

from edge_client.draft_model import OnnxDraftModel
from edge_client.tokenizer import EdgeTokenizer
from shared.paths import default_draft_dir

SHIPPED = default_draft_dir()
SMOLLM2_VOCAB = 49152
MAX_BYTES = 50 * 10**6


def test_shipped_draft_is_small_and_documented():
    size = sum(f.stat().st_size for f in SHIPPED.iterdir())
    assert size <= MAX_BYTES, f"{size} bytes"
    card = (SHIPPED / "MODEL_CARD.md").read_text()
    for field in ("parameters", "steps", "wall time", "seed", "greedy_alpha", "int8"):
        assert field in card
    results = json.loads((SHIPPED / "distill_results.json").read_text())
    # Measured at export on the held-out prompts: int8 keeps the fp32 acceptance.
    assert results["int8"]["samples"] >= 100
    assert abs(results["int8"]["greedy_alpha"] - results["fp32"]["greedy_alpha"]) <= 0.02


def test_shipped_draft_drafts_over_the_full_vocabulary():
    model = OnnxDraftModel(SHIPPED)
    assert model.vocab_size == SMOLLM2_VOCAB
    tokenizer = EdgeTokenizer(SHIPPED)
    ids = tokenizer.encode_chat("What is the capital of France?")
    logits = model.forward(model.new_cache(), ids)
    assert logits.shape == (len(ids), SMOLLM2_VOCAB)
    assert np.isfinite(logits.max(axis=1)).all()
    # The reduced head puts -inf outside its subset; the argmax is a real token.
    assert tokenizer.decode([int(np.argmax(logits[-1]))]) != ""


def test_shipped_draft_tokenizer_matches_the_prepared_target(real_assets):
    target_dir, _ = real_assets
    assert EdgeTokenizer(SHIPPED).fingerprint == EdgeTokenizer(target_dir).fingerprint
