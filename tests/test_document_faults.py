"""Documents (edge_client.document) under the interleavings that broke them, forced with
events rather than timing: a keystroke that cancels a suggestion before its open left, one
during the draft-only completion, and a client that comes up without its verifier."""

from __future__ import annotations

import asyncio
import shutil
import threading

import numpy as np
import pytest
from conftest import write_tiny_tokenizer
from stream_helpers import PROMPT
from test_document import GREEDY, hf_greedy
from test_editing import common_prefix, one_torch_thread  # noqa: F401 - autouse

from cloud_verifier.config import VerifierConfig
from cloud_verifier.server import EmbeddedVerifier
from edge_client.client import AsyncEdgeClient, GenerationConfig
from edge_client.connection import RetryPolicy
from edge_client.draft_model import OnnxDraftModel
from edge_client.drafter import DraftSampling, ModelDrafter
from edge_client.errors import IncompatibleVerifier, VerifierUnavailable
from edge_client.link import Link
from edge_client.local_verifier import free_port


@pytest.fixture(scope="module")
def verifier(target):
    with EmbeddedVerifier(target, VerifierConfig(port=0, max_sessions=16,
                                                 max_draft_len=8)) as v:
        yield v


class HeldLink(Link):
    """A link that holds the next message on its way while ``hold`` is set: ``held`` tells
    that one is held, ``go`` lets it through (events, so the interleaving is forced)."""

    def __init__(self) -> None:
        self.hold, self.held, self.go = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def send(self, nbytes: int) -> None:
        if self.hold.is_set():
            self.hold.clear()
            self.held.set()
            await self.go.wait()


class HeldDrafter:
    """The document's drafter, with its next proposal held (in its worker thread) until
    released."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.hold, self.held, self.go = threading.Event(), threading.Event(), threading.Event()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def propose(self, committed, k):
        if self.hold.is_set():
            self.hold.clear()
            self.held.set()
            self.go.wait(30)
        return self.inner.propose(committed, k)


@pytest.mark.parametrize("where", ["drafting round 0", "the open on its way"])
def test_a_suggestion_cancelled_before_its_open_left_reopens_with_an_open(
        verifier, tiny_llama_pair, target, where):
    """A keystroke that cancels a fresh session's first suggestion before its open was
    handed to gRPC (its round 0 still drafting, or the open still crossing the link) must
    not leave that stream kept: the next suggestion would send a VerifyRound first and the
    verifier refuse it, INVALID_ARGUMENT "the first message of a Session stream must be
    open" (seen in edgespec-bench ime)."""
    link = HeldLink()

    async def run():
        async with AsyncEdgeClient(verifier.address, tiny_llama_pair.draft_dir,
                                   link=link) as client:
            async with client.document(GREEDY) as doc:
                drafter = doc._drafter = HeldDrafter(doc._drafter)
                if where == "drafting round 0":
                    drafter.hold.set()
                else:
                    link.hold.set()
                first = asyncio.ensure_future(doc.suggest(PROMPT, max_new_tokens=4))
                if where == "drafting round 0":
                    await asyncio.to_thread(drafter.held.wait, 30)
                else:
                    await asyncio.wait_for(link.held.wait(), 30)
                doc.cancel()
                cancelled = await first
                drafter.go.set()
                link.go.set()
                return cancelled, await doc.suggest(PROMPT + [9], max_new_tokens=4)

    cancelled, after = asyncio.run(run())
    assert cancelled.cancelled and cancelled.token_ids == []
    assert not after.cancelled and after.token_ids == hf_greedy(target, PROMPT + [9], 4)
    assert after.stats.reopens == 0


