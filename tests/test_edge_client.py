"""The edge client end to end with tiny random models: ONNX draft on the client, verifier on a
loopback port, real gRPC in between."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

from cloud_verifier.config import VerifierConfig
from cloud_verifier.sampling import SamplingParams, target_probs
from cloud_verifier.server import EmbeddedVerifier
from edge_client.client import AsyncEdgeClient, EdgeClient, GenerationConfig
from edge_client.connection import Deadlines
from edge_client.draft_model import OnnxDraftModel
from edge_client.drafter import DraftSampling, ModelDrafter
from edge_client.errors import IncompatibleVerifier
from edge_client.link import Link
from edge_client.tokenizer import EdgeTokenizer, TextStream

PROMPT = [1, 17, 42, 5, 63, 8]


@pytest.fixture(scope="module")
def verifier(target):
    with EmbeddedVerifier(target, VerifierConfig(port=0, max_sessions=8)) as v:
        yield v


@pytest.fixture(scope="module")
def client(verifier, tiny_llama_pair):
    with EdgeClient(verifier.address, tiny_llama_pair.draft_dir) as c:
        yield c


def hf_greedy(target, prompt: list[int], n: int) -> list[int]:
    out = target.model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n,
                                do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


PROTOCOLS = ["rounds", "lookahead", "cloud"]


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("draft_len", [1, 4])
def test_greedy_output_is_the_targets(verifier, tiny_llama_pair, target, protocol,
                                      draft_len):
    want = hf_greedy(target, PROMPT, 40)
    with EdgeClient(verifier.address, tiny_llama_pair.draft_dir, protocol=protocol) as c:
        gen = c.generate(PROMPT, GenerationConfig(max_new_tokens=40, draft_len=draft_len,
                                                  ignore_eos=True))
        chunks = list(gen)
    assert gen.token_ids == want
    assert [t for chunk in chunks for t in chunk] == want
    s = gen.stats
    if protocol == "rounds":  # round 0 rides on the open; one round trip a round
        assert s.round_trips == s.rounds == s.target_forwards
        assert s.drafted > 0
    else:  # one stream for the whole generation
        assert s.round_trips == 1 and s.rounds == s.target_forwards <= 40
    if protocol == "cloud":
        assert s.drafted == 0 and s.rounds == 40
    assert s.new_tokens == 40 and s.reopens == 0
    assert 0 <= s.accepted <= s.drafted
    assert s.bytes_up > 0 and s.bytes_down > 0


def test_async_api_gives_the_same_text(verifier, tiny_llama_pair, target):
    want = hf_greedy(target, PROMPT, 16)

    async def run() -> tuple[list[int], str]:
        async with AsyncEdgeClient(verifier.address, tiny_llama_pair.draft_dir) as c:
            ids: list[int] = []
            async for chunk in c.generate(PROMPT, GenerationConfig(max_new_tokens=16,
                                                                   ignore_eos=True)):
                ids.extend(chunk)
            text = "".join([piece async for piece in c.generate(
                PROMPT, GenerationConfig(max_new_tokens=16, ignore_eos=True)).text()])
            return ids, text

    ids, text = asyncio.run(run())
    assert ids == want
    assert text == EdgeTokenizer(tiny_llama_pair.draft_dir).decode(want)


def test_text_stream_pieces_add_up_to_the_full_decode(tiny_llama_pair):
    tok = EdgeTokenizer(tiny_llama_pair.draft_dir)
    ids = [5, 17, 2, 40, 41, 3, 90]  # 2 is </s>, a special token the text leaves out
    stream = TextStream(tok)
    assert "".join(stream.push([i]) for i in ids) == tok.decode(ids)


def test_same_seed_same_sampled_output(client):
    config = GenerationConfig(max_new_tokens=24, temperature=0.9, top_p=0.95, seed=7,
                              draft_len=3, ignore_eos=True)
    runs = []
    for _ in range(2):
        gen = client.generate(PROMPT, config)
        list(gen)
        runs.append(gen.token_ids)
    assert runs[0] == runs[1] and len(runs[0]) == 24


def active_sessions(verifier) -> int:
    return len(verifier.server.service.store)


def wait_for(predicate, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


@pytest.mark.parametrize("protocol", ["rounds", "lookahead"])
def test_leaving_early_closes_the_server_session_at_once(verifier, tiny_llama_pair,
                                                         protocol):
    with EdgeClient(verifier.address, tiny_llama_pair.draft_dir, protocol=protocol,
                    rtt_ms=20) as c:
        gen = c.generate(PROMPT, GenerationConfig(max_new_tokens=100, ignore_eos=True))
        for _ in gen:
            assert active_sessions(verifier) == 1
            break
        assert wait_for(lambda: active_sessions(verifier) == 0, 2.0)
    assert 0 < len(gen.token_ids) < 100


@pytest.mark.parametrize("protocol", ["rounds", "lookahead"])
def test_cancel_from_another_thread_stops_the_generation(verifier, tiny_llama_pair, protocol):
    with EdgeClient(verifier.address, tiny_llama_pair.draft_dir, protocol=protocol,
                    rtt_ms=20) as c:
        gen = c.generate(PROMPT, GenerationConfig(max_new_tokens=100, ignore_eos=True))
        seen: list[int] = []
        for chunk in gen:
            seen.extend(chunk)
            if len(seen) >= 3:
                threading.Thread(target=gen.cancel).start()
        assert 3 <= len(seen) < 100
        assert wait_for(lambda: active_sessions(verifier) == 0, 2.0)


def test_a_cancelled_generation_never_starts_a_session(verifier, tiny_llama_pair):
    with EdgeClient(verifier.address, tiny_llama_pair.draft_dir) as c:
        gen = c.generate(PROMPT, GenerationConfig(max_new_tokens=10))
        gen.cancel()
        assert list(gen) == []
    assert active_sessions(verifier) == 0


def test_lookahead_with_an_injected_rtt_keeps_the_output(verifier, tiny_llama_pair, target):
    """60 ms RTT: every lookahead goes up and every step comes down half of it late, so the
    first token takes a whole RTT and some lookaheads arrive stale; the text is unchanged."""
    want = hf_greedy(target, PROMPT, 24)
    with EdgeClient(verifier.address, tiny_llama_pair.draft_dir, rtt_ms=60,
                    protocol="lookahead") as c:
        t0 = time.perf_counter()
        gen = c.generate(PROMPT, GenerationConfig(max_new_tokens=24, ignore_eos=True))
        chunks = iter(gen)
        first = next(chunks)
        first_s = time.perf_counter() - t0
        rest = [t for chunk in chunks for t in chunk]
    assert first + rest == want and gen.token_ids == want
    assert first_s >= 0.06 and gen.stats.round_trips == 1


def test_a_generation_longer_than_the_stream_deadline_reopens_and_finishes(
        verifier, tiny_llama_pair, target):
    """A stream's gRPC deadline bounds the stream, not the generation: past it the client
    reopens with its committed context, and the output is unchanged."""
    want = hf_greedy(target, PROMPT, 40)
    with EdgeClient(verifier.address, tiny_llama_pair.draft_dir, protocol="rounds",
                    rtt_ms=40, deadlines=Deadlines(stream_s=0.3)) as c:
        gen = c.generate(PROMPT, GenerationConfig(max_new_tokens=40, ignore_eos=True))
        list(gen)
    assert gen.token_ids == want
    assert gen.stats.reopens >= 1


def test_without_drafts_the_server_decodes_in_one_round_trip(verifier, tiny_llama_pair,
                                                             target):
    """draft_len = 0: after the open, one Decode carries every remaining token."""
    want = hf_greedy(target, PROMPT, 20)
    with EdgeClient(verifier.address, tiny_llama_pair.draft_dir) as c:
        gen = c.generate(PROMPT, GenerationConfig(max_new_tokens=20, draft_len=0,
                                                  ignore_eos=True))
        chunks = list(gen)
    assert gen.token_ids == want and all(len(chunk) == 1 for chunk in chunks)
    s = gen.stats
    assert s.round_trips == 2 and s.rounds == s.target_forwards == 20 and s.drafted == 0


def test_adaptive_client_mixes_drafting_and_decode_and_keeps_the_output(
        verifier, tiny_llama_pair, target):
    """follow_suggested_draft_len: the client measures drafting, then Decode, and picks by
    rate; greedy output is the target's whichever it picks."""
    want = hf_greedy(target, PROMPT, 30)
    with EdgeClient(verifier.address, tiny_llama_pair.draft_dir) as c:
        config = GenerationConfig(max_new_tokens=30, draft_len=3, ignore_eos=True,
                                  follow_suggested_draft_len=True)
        for _ in range(2):  # the second generation starts from the first one's rates
            gen = c.generate(PROMPT, config)
            list(gen)
            assert gen.token_ids == want
        chooser = c._async.chooser
        assert chooser.rate["spec"] is not None and chooser.rate["continue"] is not None
        s = gen.stats
        assert s.round_trips <= s.rounds == s.target_forwards


