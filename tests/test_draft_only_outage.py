"""The draft-only fallback through an outage, over real gRPC with tiny random models: a
document keeps suggesting (unverified, marked) while its verifier is down and resyncs when it
is back; a generation's stream carries unverified chunks that a verified one replaces."""

from __future__ import annotations

import asyncio

import numpy as np
from stream_helpers import PROMPT
from test_document import hf_greedy
from test_editing import common_prefix, one_torch_thread  # noqa: F401 - autouse

from cloud_verifier.config import VerifierConfig
from cloud_verifier.server import EmbeddedVerifier
from edge_client.client import AsyncEdgeClient, GenerationConfig
from edge_client.connection import Connection, RetryPolicy
from edge_client.core import GenerationStats, generate, model_proposer
from edge_client.draft_model import OnnxDraftModel
from edge_client.drafter import DraftSampling, ModelDrafter
from edge_client.generation_state import GenerationState, ServerLimits, SessionParams
from edge_client.local_verifier import free_port


def test_draft_only_keeps_suggesting_during_an_outage_and_resyncs(target, tiny_llama_pair):
    """The verifier stops: the next suggestion is the draft's own, marked unverified, with
    no error. It comes back on the same port: the same text's suggestion is verified (the
    unverified tokens are sent first, as drafts) and what differed is counted replaced."""
    port = free_port()
    config = VerifierConfig(port=port, max_sessions=4)
    model = OnnxDraftModel(tiny_llama_pair.draft_dir)
    own = ModelDrafter(model, DraftSampling(), np.random.default_rng(0)).propose(
        PROMPT + [20], 4).tokens
    want = hf_greedy(target, PROMPT + [20], 4)
    first = EmbeddedVerifier(target, config).__enter__()
    cfg = GenerationConfig(draft_len=3, ignore_eos=True, fallback="draft-only")

    async def run():
        async with AsyncEdgeClient(first.address, tiny_llama_pair.draft_dir,
                                   retry=RetryPolicy(budget_s=1.0)) as client:
            async with client.document(cfg) as doc:
                before = await doc.suggest(PROMPT, max_new_tokens=2)
                await asyncio.to_thread(first.__exit__, None, None, None)
                away = await doc.suggest(PROMPT + [20], max_new_tokens=4)
                second = await asyncio.to_thread(EmbeddedVerifier(target, config).__enter__)
                try:
                    await client.conn.channel.channel_ready()
                    back = await doc.suggest(PROMPT + [20], max_new_tokens=4)
                finally:
                    await asyncio.to_thread(second.__exit__, None, None, None)
                return before, away, back

    before, away, back = asyncio.run(run())
    assert before.token_ids == hf_greedy(target, PROMPT, 2)
    assert away.token_ids == [] and away.unverified_ids == own
    assert away.stats.unverified_tokens == 4 and not away.cancelled
    assert back.token_ids == want and back.unverified_ids == []
    assert back.stats.replaced_tokens == 4 - common_prefix(own, want)
    assert back.stats.drafted >= 1  # the unverified tokens went as drafts


def test_generate_draft_only_through_an_outage(target, tiny_llama_pair):
    """A generation whose verifier stops after its second round and comes back while the
    draft goes on alone: the stream carries unverified chunks, a verified chunk replaces
    them, and the output is the target's greedy output with no error and nothing left
    unverified."""
    port = free_port()
    config = VerifierConfig(port=port, max_sessions=4)
    n = 24
    want = hf_greedy(target, PROMPT, n)

    async def run():
        verifier = await asyncio.to_thread(EmbeddedVerifier(target, config).__enter__)
        conn = Connection(verifier.address, retry=RetryPolicy(budget_s=20))
        info = await conn.info()
        model = OnnxDraftModel(tiny_llama_pair.draft_dir)
        stats = GenerationStats()
        drafted = model_proposer(ModelDrafter(model, DraftSampling(),
                                              np.random.default_rng(0)), stats)
        calls = 0
        held = {"verifier": verifier}

        async def propose(committed, k, spell=None):
            nonlocal calls
            calls += 1
            if calls == 3:  # the outage starts
                await asyncio.to_thread(held["verifier"].__exit__, None, None, None)
            if calls == 4:  # and ends while the draft goes on alone
                held["verifier"] = await asyncio.to_thread(
                    EmbeddedVerifier(target, config).__enter__)
            return await drafted(committed, k, spell)

        state = GenerationState(PROMPT, SessionParams(max_new_tokens=n, ignore_eos=True),
                                ServerLimits.from_info(info), draft_len=3)
        chunks = []
        try:
            async for d in generate(conn, state, propose, stats, info,
                                    np.random.default_rng(0), fallback="draft-only"):
                chunks.append(d)
        finally:
            await conn.close()
            await asyncio.to_thread(held["verifier"].__exit__, None, None, None)
        return state, stats, chunks

    state, stats, chunks = asyncio.run(run())
    assert state.generated == want
    assert any(not c.verified for c in chunks) and any(c.replaces for c in chunks)
    text: list[int] = []
    for c in chunks:  # what a UI shows, chunk by chunk
        del text[len(text) - c.replaces:]
        text.extend(c.tokens)
    assert text == want
    assert stats.unverified_tokens == 0 and stats.drafted_alone > 0 and stats.reopens >= 1