def test_a_new_suggest_stops_the_draft_only_completion_in_flight(target, tiny_llama_pair):
    """A suggestion with its verifier away is completed by the draft alone; a keystroke
    then must stop that completion too (it returns cancelled) before the next suggestion
    edits the state it drafts on, and the next suggestion, the verifier back, is the
    target's own."""
    port = free_port()
    cfg = GenerationConfig(draft_len=3, ignore_eos=True, fallback="draft-only")

    async def run():
        async with AsyncEdgeClient(f"127.0.0.1:{port}", tiny_llama_pair.draft_dir,
                                   fallback="draft-only",
                                   retry=RetryPolicy(budget_s=1.0)) as client:
            async with client.document(cfg) as doc:
                drafter = doc._drafter = HeldDrafter(doc._drafter)
                drafter.hold.set()  # the draft-only completion's proposal waits
                older = asyncio.ensure_future(doc.suggest(PROMPT, max_new_tokens=8))
                await asyncio.to_thread(drafter.held.wait, 30)
                verifier = await asyncio.to_thread(
                    EmbeddedVerifier(target, VerifierConfig(port=port)).__enter__)
                try:
                    await client.conn.channel.channel_ready()
                    newer = asyncio.ensure_future(doc.suggest(PROMPT + [9], max_new_tokens=4))
                    await asyncio.sleep(0)  # one turn of the loop: the newer one starts
                    drafter.go.set()
                    return await older, await newer
                finally:
                    await asyncio.to_thread(verifier.__exit__, None, None, None)

    older, newer = asyncio.run(run())
    assert older.cancelled
    assert not newer.cancelled and newer.token_ids == hf_greedy(target, PROMPT + [9], 4)
    assert newer.unverified_ids == []


def test_a_budget_ends_the_suggestion_without_drafting_past_it(verifier, tiny_llama_pair):
    """With the draft-only fallback, a suggestion whose budget is spent while its drafts
    are on their way returns them, unverified, and the draft does not go on alone past the
    budget: the round's 3 drafts, not the 8 tokens asked for (the held open would hang a
    suggestion that waited for it)."""
    link = HeldLink()
    cfg = GenerationConfig(draft_len=3, ignore_eos=True, fallback="draft-only",
                           stop_confidence=0,  # 3 drafts a round, however unsure
                           word_settle_ms=0)  # sent at once, mid-word or not

    async def run():
        async with AsyncEdgeClient(verifier.address, tiny_llama_pair.draft_dir,
                                   link=link) as client:
            async with client.document(cfg) as doc:
                link.hold.set()  # the open never arrives in time: the budget is spent
                try:
                    return await doc.suggest(PROMPT, max_new_tokens=8, budget_ms=50)
                finally:
                    link.go.set()

    s = asyncio.run(run())
    assert s.token_ids == [] and len(s.unverified_ids) == 3 and not s.cancelled


def test_draft_only_document_comes_up_without_its_verifier(target, tiny_llama_pair):
    """No verifier at start: with fallback="draft-only" the client and its document still
    come up and suggest the draft's own tokens, marked unverified. Once a verifier listens,
    the next suggestion checks it (GetInfo) and is verified, the unverified tokens sent
    first as drafts. Without the fallback, connect() raises VerifierUnavailable."""
    port = free_port()
    address = f"127.0.0.1:{port}"
    model = OnnxDraftModel(tiny_llama_pair.draft_dir)
    own = ModelDrafter(model, DraftSampling(), np.random.default_rng(0)).propose(
        PROMPT, 4).tokens
    want = hf_greedy(target, PROMPT, 4)
    cfg = GenerationConfig(draft_len=3, ignore_eos=True, fallback="draft-only")

    async def run():
        with pytest.raises(VerifierUnavailable):
            async with AsyncEdgeClient(address, tiny_llama_pair.draft_dir):
                pass
        async with AsyncEdgeClient(address, tiny_llama_pair.draft_dir, fallback="draft-only",
                                   retry=RetryPolicy(budget_s=1.0)) as client:
            assert client.info is None
            async with client.document(cfg) as doc:
                away = await doc.suggest(PROMPT, max_new_tokens=4)
                verifier = await asyncio.to_thread(
                    EmbeddedVerifier(target, VerifierConfig(port=port)).__enter__)
                try:
                    await client.conn.channel.channel_ready()
                    back = await doc.suggest(PROMPT, max_new_tokens=4)
                finally:
                    await asyncio.to_thread(verifier.__exit__, None, None, None)
                return away, back, client.info

    away, back, info = asyncio.run(run())
    assert away.token_ids == [] and away.unverified_ids == own and not away.cancelled
    assert away.stats.unverified_tokens == 4
    assert info is not None
    assert back.token_ids == want and back.unverified_ids == []
    assert back.stats.replaced_tokens == 4 - common_prefix(own, want)
    assert back.stats.drafted >= 1  # the unverified tokens went as drafts