def test_stop_token_ends_generation(client, target):
    want = hf_greedy(target, PROMPT, 30)
    stop = want[5]
    first = want.index(stop)
    gen = client.generate(PROMPT, GenerationConfig(max_new_tokens=30, draft_len=3,
                                                   stop_token_ids=(stop,)))
    list(gen)
    assert gen.token_ids == want[:first + 1]


def fresh_keys(model: OnnxDraftModel, tokens: list[int]) -> list[np.ndarray]:
    cache = model.new_cache()
    model.forward(cache, tokens)
    return cache.keys


@pytest.mark.parametrize("accepted", [0, 1, 3, 4], ids=["none", "one", "all-but-last", "all"])
def test_draft_cache_resync_matches_a_fresh_cache(tiny_llama_pair, accepted):
    """After a round with ``accepted`` of 4 drafts, the resynced cache equals one built
    from scratch over the committed tokens it covers, and the next proposal equals a fresh
    drafter's."""
    model = OnnxDraftModel(tiny_llama_pair.draft_dir)
    drafter = ModelDrafter(model, DraftSampling(), np.random.default_rng(0))
    proposal = drafter.propose(PROMPT, 4)
    assert drafter.cache.length == len(PROMPT) + 3  # d_4 is sampled, never fed
    correction = (proposal.tokens[accepted] + 1) % model.vocab_size if accepted < 4 else 11
    committed = PROMPT + proposal.tokens[:accepted] + [correction]
    kept = drafter.resync(committed)
    assert kept == len(PROMPT) + min(accepted, 3)
    for got, want in zip(drafter.cache.keys, fresh_keys(model, committed[:kept]), strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5)
    fresh = ModelDrafter(model, DraftSampling(), np.random.default_rng(0))
    assert drafter.propose(committed, 3).tokens == fresh.propose(committed, 3).tokens


