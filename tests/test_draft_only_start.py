"""A client that comes up without its verifier (``fallback="draft-only"``): generations and
the CLI go on with the draft alone, marked unverified, and are verified once a verifier
listens; the same fallback through the API, the CLI and the typing benchmark's clients."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
from stream_helpers import PROMPT
from test_document import hf_greedy
from test_editing import common_prefix, one_torch_thread  # noqa: F401 - autouse

from cloud_verifier.config import VerifierConfig
from cloud_verifier.server import EmbeddedVerifier
from edge_client.client import AsyncEdgeClient, GenerationConfig
from edge_client.connection import RetryPolicy
from edge_client.draft_model import OnnxDraftModel
from edge_client.drafter import DraftSampling, ModelDrafter
from edge_client.errors import VerifierUnavailable
from edge_client.local_verifier import free_port

N = 8
CFG = GenerationConfig(max_new_tokens=N, draft_len=3, ignore_eos=True, fallback="draft-only")


def own_greedy(draft_dir, n: int) -> list[int]:
    model = OnnxDraftModel(draft_dir)
    return ModelDrafter(model, DraftSampling(), np.random.default_rng(0)).propose(
        PROMPT, n).tokens


def test_a_generation_started_offline_is_verified_when_the_verifier_comes(target,
                                                                          tiny_llama_pair):
    """The first chunks are the draft's own N tokens, unverified; the verifier starts after
    the first of them arrived; the generation ends with the target's greedy tokens, all
    verified, the differing unverified ones replaced (and counted)."""
    port = free_port()
    own = own_greedy(tiny_llama_pair.draft_dir, N)
    want = hf_greedy(target, PROMPT, N)

    async def run():
        async with AsyncEdgeClient(f"127.0.0.1:{port}", tiny_llama_pair.draft_dir,
                                   fallback="draft-only",
                                   retry=RetryPolicy(base_delay_s=0.05, max_delay_s=0.2,
                                                     budget_s=30.0)) as client:
            assert client.info is None
            gen = client.generate(PROMPT, CFG, chat=False)
            chunks, verifier = [], None
            try:
                async for chunk in gen.chunks():
                    chunks.append(chunk)
                    if verifier is None:
                        verifier = await asyncio.to_thread(
                            EmbeddedVerifier(target, VerifierConfig(port=port)).__enter__)
            finally:
                if verifier is not None:
                    await asyncio.to_thread(verifier.__exit__, None, None, None)
            return chunks, gen

    chunks, gen = asyncio.run(run())
    unverified = [t for c in chunks if not c.verified for t in c.token_ids]
    assert not chunks[0].verified and unverified[:N] == own
    assert gen.token_ids == want and gen.unverified_ids == []
    assert gen.stats.unverified_tokens == 0
    assert gen.stats.replaced_tokens == N - common_prefix(own, want)
    assert any(c.verified and c.replaces for c in chunks) == (own != want)


def test_a_generation_whose_verifier_never_comes_ends_unverified(tiny_llama_pair):
    """Past the retry budget: the draft's tokens, all unverified, and no error; without the
    fallback the same generation raises VerifierUnavailable."""
    port = free_port()

    async def run(fallback: str):
        async with AsyncEdgeClient(f"127.0.0.1:{port}", tiny_llama_pair.draft_dir,
                                   fallback="draft-only",
                                   retry=RetryPolicy(base_delay_s=0.05, max_delay_s=0.1,
                                                     budget_s=0.5)) as client:
            gen = client.generate(PROMPT, GenerationConfig(
                max_new_tokens=N, draft_len=3, ignore_eos=True, fallback=fallback),
                chat=False)
            async for _ in gen.chunks():
                pass
            return gen

    gen = asyncio.run(run("draft-only"))
    assert gen.token_ids == [] and gen.unverified_ids == own_greedy(tiny_llama_pair.draft_dir, N)
    assert gen.stats.unverified_tokens == N
    with pytest.raises(VerifierUnavailable):
        asyncio.run(run("fail"))


def test_cli_generate_draft_only_without_a_verifier(tiny_llama_pair, capsys):
    """`edge-client generate --fallback draft-only` with nothing listening: exit 0, the
    draft's tokens under unverified_token_ids, every chunk flagged unverified, and
    stats.unverified_tokens equal to them."""
    from edge_client.cli import main

    rc = main(["generate", "--server", f"127.0.0.1:{free_port()}",
               "--draft-dir", str(tiny_llama_pair.draft_dir), "--prompt", "t5 t6 t7", "--raw",
               "--max-new-tokens", str(N), "--fallback", "draft-only",
               "--retry-budget-s", "0.5", "--json", "-"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["token_ids"] == [] and len(out["unverified_token_ids"]) >= 1
    assert out["stats"]["unverified_tokens"] == len(out["unverified_token_ids"])
    assert out["chunks"] and not any(c["verified"] for c in out["chunks"])


def test_the_typing_benchmark_passes_its_fallback_to_the_client(tiny_llama_pair):
    """Edit-mode clients of `edgespec-bench ime` come up without their verifier when the
    fallback is on; the other modes, and edit without it, do not."""
    from edge_client.bench.ime.modes import make_mode

    async def client_fallback_of(name: str, fallback: bool) -> str:
        mode = make_mode(name, "127.0.0.1:9", tiny_llama_pair.draft_dir, None,
                         RetryPolicy(), 4, fallback, None, 1)
        await mode.client.close()
        return mode.client.fallback

    def client_fallback(name: str, fallback: bool) -> str:
        return asyncio.run(client_fallback_of(name, fallback))

    assert client_fallback("edit", True) == "draft-only"
    assert client_fallback("edit", False) == "fail"
    assert client_fallback("reopen", True) == "fail"
