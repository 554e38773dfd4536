"""cloud_verifier.attention: the batched implementations equal one kernel per session."""

from __future__ import annotations

import pytest
import torch

from cloud_verifier.attention import AttentionPlan, check_attention, default_attention
from cloud_verifier.engine import VerifierEngine
from cloud_verifier.packed_forward import Segment, packed_logits
from cloud_verifier.sampling import SamplingParams
from cloud_verifier.sessions import SessionStore
from cloud_verifier.target_engine import DraftRound

PROMPTS = [3, 20, 1, 12, 7]
NEW = [5, 1, 3, 1, 7]  # new tokens per session: mixed K, decode rows among them


def prompt(i: int, n: int, vocab: int) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(i)).tolist()


def forward_twice(target, attention: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Prefill five sessions, then one forward with NEW tokens each; logits and caches."""
    engine = VerifierEngine(target.model, target.vocab_size, target.max_context)
    kvs = [engine.kv.ensure(None, p + n) for p, n in zip(PROMPTS, NEW, strict=True)]
    packed_logits(target.model, [Segment(kv, prompt(i, p, target.vocab_size), 1)
                                 for i, (kv, p) in enumerate(zip(kvs, PROMPTS, strict=True))],
                  attention)
    for kv, p in zip(kvs, PROMPTS, strict=True):
        kv.length = p
    logits = packed_logits(target.model, [Segment(kv, prompt(10 + i, n, target.vocab_size), n)
                                          for i, (kv, n) in enumerate(zip(kvs, NEW,
                                                                          strict=True))],
                           attention)
    return logits, [kv.buffer[:, :, :, :p + n].clone()
                    for kv, p, n in zip(kvs, PROMPTS, NEW, strict=True)]


def test_padded_equals_loop_logits_and_caches(target):
    """Both the prefill (different prompt lengths) and the verify forward (mixed K) give the
    per-session kernel's logits and write the same keys and values."""
    want_logits, want_kv = forward_twice(target, "loop")
    got_logits, got_kv = forward_twice(target, "padded")
    assert got_logits.shape == (sum(NEW), target.vocab_size)
    torch.testing.assert_close(got_logits, want_logits, atol=1e-5, rtol=1e-5)
    for got, want in zip(got_kv, want_kv, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def decode(target, attention: str, sampling: bool) -> list[list[int]]:
    engine = VerifierEngine(target.model, target.vocab_size, target.max_context,
                            attention=attention)
    store = SessionStore(max_sessions=8, ttl_s=60, on_close=engine.release)
    sessions = [store.create("me", SamplingParams(1.0 if sampling else 0.0, seed=i),
                             prompt(i, p, target.vocab_size), 0, frozenset())
                for i, p in enumerate(PROMPTS)]
    for r in range(6):
        engine.run_batch([(s, DraftRound([(7 * r + i) % target.vocab_size] * (i % 4),
                                         None)) for i, s in enumerate(sessions)])
    return [s.committed for s in sessions]


@pytest.mark.parametrize("sampling", [False, True], ids=["greedy", "sampling"])
def test_padded_engine_commits_the_same_tokens(target, sampling):
    """Five sessions, six batched rounds of mixed K: the same committed tokens either way."""
    assert decode(target, "padded", sampling) == decode(target, "loop", sampling)


def test_defaults_and_checks():
    assert default_attention(torch.device("cpu")) == "loop"
    assert default_attention(torch.device("cuda"), torch.float32) == "padded"
    with pytest.raises(ValueError, match="unknown attention"):
        check_attention("flash", torch.device("cpu"))
    with pytest.raises(ValueError, match="needs CUDA"):
        check_attention("varlen", torch.device("cpu"))


def test_padded_mask_is_bottom_right_causal_without_padding_keys():
    from cloud_verifier.kv_store import KVStore

    store = KVStore(1, 1, 2, torch.float32, torch.device("cpu"), None, 64)
    a, b = store.ensure(None, 8), store.ensure(None, 8)
    a.length, b.length = 2, 0
    mask = AttentionPlan.build([(a, 2), (b, 1)], torch.device("cpu"), "padded").tensors["mask"]
    assert mask.shape == (2, 1, 2, 4)
    assert mask[0, 0].tolist() == [[True, True, True, False], [True, True, True, True]]
    # Session b: one new token at position 0 sees key 0 only; its padded row too.
    assert mask[1, 0].tolist() == [[True, False, False, False], [True, False, False, False]]