def test_greedy_drafts_carry_their_top_probability(tiny_llama_pair):
    model = OnnxDraftModel(tiny_llama_pair.draft_dir)
    proposal = ModelDrafter(model, DraftSampling(), np.random.default_rng(0)).propose(PROMPT, 3)
    logits = model.forward(model.new_cache(), PROMPT + proposal.tokens[:2])[-3:]
    z = np.exp(logits - logits.max(axis=1, keepdims=True))
    np.testing.assert_allclose(proposal.confidence, (z / z.sum(axis=1, keepdims=True)).max(1),
                               rtol=1e-5)
    sampled = ModelDrafter(model, DraftSampling(temperature=0.8), np.random.default_rng(0))
    assert sampled.propose(PROMPT, 3).confidence is None  # not measured for sampling drafts


def test_a_client_sends_no_draft_the_server_prices_out(target, tiny_llama_pair):
    """A verifier that prices every verified draft token at 50 forwards: after the first
    reply brings that price, a confidence-following client sends no drafts; the output is
    still the target's."""
    want = hf_greedy(target, PROMPT, 20)
    config = VerifierConfig(port=0, verify_token_cost=50.0, fit_verify_cost=False)
    with EmbeddedVerifier(target, config) as v, EdgeClient(
            v.address, tiny_llama_pair.draft_dir) as c:
        gen = c.generate(PROMPT, GenerationConfig(max_new_tokens=20, draft_len=3,
                                                  ignore_eos=True, stop_confidence=0,
                                                  follow_suggested_draft_len=True))
        list(gen)
    assert gen.token_ids == want
    assert gen.stats.drafted == 3  # the opening round's drafts only


