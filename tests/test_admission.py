"""Memory and admission: suggested draft length, KV-budget eviction that users cannot see,
deterministic randomness across a reopen, and the queued-rounds limit."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest
import torch
from stream_helpers import PROMPT, SessionCall, error_of, open_message, verify_message

from cloud_verifier.batcher import RoundBatcher
from cloud_verifier.config import VerifierConfig
from cloud_verifier.draft_policy import VerifyCostModel, expected_tokens, suggest_draft_len
from cloud_verifier.engine import VerifierEngine
from cloud_verifier.errors import Overloaded
from cloud_verifier.metrics import VerifierMetrics
from cloud_verifier.sampling import SamplingParams
from cloud_verifier.server import EmbeddedVerifier
from cloud_verifier.sessions import SessionStore
from cloud_verifier.target_engine import DraftRound
from shared import errors
from shared.pb import verifier_pb2_grpc as pb_grpc


def test_expected_tokens_formula():
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)


def test_suggested_draft_length_follows_acceptance_and_load():
    assert suggest_draft_len(0.0, 1, 8) == 0  # a useless draft only costs compute
    assert suggest_draft_len(0.9, 1, 8) >= 4  # a good draft, idle server: speculate deep
    by_load = [suggest_draft_len(0.7, b, 8) for b in (1, 2, 4, 8, 16, 32, 64)]
    assert by_load == sorted(by_load, reverse=True)  # never more drafts under more load
    assert by_load[0] >= 3 and by_load[-1] < by_load[0]
    # Tokens that cost as much as the forward's fixed part: speculation stops under load.
    assert suggest_draft_len(0.7, 16, 8, token_cost=0.5) == 0
    # Sessions weigh on every K alike, so a per-session cost alone never turns drafting off.
    assert suggest_draft_len(0.7, 16, 8, token_cost=0.0, session_cost=1.0) == 8
    assert all(0 <= suggest_draft_len(a / 10, 4, 6) <= 6 for a in range(11))


def _observe(model: VerifyCostModel, shapes, a_ms, s_ms, t_ms, noise_ms=0.0, seed=0) -> None:
    rng = np.random.default_rng(seed)
    for b, n in shapes:
        model.observe(b, n, (a_ms + s_ms * b + t_ms * n + rng.normal(0, noise_ms)) / 1000)


def test_verify_cost_model_fits_the_forwards_it_sees():
    """512 forwards of mixed shapes (1..32 sessions, K = 0..4) with 5 ms noise: the fit
    recovers s/a and t/a of ms = 100 + 6/session + 1.5/token within 0.01, far from the prior."""
    model = VerifyCostModel(session_cost=0.038, token_cost=0.018)
    rng = np.random.default_rng(1)
    shapes = [(b, b * (k + 1)) for b, k in zip(rng.integers(1, 33, 512), rng.integers(0, 5, 512),
                                               strict=True)]
    _observe(model, shapes, 100.0, 6.0, 1.5, noise_ms=5.0)
    s, t = model.relative_costs()
    assert s == pytest.approx(0.06, abs=0.01) and t == pytest.approx(0.015, abs=0.01)
    assert model.fixed_ms == pytest.approx(100.0, abs=10.0)


def test_verify_cost_model_keeps_the_prior_where_the_data_cannot_tell():
    """Only plain decoding (tokens == sessions): the data fixes s + t, the prior the split."""
    model = VerifyCostModel(session_cost=0.04, token_cost=0.02)
    _observe(model, [(b, b) for b in range(1, 33)] * 8, 100.0, 4.0, 2.0)
    s, t = model.relative_costs()
    assert s + t == pytest.approx(0.06, abs=0.005)
    assert s == pytest.approx(0.04, abs=0.01) and t == pytest.approx(0.02, abs=0.01)


def test_verify_cost_model_without_fitting_or_data_is_the_prior():
    fixed = VerifyCostModel(session_cost=0.1, token_cost=0.2, fit=False)
    _observe(fixed, [(4, 20)] * 64, 100.0, 50.0, 50.0)
    assert fixed.relative_costs() == (0.1, 0.2) and fixed.fixed_ms is None
    fresh = VerifyCostModel(session_cost=0.1, token_cost=0.2, refit_every=16)
    _observe(fresh, [(4, 20)] * 15, 100.0, 50.0, 50.0)
    assert fresh.relative_costs() == (0.1, 0.2)  # not refitted yet
    assert fresh.observe(4, 20, 0.2) is True and fresh.fixed_ms is not None  # the 16th refits
    assert fresh.observe(4, 20, 0.2) is False
    with pytest.raises(ValueError, match=">= 0"):
        VerifyCostModel(session_cost=-1.0)


def test_replies_carry_a_suggested_draft_length(target):
    with EmbeddedVerifier(target, VerifierConfig(port=0, max_draft_len=8)) as server, \
            grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.VerifierServiceStub(channel)
        with SessionCall(stub, open_message(first=[90, 91, 92, 93],
                                            ignore_eos=False)) as call:
            step = call.step()
        # Wrong drafts at an idle server: acceptance falls, and so does the suggestion.
        assert step.HasField("suggested_draft_len") and 0 <= step.suggested_draft_len <= 8


def test_randomness_is_a_function_of_seed_and_position(target):
    """A session reopened mid-way with its full context continues exactly as if it had
    never been interrupted (sampling mode, same drafts)."""
    engine = VerifierEngine(target.model, target.vocab_size, target.max_context)
    store = SessionStore(max_sessions=4, ttl_s=60, on_close=engine.release)
    params = SamplingParams(temperature=1.0, seed=11)

    def drafts(committed):
        tokens = [(sum(committed) * (j + 3)) % target.vocab_size for j in range(3)]
        return DraftRound(tokens, [([t, (t + 1) % target.vocab_size], [0.6, 0.4])
                                   for t in tokens])

    whole = store.create("me", params, PROMPT, 0, frozenset())
    for _ in range(8):
        engine.run_round(whole, drafts(whole.committed))
    first = store.create("me", params, PROMPT, 0, frozenset())
    for _ in range(4):
        engine.run_round(first, drafts(first.committed))
    reopened = store.create("me", params, list(first.committed), 0, frozenset())
    while len(reopened.committed) < len(whole.committed):
        engine.run_round(reopened, drafts(reopened.committed))
    assert reopened.committed[:len(whole.committed)] == whole.committed


def test_eviction_is_lru_and_reopening_keeps_the_output(target):
    """A KV budget for about two sessions: opening a third evicts the least recently used
    idle one, whose stream's next message gets NOT_FOUND with SESSION_EVICTED; its owner
    reopens with the full context and the output is unchanged."""
    probe = VerifierEngine(target.model, target.vocab_size, target.max_context)
    budget = 2 * 64 * probe.kv.bytes_per_token  # two minimum-size buffers
    config = VerifierConfig(port=0, kv_budget_bytes=budget)
    with EmbeddedVerifier(target, config) as server, \
            grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.VerifierServiceStub(channel)
        a = SessionCall(stub, open_message(PROMPT, first=[]))
        committed = PROMPT + list(a.step().token_ids)
        others = [SessionCall(stub, open_message([3, 4, 5], first=[]))]
        others[0].step()
        others.append(SessionCall(stub, open_message([6, 7, 8], first=[])))
        others[1].step()  # needed room: evicted a (least recently used)
        err = error_of(a.send(verify_message(1)).rest)
        assert (err.code, err.reason) == (grpc.StatusCode.NOT_FOUND, errors.SESSION_EVICTED)
        assert "evicted" in err.message
        assert server.server.service.engine.kv.bytes_in_use <= budget
        # The full committed context as the prompt.
        with SessionCall(stub, open_message(committed, first=[])) as reopened:
            committed += reopened.step().token_ids
            for round_no in range(1, 5):
                committed += reopened.send(verify_message(round_no)).step().token_ids
        for call in others:
            call.cancel()
        evictions = server.server.metrics.evictions.labels("kv_budget")._value.get()
    assert evictions >= 1
    with torch.no_grad():
        want = target.model.generate(torch.tensor([PROMPT]), max_new_tokens=6,
                                     do_sample=False, pad_token_id=0)[0].tolist()
    assert committed == want


def test_queued_rounds_beyond_the_limit_are_overloaded(target):
    engine = VerifierEngine(target.model, target.vocab_size, target.max_context)
    store = SessionStore(max_sessions=4, ttl_s=60, on_close=engine.release)

    async def submit_two():
        batcher = RoundBatcher(engine, VerifierMetrics(), max_queued_rounds=1)
        s1 = store.create("me", SamplingParams(), PROMPT, 0, frozenset())
        s2 = store.create("me", SamplingParams(), PROMPT, 0, frozenset())
        batcher.submit(s1, DraftRound([], None))
        with pytest.raises(Overloaded):
            batcher.submit(s2, DraftRound([], None))

    asyncio.run(submit_two())


def _greedy_tokens(target, prompt: list[int], rounds: int) -> list[int]:
    """What ``rounds`` plain target steps commit after ``prompt``, with memory to spare."""
    engine = VerifierEngine(target.model, target.vocab_size, target.max_context)
    session = SessionStore(1, 60, on_close=engine.release).create(
        "me", SamplingParams(), list(prompt), 0, frozenset())
    for _ in range(rounds):
        engine.run_round(session, DraftRound([], None))
    return session.committed


def _tight_batcher(target, budget_tokens: int, kv_wait_s: float = 10.0):
    """An engine with a KV budget of ``budget_tokens`` tokens, its store and a batcher."""
    per_token = VerifierEngine(target.model, target.vocab_size,
                               target.max_context).kv.bytes_per_token
    engine = VerifierEngine(target.model, target.vocab_size, target.max_context,
                            kv_budget_bytes=budget_tokens * per_token)
    store = SessionStore(max_sessions=8, ttl_s=60, on_close=engine.release)
    metrics = VerifierMetrics()
    batcher = RoundBatcher(engine, metrics, holders=store.holding_kv, kv_wait_s=kv_wait_s)
    return engine, store, metrics, batcher


def _streamed(store: SessionStore, prompt: list[int]):
    session = store.create("me", SamplingParams(), list(prompt), 0, frozenset())
    session.streamed = True  # driven by a stream: not idle, so never evicted
    return session


def test_an_older_session_preempts_a_younger_one_whose_output_is_unchanged(target):
    """Budget 96 tokens. The younger session holds 64; the older one needs 41 more: it takes
    the younger one's memory. The younger one's next round waits (it cannot preempt an older
    session) until the older one closes, then recomputes its cache from its committed tokens;
    both outputs are the target's own."""
    engine, store, metrics, batcher = _tight_batcher(target, 96)
    budget = engine.kv.budget_bytes
    old_prompt, young_prompt = list(range(2, 42)), list(range(50, 90))
    old, young = _streamed(store, old_prompt), _streamed(store, young_prompt)
    assert old.seq < young.seq

    async def scenario():
        runner = asyncio.ensure_future(batcher.run_forever())

        async def step(session):
            return await batcher.submit(session, DraftRound([], None)).future

        for _ in range(3):
            await step(young)
        assert young.kv.capacity == 64 and engine.kv.bytes_in_use <= budget
        for _ in range(3):
            await step(old)  # the first preempts the younger session
        assert young.kv is None and old.kv is not None and engine.kv.bytes_in_use <= budget
        waiting = batcher.submit(young, DraftRound([], None))
        await asyncio.sleep(0.2)
        assert not waiting.future.done() and len(batcher) == 1  # waits, does not fail
        store.close(old.id)  # frees its memory
        await asyncio.wait_for(waiting.future, 5)
        for _ in range(2):
            await step(young)
        assert engine.kv.bytes_in_use <= budget
        runner.cancel()

    asyncio.run(scenario())
    assert metrics.preemptions._value.get() == 1
    assert old.committed == _greedy_tokens(target, old_prompt, 3)
    assert young.committed == _greedy_tokens(target, young_prompt, 6)


