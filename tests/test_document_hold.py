"""Held rounds (GenerationConfig.hold_rounds), over real gRPC with tiny random models: after a
key that leaves a word, a suggestion's first round goes at once and its later rounds wait as
a key inside a word waits, so a key typed in that wait costs the verifier one forward."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import pytest
from test_document import GREEDY, hf_greedy, metric
from test_editing import one_torch_thread  # noqa: F401 - autouse

from cloud_verifier.config import VerifierConfig
from cloud_verifier.server import EmbeddedVerifier
from edge_client.client import AsyncEdgeClient

TOKENS = 12  # several rounds at the tiny pair's acceptance
TEXT = "t5 t7 "  # ends after a word: no settle wait before the first round


@pytest.fixture(scope="module")
def verifier(target):
    with EmbeddedVerifier(target, VerifierConfig(port=0, max_sessions=4,
                                                 max_draft_len=8)) as v:
        yield v


def suggest_then_key(verifier, draft_dir, config, key_after_s: float):
    """One suggestion after TEXT, cancelled by a key ``key_after_s`` later (or not, if it is
    whole by then); the suggestion and the forwards the verifier ran for it."""
    async def run():
        async with AsyncEdgeClient(verifier.address, draft_dir) as client:
            async with client.document(config) as doc:
                await doc.suggest("t3", 1, settle_ms=0)  # the session is open and warm
                forwards = metric(verifier, "target_forwards")
                asyncio.get_running_loop().call_later(key_after_s, doc.cancel)
                s = await asyncio.wait_for(doc.suggest(TEXT, TOKENS), 30)
                await asyncio.sleep(0.2)  # a forward that had started ends
                return s, metric(verifier, "target_forwards") - forwards
    return asyncio.run(run())


def test_a_key_in_the_hold_leaves_one_forward_run(verifier, tiny_llama_pair, target):
    """A hold longer than the test (60 s): the key 0.5 s later finds the first round's tokens
    verified (the target's) and no later round sent: one forward. Without the hold, the
    same suggestion runs to the end (more than one forward)."""
    held, ran = suggest_then_key(verifier, tiny_llama_pair.draft_dir,
                                 replace(GREEDY, word_settle_ms=60_000), 0.5)
    assert held.cancelled and ran == 1 and held.stats.target_forwards == 1
    assert 1 <= len(held.token_ids) < TOKENS
    assert held.token_ids == hf_greedy(target, [5, 7], len(held.token_ids))

    whole, ran = suggest_then_key(verifier, tiny_llama_pair.draft_dir,
                                  replace(GREEDY, word_settle_ms=60_000, hold_rounds=False), 20)
    assert not whole.cancelled and ran == whole.stats.target_forwards > 1
    assert whole.token_ids == hf_greedy(target, [5, 7], TOKENS)


def test_after_the_hold_the_suggestion_is_whole_and_the_targets(verifier, tiny_llama_pair,
                                                                target):
    """A 300 ms hold and no key: the suggestion is whole, the target's greedy continuation,
    and took at least the hold (its later rounds waited)."""
    async def run():
        async with AsyncEdgeClient(verifier.address, tiny_llama_pair.draft_dir) as client:
            async with client.document(replace(GREEDY, word_settle_ms=300)) as doc:
                await doc.suggest("t3", 1, settle_ms=0)
                t0 = time.perf_counter()
                s = await asyncio.wait_for(doc.suggest(TEXT, TOKENS), 30)
                return s, time.perf_counter() - t0
    s, took = asyncio.run(run())
    assert not s.cancelled and s.stats.target_forwards > 1 and took >= 0.3
    assert s.token_ids == hf_greedy(target, [5, 7], TOKENS)