def test_client_refuses_a_verifier_with_another_tokenizer(verifier, tiny_llama_pair, tmp_path):
    other = tmp_path / "draft"
    shutil.copytree(tiny_llama_pair.draft_dir, other)
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    vocab["t3"], vocab["t4"] = vocab["t4"], vocab["t3"]  # same size, ids mean other text
    (other / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(IncompatibleVerifier, match="tokenizer"):
        EdgeClient(verifier.address, other)


def test_sampled_output_follows_the_target_distribution(client, target):
    """The joint law of the first two generated tokens, through the full gRPC path.

    n = 3000 generations (seeds 0..2999) at temperature 1, top-k 6, K = 2, against the exact
    target law p(a) p(b | a). Per bin |count - n p| <= 6 sqrt(n p (1 - p)) + 5, and a pair
    with p = 0 never appears.
    """
    n = 3000
    params = SamplingParams(temperature=1.0, top_k=6)
    with torch.no_grad():
        p1 = target_probs(target.model(torch.tensor([PROMPT])).logits[0, -1:], params)[0]
        firsts = torch.arange(target.vocab_size)
        batch = torch.cat([torch.tensor([PROMPT]).expand(len(firsts), -1),
                           firsts[:, None]], dim=1)
        p2 = target_probs(target.model(batch).logits[:, -1], params)  # [V, V]
    joint = (p1[:, None] * p2).numpy().astype(np.float64)
    counts = np.zeros_like(joint)
    for seed in range(n):
        gen = client.generate(PROMPT, GenerationConfig(
            max_new_tokens=2, temperature=1.0, top_k=6, seed=seed, draft_len=2,
            ignore_eos=True))
        list(gen)
        a, b = gen.token_ids
        counts[a, b] += 1
    assert counts[joint == 0].sum() == 0, "a pair with target probability 0 appeared"
    expected = n * joint
    bound = 6 * np.sqrt(n * joint * (1 - joint)) + 5
    worst = np.max(np.abs(counts - expected) - bound)
    assert worst <= 0, f"a bin is off by {worst:.1f} beyond its bound"
    # The test has power: had the output followed the draft's own law, it would fail.
    draft_joint = _draft_joint(client._async.model, PROMPT, temperature=1.0, top_k=6)
    assert np.max(np.abs(n * draft_joint - expected) - bound) > 0


def _draft_joint(model: OnnxDraftModel, prompt: list[int], temperature: float,
                 top_k: int) -> np.ndarray:
    from edge_client.sampling import truncated_distribution

    def law(tokens: list[int]) -> np.ndarray:
        cache = model.new_cache()
        ids, probs = truncated_distribution(model.forward(cache, tokens)[-1], temperature,
                                            top_k, 1.0, 0)
        dense = np.zeros(model.vocab_size)
        dense[ids] = probs
        return dense

    q1 = law(prompt)
    return np.stack([q1[a] * law(prompt + [a]) if q1[a] > 0 else np.zeros(model.vocab_size)
                     for a in range(model.vocab_size)])


def test_cli_generate_json(tiny_llama_pair, capsys):
    """--embedded starts a verifier process; --json - prints the stats object on stdout."""
    from edge_client.cli import main

    rc = main(["generate", "--embedded", "--model", str(tiny_llama_pair.target_dir),
               "--draft-dir", str(tiny_llama_pair.draft_dir), "--prompt", "t5 t6 t7", "--raw",
               "--max-new-tokens", "12", "--json", "-"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["token_ids"]) <= 12 and out["token_ids"]
    for key in ("new_tokens", "rounds", "drafted", "accepted", "round_trips",
                "target_forwards", "bytes_up", "bytes_down", "tokens_per_s",
                "acceptance_rate", "tokens_per_round", "draft_s", "network_s", "verify_s",
                "wall_s", "reopens"):
        assert key in out["stats"]


def test_cli_says_what_failed_without_a_traceback(tiny_llama_pair):
    """No verifier at the address: a one-line error and exit code 2 once the retry budget
    is spent."""
    out = subprocess.run(
        [sys.executable, "-m", "edge_client.cli", "generate", "--server", "127.0.0.1:9",
         "--draft-dir", str(tiny_llama_pair.draft_dir), "--prompt", "t5", "--raw",
         "--retry-budget-s", "1"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "VerifierUnavailable" in out.stderr and "Traceback" not in out.stderr


def test_cli_version_and_help_need_no_torch():
    code = ("import sys, contextlib, io\n"
            "from edge_client.cli import build_parser\n"
            "with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n"
            "    build_parser().parse_args(['--version'])\n"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"


class StallingLink(Link):
    """Holds the ``stall_at``-th message on the uplink for ``stall_s``: the device goes quiet
    for longer than the verifier's session TTL."""

    def __init__(self, stall_at: int, stall_s: float) -> None:
        self.sent, self.stall_at, self.stall_s = 0, stall_at, stall_s

    async def send(self, nbytes: int) -> None:
        self.sent += 1
        if self.sent == self.stall_at:
            await asyncio.sleep(self.stall_s)


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "sampled"])
def test_a_session_expired_while_the_device_was_quiet_reopens_unchanged(
        target, tiny_llama_pair, seeded):
    """The verifier expires the idle session (TTL 0.4 s) while the device holds its 3rd round
    for 1.5 s; the round is answered NOT_FOUND / SESSION_EXPIRED, the client reopens with
    its committed context and that same round, and the output equals an undisturbed run."""
    config = GenerationConfig(max_new_tokens=30, draft_len=3, ignore_eos=True,
                              temperature=0.9 if seeded else 0.0, seed=3)
    with EmbeddedVerifier(target, VerifierConfig(port=0, session_ttl_s=0.4)) as v:
        with EdgeClient(v.address, tiny_llama_pair.draft_dir) as c:
            want = c.generate(PROMPT, config)
            list(want)
        with EdgeClient(v.address, tiny_llama_pair.draft_dir,
                        link=StallingLink(stall_at=3, stall_s=1.5)) as c:
            gen = c.generate(PROMPT, config)
            list(gen)
        expired = v.server.metrics.evictions.labels("ttl")._value.get()
    assert gen.token_ids == want.token_ids
    assert gen.stats.reopens == 1 and expired >= 1
    assert gen.stats.lost_attempts == {"NOT_FOUND": 1}


def test_every_call_of_a_generation_carries_one_routing_key(target, tiny_llama_pair,
                                                            monkeypatch):
    """GetInfo, the first stream and the stream that reopens it after a TTL expiry all carry
    the edgespec-routing-key metadata, the same key for the whole generation (a gateway keeps
    the generation on one replica), another key for the next generation."""
    from cloud_verifier import service as service_module
    from cloud_verifier.interceptors import current_routing_key

    seen: list[tuple[str, str]] = []
    original_session = service_module.VerifierService.Session
    original_info = service_module.VerifierService.GetInfo

    def session(self, request_iterator, context):
        seen.append(("Session", current_routing_key()))
        return original_session(self, request_iterator, context)

    async def get_info(self, request, context):
        seen.append(("GetInfo", current_routing_key()))
        return await original_info(self, request, context)

    monkeypatch.setattr(service_module.VerifierService, "Session", session)
    monkeypatch.setattr(service_module.VerifierService, "GetInfo", get_info)
    config = GenerationConfig(max_new_tokens=20, draft_len=3, ignore_eos=True)
    with EmbeddedVerifier(target, VerifierConfig(port=0, session_ttl_s=0.4)) as v, \
            EdgeClient(v.address, tiny_llama_pair.draft_dir,
                       link=StallingLink(stall_at=3, stall_s=1.5)) as c:
        gen = c.generate(PROMPT, config)
        list(gen)
        list(c.generate(PROMPT, config))
    assert gen.stats.reopens == 1
    calls = [name for name, _ in seen]
    keys = [key for _, key in seen]
    assert calls[0] == "GetInfo" and calls.count("Session") == 3 and all(keys)
    first, reopened, second = [key for name, key in seen if name == "Session"]
    assert first == reopened != second
