"""Type-through under sampling: a suggestion that keeps the tokens of the last one because the
user typed along it must be a draw of the same law as a fresh session over the new text.

Each run opens a document, asks for a sampled suggestion after a text that ends in " a", then
for the text that ends in " aa" (the user typed "a", whatever was shown). When the first
suggestion began with " aa", the document keeps it (type-through, no RPC); otherwise the
verifier draws a new one. The second suggestion's tokens, over all runs, must follow the
target's law after the healed text: the first token p restricted to the tokens that begin
with " aa" (then truncated and renormalised as the sampling says), the second token p after
the first, unrestricted. Tiny models over real gRPC (tests/test_document_healing.py's toy
spelling)."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import numpy as np
import pytest
import torch
from test_document_healing import CONFIG, TOY, spell, spelled  # noqa: F401 - fixture
from test_editing import one_torch_thread  # noqa: F401 - autouse

from edge_client.client import AsyncEdgeClient

RUNS = 1000
ID = {TOY.token_bytes(i): i for i in range(3, 96)}
# A context where top-3 truncation after the mask makes the bug visible: kept from the old
# text's top 3, the first token's law would be 0.23 in total variation from the fresh one's.
BEFORE = [1, 40, 87, ID[b" a"]]  # the user types "a" next
AFTER = BEFORE[:-1] + [ID[b" aa"]]


def law(model, ids: list[int], allowed: np.ndarray | None, temperature: float,
        top_k: int) -> np.ndarray:
    """The target's next-token law after ``ids``, restricted to ``allowed`` (None: all), at
    ``temperature``, cut to its ``top_k`` most probable tokens (0: no cut); written out
    here rather than taken from the verifier's sampling code."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0, -1].double().numpy()
    z = np.full_like(logits, -np.inf)
    keep = np.arange(len(logits)) if allowed is None else allowed
    z[keep] = logits[keep] / temperature
    if top_k:
        z[np.argsort(-z, kind="stable")[top_k:]] = -np.inf
    p = np.exp(z - z.max())
    return p / p.sum()


def close_to(counts: np.ndarray, p: np.ndarray) -> tuple[bool, float]:
    """Every frequency within 5 sigma + 0.01 of p, nothing where p is 0."""
    n = counts.sum()
    freq = counts / n
    bound = 5 * np.sqrt(p * (1 - p) / n) + 0.01
    ok = counts[p == 0].sum() == 0 and bool(np.all(np.abs(freq - p) <= bound))
    return ok, float(np.abs(freq - p).max())


@pytest.mark.parametrize("top_k", [0, 3])
def test_typed_through_suggestions_follow_the_fresh_sessions_law(spelled, tiny_llama_pair,  # noqa: F811
                                                                  target, top_k):
    """RUNS runs at temperature 1.0 (top_k 0: the document keeps the tokens it may; top_k 3:
    truncation after the mask, where a kept token would come from the old text's top 3, so
    nothing may be kept): the second suggestion's first token, and its second token after
    the most frequent first, within 5 sigma + 0.01 of the law per token, none outside it."""
    ctx, rest = TOY.heal(AFTER)
    assert rest == b" aa" and ctx == AFTER[:-1] and TOY.heal(BEFORE) == (ctx, b" a")
    config = replace(CONFIG, temperature=1.0, top_k=top_k, draft_len=2)
    vocab = target.vocab_size

    async def run() -> tuple[np.ndarray, list[list[int]], int]:
        firsts = np.zeros(vocab)
        pairs: list[list[int]] = []
        kept = 0
        async with AsyncEdgeClient(spelled.address, tiny_llama_pair.draft_dir) as client:
            spell(client)
            for i in range(RUNS):
                async with client.document(replace(config, seed=i)) as doc:
                    await doc.suggest(BEFORE, max_new_tokens=2)
                    s = await doc.suggest(AFTER, max_new_tokens=2)
                firsts[s.token_ids[0]] += 1
                pairs.append(s.token_ids)
                kept += s.stats.reused_tokens > 0
        return firsts, pairs, kept

    firsts, pairs, kept = asyncio.run(run())
    p1 = law(target.model, ctx, TOY.allowed(rest), 1.0, top_k)
    ok, gap = close_to(firsts, p1)
    assert ok, ("first token", gap)
    top = int(firsts.argmax())
    seconds = np.bincount([s[1] for s in pairs if s[0] == top], minlength=vocab)
    p2 = law(target.model, ctx + [top], None, 1.0, top_k)
    ok, gap = close_to(seconds, p2)
    assert ok, ("second token", gap, seconds.sum())
    if top_k:
        assert kept == 0  # truncated sampling: nothing of the old suggestion may stand
    else:
        assert kept >= RUNS // 20, kept  # type-through is what this test exercises
