"""VerifierEngine on a tiny target: the KV cache after every round is exactly the cache of a
fresh forward over the committed tokens but the last (explicit rollback)."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from cloud_verifier.engine import VerifierEngine
from cloud_verifier.errors import ContextTooLong
from cloud_verifier.kv_store import SessionKV
from cloud_verifier.sampling import SamplingParams
from cloud_verifier.sessions import SessionStore
from cloud_verifier.target_engine import DraftRound

PROMPT = [1, 17, 42, 5, 63, 8]


def fresh_cache(model, tokens: list[int]) -> DynamicCache:
    cache = DynamicCache()
    with torch.no_grad():
        model(input_ids=torch.tensor([tokens]), past_key_values=cache, use_cache=True)
    return cache


def assert_same_cache(got: SessionKV, want: DynamicCache) -> None:
    """The session's valid KV positions equal a fresh forward's cache."""
    assert got.length == want.get_seq_length()
    for i, w in enumerate(want.layers):
        torch.testing.assert_close(got.keys(i)[None, :, :got.length], w.keys, atol=1e-5,
                                   rtol=1e-4)
        torch.testing.assert_close(got.values(i)[None, :, :got.length], w.values, atol=1e-5,
                                   rtol=1e-4)


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampling"])
def test_cache_is_rolled_back_to_committed_prefix_every_round(target, temperature):
    engine = VerifierEngine(target.model, target.vocab_size, target.max_context)
    store = SessionStore(max_sessions=1, ttl_s=60)
    session = store.create("me", SamplingParams(temperature=temperature, seed=7), PROMPT, 0,
                           frozenset())
    gen = torch.Generator().manual_seed(0)
    for _ in range(8):
        drafts = torch.randint(3, target.vocab_size, (4,), generator=gen).tolist()
        q = None
        if temperature:
            q = [([d, (d + 1) % target.vocab_size], [0.75, 0.25]) for d in drafts]
        outcome = engine.run_round(session, DraftRound(drafts, q))
        assert outcome.committed == drafts[:outcome.num_accepted] + [outcome.next_token]
        assert session.cache_len == len(session.committed) - 1
        assert_same_cache(session.kv, fresh_cache(target.model, session.committed[:-1]))


def test_round_that_does_not_fit_leaves_the_session_untouched(target):
    engine = VerifierEngine(target.model, target.vocab_size, max_context=len(PROMPT) + 3)
    store = SessionStore(max_sessions=1, ttl_s=60)
    session = store.create("me", SamplingParams(), PROMPT, 0, frozenset())
    with pytest.raises(ContextTooLong):
        engine.run_round(session, DraftRound([5, 6, 7], None))
    assert session.committed == PROMPT and session.kv is None
    engine.run_round(session, DraftRound([5, 6], None))
    assert len(session.committed) <= len(PROMPT) + 3


def test_kv_byte_count_and_budget_hold_under_concurrent_allocation():
    """A round's room is allocated on the forward's thread while the event loop frees buffers
    and restores prefixes. 2 threads x 40,000 allocate/free pairs, with the interpreter
    switching threads every microsecond, must leave the count exact and never see it over
    the budget."""
    import sys
    import threading

    from cloud_verifier.kv_store import KVBudgetExceeded, KVStore

    store = KVStore(num_layers=2, kv_heads=1, head_dim=4, dtype=torch.float32,
                    device=torch.device("cpu"), budget_bytes=None, max_context=64)
    one = store.growth_bytes(None, 1)
    store.budget_bytes = one  # one buffer at a time: two would be over
    over: list[int] = []

    def churn() -> None:
        for _ in range(40_000):
            try:
                kv = store.ensure(None, 1)
            except KVBudgetExceeded:
                continue
            if store.bytes_in_use > store.budget_bytes:
                over.append(store.bytes_in_use)
            store.release(kv)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=churn) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert store.bytes_in_use == 0 and over == []
