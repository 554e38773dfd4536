"""cloud_verifier.batched_verification: a whole batch decided at once equals each session
decided alone by the reference (cloud_verifier.verification), exactly, sampled tokens included."""

from __future__ import annotations

import math
import random

import pytest
import torch

from cloud_verifier.batched_verification import round_uniforms, verify_batch
from cloud_verifier.sampling import SamplingParams, target_probs
from cloud_verifier.verification import sparse_to_dense, verify, verify_greedy

V = 40


def reference(logits, drafts, qs, params, seeds):
    """Each session alone, as the engine decided before batching."""
    out, start = [], 0
    for tokens, q, sp, seed in zip(drafts, qs, params, seeds, strict=True):
        rows = logits[start:start + len(tokens) + 1]
        start += len(tokens) + 1
        if sp.is_greedy:
            out.append((*verify_greedy(tokens, rows), True))
            continue
        dense = None if q is None else sparse_to_dense([i for i, _ in q], [p for _, p in q], V)
        gen = torch.Generator().manual_seed(seed)
        out.append((*verify(tokens, dense, target_probs(rows, sp), gen), True))
    return out


def batched(logits, drafts, qs, params, seeds):
    k_max = max(len(t) for t in drafts)
    uniforms = torch.zeros(len(drafts), k_max + 1, dtype=torch.float64)
    for b, (tokens, sp, seed) in enumerate(zip(drafts, params, seeds, strict=True)):
        if not sp.is_greedy:
            uniforms[b, :len(tokens) + 1] = round_uniforms(torch.Generator().manual_seed(seed),
                                                           len(tokens))
    return verify_batch(logits, drafts, qs, params, uniforms).tolist()


def random_batch(rng: random.Random):
    """Sessions with K in 0..6, greedy or sampling (temperature, top-k, top-p mixed), sparse q
    with a random support holding the draft or point masses, peaked random logits; drafts
    follow the argmax half the time so that acceptance runs of every length occur."""
    b = rng.randint(1, 7)
    drafts, qs, params, seeds, rows = [], [], [], [], []
    for _ in range(b):
        k = rng.randint(0, 6)
        gen = torch.Generator().manual_seed(rng.randrange(2**31))
        logits = torch.randn(k + 1, V, generator=gen)
        logits *= rng.choice([0.5, 2.0, 6.0])
        rows.append(logits)
        greedy = rng.random() < 0.3
        sp = SamplingParams(0.0 if greedy else rng.choice([0.3, 0.7, 1.0, 1.5]),
                            rng.choice([0, 0, 3, 10, V]), rng.choice([1.0, 1.0, 0.9, 0.5]),
                            seed=rng.randrange(2**40))
        tokens = [int(logits[j].argmax()) if rng.random() < 0.5 else rng.randrange(V)
                  for j in range(k)]
        if greedy or rng.random() < 0.4:
            q = None
        else:
            q = []
            for t in tokens:
                ids = [t] + rng.sample([i for i in range(V) if i != t], rng.randint(0, 6))
                w = [rng.random() + 0.01 for _ in ids]
                q.append((ids, [x / sum(w) for x in w]))
        drafts.append(tokens)
        qs.append(q)
        params.append(sp)
        seeds.append(rng.randrange(2**62))
    return torch.cat(rows), drafts, qs, params, seeds


def test_random_batches_equal_sessions_decided_alone():
    """250 random batches (about 1,000 sessions): every (n, next token) identical; and they
    exercise every n in 0..6, corrections and bonuses, greedy and sampling (otherwise the
    equality would not cover those paths)."""
    rng = random.Random(0)
    sessions, seen = 0, set()
    for _ in range(250):
        batch = random_batch(rng)
        got = batched(*batch)
        assert got == reference(*batch)
        for (n, _, _), tokens, sp in zip(got, batch[1], batch[3], strict=True):
            seen.add((n, n == len(tokens), sp.is_greedy))
        sessions += len(batch[1])
    assert sessions > 800
    assert {n for n, _, _ in seen} == set(range(7))
    assert {(bonus, greedy) for _, bonus, greedy in seen} == {(True, True), (True, False),
                                                               (False, True), (False, False)}


def test_empty_residual_falls_back_to_p_as_alone():
    # p sums below q (float round-off): a rejected draft leaves max(0, p - q) = 0.
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]))
    global V
    old, V = V, 4
    try:
        sp = SamplingParams(1.0, seed=0)
        probs = target_probs(logits, sp)
        q = [([0, 1], [float(probs[0, 0]), float(probs[0, 0])])]
        assert float(probs[0, 1]) < float(probs[0, 0])  # so max(0, p - q) = 0
        for seed in range(50):
            args = (logits, [[1]], [q], [sp], [seed])
            assert batched(*args) == reference(*args)
    finally:
        V = old


def test_invalid_logits_flag_only_their_session():
    """A sampling session whose logits have a NaN is flagged invalid (the engine fails that
    round); the other sessions of the batch are decided as alone."""
    rng = random.Random(1)
    logits, drafts, qs, params, seeds = random_batch(rng)
    while len(drafts) < 2 or params[0].is_greedy:
        logits, drafts, qs, params, seeds = random_batch(rng)
    logits[0, 3] = math.nan
    out = batched(logits, drafts, qs, params, seeds)
    assert out[0][2] is False
    want = reference(logits[len(drafts[0]) + 1:], drafts[1:], qs[1:], params[1:], seeds[1:])
    assert out[1:] == want


@pytest.mark.parametrize("case, match", [
    (dict(drafts=[[V]]), "out of range"),
    (dict(qs=[[([5], [1.0])]]), "q = 0"),
    (dict(qs=[[([3, 3], [0.5, 0.5])]]), "listed twice"),
    (dict(logits=torch.zeros(3, V)), "logits must be"),
])
def test_bad_input_is_refused_before_any_work(case, match):
    args = dict(logits=torch.zeros(2, V), drafts=[[3]], qs=[[([3], [1.0])]],
                params=[SamplingParams(1.0)])
    args.update(case)
    uniforms = torch.zeros(1, 2, dtype=torch.float64)
    with pytest.raises(ValueError, match=match):
        verify_batch(args["logits"], args["drafts"], args["qs"], args["params"], uniforms)


def test_uniforms_are_the_reference_draws():
    """K + 1 uniforms at once are the numbers K + 1 single draws give."""
    g = torch.Generator().manual_seed(7)
    at_once = round_uniforms(g, 9).tolist()
    g.manual_seed(7)
    assert at_once == [torch.rand((), dtype=torch.float64, generator=g).item() for _ in range(10)]