def test_a_late_verifier_with_another_tokenizer_is_refused(target, tiny_llama_pair,
                                                           tmp_path):
    """The draft-only start defers the tokenizer check, it does not skip it: the first
    suggestion that reaches a verifier with another tokenizer raises IncompatibleVerifier."""
    other = tmp_path / "draft"
    shutil.copytree(tiny_llama_pair.draft_dir, other)
    write_tiny_tokenizer(other, vocab_size=tiny_llama_pair.vocab_size - 1)
    port = free_port()
    cfg = GenerationConfig(draft_len=3, ignore_eos=True, fallback="draft-only")

    async def run():
        async with AsyncEdgeClient(f"127.0.0.1:{port}", other,
                                   fallback="draft-only") as client:
            async with client.document(cfg) as doc:
                away = await doc.suggest(PROMPT, max_new_tokens=2)
                verifier = await asyncio.to_thread(
                    EmbeddedVerifier(target, VerifierConfig(port=port)).__enter__)
                try:
                    await client.conn.channel.channel_ready()
                    with pytest.raises(IncompatibleVerifier):
                        await doc.suggest(PROMPT, max_new_tokens=2)
                finally:
                    await asyncio.to_thread(verifier.__exit__, None, None, None)
                return away, client.info

    away, info = asyncio.run(run())
    assert len(away.unverified_ids) == 2 and info is None


class WrongDrafter:
    """The document's drafter with every draft replaced by a token the target never picks
    there (it knows the target's greedy continuation of PROMPT): acceptance 0."""

    def __init__(self, inner, want: list[int], vocab_size: int) -> None:
        self.inner, self.want, self.vocab_size = inner, want, vocab_size

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def propose(self, committed, k):
        proposal = self.inner.propose(committed, k)
        at = len(committed) - len(PROMPT)
        tokens = [(self.want[at] + 1) % self.vocab_size] * len(proposal.tokens)
        return type(proposal)(tokens, None, proposal.confidence)


@pytest.mark.parametrize("follow", [None, False], ids=["default", "off"])
def test_a_document_follows_the_acceptance_collapse_by_default(verifier, tiny_llama_pair,
                                                               target, follow):
    """Drafts that are always rejected: the verifier's suggested K falls to 0. By default a
    document follows it (its rounds become a Decode, no drafts sent); with
    follow_suggested_draft_len=False it drafts K every round. Greedy output is the target's
    either way."""
    n = 40
    want = hf_greedy(target, PROMPT, n)
    cfg = GenerationConfig(draft_len=3, ignore_eos=True, follow_suggested_draft_len=follow,
                           stop_confidence=0)  # 3 drafts a round, however unsure

    async def run():
        async with AsyncEdgeClient(verifier.address, tiny_llama_pair.draft_dir) as client:
            async with client.document(cfg) as doc:
                doc._drafter = WrongDrafter(doc._drafter, want, target.vocab_size)
                return await doc.suggest(PROMPT, max_new_tokens=n)

    s = asyncio.run(run())
    assert s.token_ids == want and s.stats.accepted == 0
    if follow is None:  # collapsed within a few rounds, then decoded without drafts
        assert s.stats.drafted < n
    else:  # one rejected round per token, each with K = 3 drafts (the last with fewer)
        assert s.stats.drafted >= 3 * (n - 3)


def test_close_also_stops_a_suggestion_waiting_for_the_one_in_flight(verifier,
                                                                     tiny_llama_pair):
    """close() while one suggestion drafts and a newer one waits for it to stop: both return
    cancelled, and no session is opened after the close."""

    async def run():
        async with AsyncEdgeClient(verifier.address, tiny_llama_pair.draft_dir) as client:
            doc = client.document(GREEDY)
            drafter = doc._drafter = HeldDrafter(doc._drafter)
            drafter.hold.set()
            older = asyncio.ensure_future(doc.suggest(PROMPT, max_new_tokens=4))
            await asyncio.to_thread(drafter.held.wait, 30)
            newer = asyncio.ensure_future(doc.suggest(PROMPT + [9], max_new_tokens=4))
            await asyncio.sleep(0)  # one turn of the loop: the newer one waits
            closing = asyncio.ensure_future(doc.close())
            await asyncio.sleep(0)
            drafter.go.set()
            await closing
            return await older, await newer, doc._keeper.stream

    older, newer, stream = asyncio.run(run())
    assert older.cancelled and newer.cancelled and newer.token_ids == []
    assert stream is None
