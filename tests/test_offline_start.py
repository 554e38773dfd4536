"""Draft-only suggestions start at once when no verifier answers (edge_client.offline_start):
the first unverified token within a second of the request, whether nothing listens on the
port (refused at once) or something listens and never answers (which used to cost the
GetInfo deadline, 10 s); the client keeps asking in the background, and once a verifier
listens the tokens are verified, greedy-identical to an undisturbed run."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

from stream_helpers import PROMPT
from test_document import hf_greedy
from test_editing import one_torch_thread  # noqa: F401 - autouse

from cloud_verifier.config import VerifierConfig
from cloud_verifier.server import EmbeddedVerifier
from edge_client.client import AsyncEdgeClient, GenerationConfig
from edge_client.connection import RetryPolicy
from edge_client.errors import IncompatibleVerifier
from edge_client.live_text import LiveText
from edge_client.local_verifier import free_port
from edge_client.offline_start import VerifierProbe, offline_wait_s

N = 16
# The product's promise is 1 s from the request to the first suggested token; the draft's
# own proposal takes milliseconds here, so a miss means the client waited for the verifier.
FIRST_TOKEN_BOUND_S = 1.0
CFG = GenerationConfig(max_new_tokens=N, draft_len=3, ignore_eos=True, fallback="draft-only")
RETRY = RetryPolicy(base_delay_s=0.05, max_delay_s=0.2, budget_s=30.0)


def offline_then_verified(target, draft_dir, port: int, before_verifier=None):
    """Connects and generates with no verifier answering on ``port``; starts one there once
    the first chunk arrived. Returns (seconds to the first chunk, chunks, generation)."""

    async def run():
        client = AsyncEdgeClient(f"127.0.0.1:{port}", draft_dir, fallback="draft-only",
                                 retry=RETRY)
        verifier = None
        try:
            t0 = time.perf_counter()  # the request: connect, then generate
            await client.connect()
            gen = client.generate(PROMPT, CFG, chat=False)
            chunks, first_s = [], None
            async for chunk in gen.chunks():
                chunks.append(chunk)
                if first_s is None:
                    first_s = time.perf_counter() - t0
                    if before_verifier is not None:
                        before_verifier()
                    verifier = await asyncio.to_thread(
                        EmbeddedVerifier(target, VerifierConfig(port=port)).__enter__)
            return first_s, chunks, gen
        finally:
            await client.close()
            if verifier is not None:
                await asyncio.to_thread(verifier.__exit__, None, None, None)

    return asyncio.run(run())


def check_verified(target, chunks, gen) -> None:
    want = hf_greedy(target, PROMPT, N)
    assert not chunks[0].verified and chunks[0].token_ids  # the draft's, marked
    assert gen.token_ids == want and gen.unverified_ids == []  # the target's, all verified
    assert gen.stats.unverified_tokens == 0 and gen.stats.drafted_alone >= 1
    shown: list[int] = []
    for c in chunks:  # what a UI shows, chunk by chunk, ends as the verified text
        del shown[len(shown) - c.replaces:]
        shown.extend(c.token_ids)
    assert shown == want


def test_nothing_listening_first_token_within_a_second_then_verified(target,
                                                                     tiny_llama_pair):
    first_s, chunks, gen = offline_then_verified(target, tiny_llama_pair.draft_dir,
                                                 free_port())
    assert first_s < FIRST_TOKEN_BOUND_S, f"first draft-only token after {first_s:.3f} s"
    check_verified(target, chunks, gen)


def test_a_silent_listener_does_not_hold_the_first_token(target, tiny_llama_pair):
    """A port that accepts connections and never answers (a frozen verifier, a middlebox):
    GetInfo would wait out its 10 s deadline; the first token still comes within 1 s."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    port = silent.getsockname()[1]
    try:
        first_s, chunks, gen = offline_then_verified(target, tiny_llama_pair.draft_dir, port,
                                                     before_verifier=silent.close)
    finally:
        silent.close()
    assert first_s < FIRST_TOKEN_BOUND_S, f"first draft-only token after {first_s:.3f} s"
    check_verified(target, chunks, gen)


def test_budget_bounds_the_wait_for_an_unanswered_verifier(tiny_llama_pair):
    """With budget_ms the first token comes within the budget, not the 0.5 s wait, from
    connect() on, with the wait the CLI derives from --budget-ms."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)

    async def run():
        client = AsyncEdgeClient(f"127.0.0.1:{silent.getsockname()[1]}",
                                 tiny_llama_pair.draft_dir, fallback="draft-only",
                                 retry=RETRY, offline_after_s=offline_wait_s(200))
        try:
            t0 = time.perf_counter()
            await client.connect()
            gen = client.generate(PROMPT, GenerationConfig(
                max_new_tokens=4, draft_len=2, ignore_eos=True, fallback="draft-only",
                budget_ms=200), chat=False)
            async for chunk in gen.chunks():
                return time.perf_counter() - t0, chunk
        finally:
            await client.close()

    try:
        first_s, chunk = asyncio.run(run())
    finally:
        silent.close()
    assert first_s < 0.2 and not chunk.verified and chunk.token_ids


class _Screen:
    def __init__(self) -> None:
        self.parts: list[str] = []

    def write(self, s: str) -> None:
        self.parts.append(s)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False


def test_live_text_transcript_marks_and_replaces_unverified(tiny_llama_pair):
    """Off a terminal the CLI writes unverified text at once, bracketed, then the verified
    text that replaced it."""
    from edge_client.tokenizer import EdgeTokenizer

    tok = EdgeTokenizer(tiny_llama_pair.draft_dir)
    out = _Screen()
    live = LiveText(tok, out)
    live.push([5], verified=True)
    live.push([6, 7], verified=False)
    live.push([6, 8], verified=True, replaces=2)
    live.finish()
    assert "".join(out.parts) == "t5 [unverified:  t6 t7]  t6 t8\n"
    assert live.text == "t5 t6 t8"


class _RefusingClient:
    """What VerifierProbe needs of a client, with a verifier that answers GetInfo with a
    refusal (another tokenizer) on every try."""

    def __init__(self) -> None:
        self.info = None
        self.calls = 0
        self.conn = type("Conn", (), {"retry": RETRY, "address": "127.0.0.1:1"})()

    async def refresh_info(self) -> None:
        self.calls += 1
        await asyncio.sleep(0)
        raise IncompatibleVerifier("another tokenizer")


def test_a_wait_after_the_probe_ended_starts_a_new_try_and_does_not_spin():
    """The probe ended (here with a refusal); the next wait starts a new probe and must let
    it run. A CI run once hung here: the ended probe left its event set, so the next wait's
    loop returned from it at once, for ever, and the event loop never ran the new probe nor
    the wait's own timeout. The waits run in a thread watched from outside, since a spinning
    event loop can time nothing out itself."""
    client = _RefusingClient()
    results: list[str] = []

    async def run():
        probe = VerifierProbe(client)
        for _ in range(3):
            try:
                await probe.wait(5.0)
                results.append("reached")
            except IncompatibleVerifier:
                results.append("refused")
        await probe.close()

    worker = threading.Thread(target=asyncio.run, args=(run(),), daemon=True)
    worker.start()
    worker.join(timeout=20)
    assert not worker.is_alive(), f"the probe's waits hung after {results}"
    assert results == ["refused"] * 3 and client.calls == 3