def test_a_round_that_waits_too_long_for_kv_memory_is_resource_exhausted(target):
    """An older session holds the memory and does not finish: after ``kv_wait_s`` the
    younger round fails with KVCacheFull (RESOURCE_EXHAUSTED); a round larger than the
    whole budget fails at once; the older session is undisturbed."""
    from cloud_verifier.errors import KVCacheFull

    engine, store, metrics, batcher = _tight_batcher(target, 96, kv_wait_s=0.1)
    old = _streamed(store, list(range(2, 42)))
    young = _streamed(store, list(range(50, 90)))
    huge = _streamed(store, list(range(3, 103)))

    async def scenario():
        runner = asyncio.ensure_future(batcher.run_forever())
        await batcher.submit(old, DraftRound([], None)).future
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        with pytest.raises(KVCacheFull, match="more than the whole budget"):
            await batcher.submit(huge, DraftRound([], None)).future
        assert loop.time() - t0 < 0.1  # at once, no waiting
        with pytest.raises(KVCacheFull, match="stayed in use by older sessions"):
            await batcher.submit(young, DraftRound([], None)).future
        assert loop.time() - t0 >= 0.1
        await batcher.submit(old, DraftRound([], None)).future
        runner.cancel()

    asyncio.run(scenario())
    assert metrics.preemptions._value.get() == 0 and young.kv is None and huge.kv is None
    assert old.committed == _greedy_tokens(target, list(range(2, 42)), 2)


def test_streamed_sessions_are_never_idle(target):
    engine = VerifierEngine(target.model, target.vocab_size, target.max_context)
    store = SessionStore(max_sessions=4, ttl_s=60, on_close=engine.release)
    plain = store.create("me", SamplingParams(), PROMPT, 0, frozenset())
    _streamed(store, PROMPT)
    assert store.idle_lru() == [plain]
