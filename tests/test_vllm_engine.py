"""The vLLM engine (``cloud_verifier.vllm_engine``) on the real SmolLM2 target, in the vLLM
environment (``make test-vllm``): greedy identity with vLLM's own greedy generation, the law
of sampled output, prefill bounded by vLLM's prefix cache, cache eviction, and the whole
stack (gRPC, the client core, the shipped ONNX draft) on top of it.

vLLM is started once for the module (about 10-30 s). Under CI a missing vLLM fails.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from conftest import require_vllm

from cloud_verifier.sampling import SamplingParams
from cloud_verifier.sessions import SessionStore
from cloud_verifier.target_engine import DraftRound

pytestmark = pytest.mark.vllm

K = 4
NEW_TOKENS = 64
NUM_PROMPTS = 48


@pytest.fixture(scope="module")
def vllm_target(real_assets):
    require_vllm()
    from cloud_verifier.vllm_engine import VllmSettings, load_vllm_engine

    return load_vllm_engine(real_assets[0], 2048, VllmSettings())


@pytest.fixture(scope="module")
def prompts(vllm_target) -> list[list[int]]:
    from cloud_verifier.bench.engine_identity import realistic_prompts

    target, _ = vllm_target
    # Every category of the realistic set, in turn; IME prefixes are raw text.
    ids = realistic_prompts(target.tokenizer, NUM_PROMPTS)
    assert len(ids) == NUM_PROMPTS
    return ids


@pytest.fixture(scope="module")
def vllm_greedy(vllm_target, prompts) -> list[list[int]]:
    """vLLM's own greedy generation of the same checkpoint: the reference."""
    from vllm import SamplingParams as VllmParams
    from vllm.inputs import TokensPrompt

    _, engine = vllm_target
    outputs = engine.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                                  VllmParams(max_tokens=NEW_TOKENS, temperature=0.0,
                                             ignore_eos=True, detokenize=False),
                                  use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def drafts_from(reference: list[int], n: int, rng: random.Random) -> list[int]:
    """K drafts: the reference's next tokens, one of them wrong in about half the rounds
    (so rounds end in rejections, corrections and bonuses alike)."""
    drafts = list(reference[n:n + K])
    if drafts and rng.random() < 0.5:
        i = rng.randrange(len(drafts))
        drafts[i] = (drafts[i] + 1 + rng.randrange(1000)) % 49152
    return drafts


def run_sessions(engine, prompts, references, sampling=None, between_rounds=None):
    """Every session's rounds batched together, as the verifier's batcher runs them; returns
    the new tokens of each and every round's fed (prefilled) token count."""
    store = SessionStore(max_sessions=len(prompts), ttl_s=600)
    sessions = [store.create("tenant", sampling or SamplingParams(), list(p), NEW_TOKENS,
                             frozenset()) for p in prompts]
    rng, fed, round_no = random.Random(0), [], 0
    while live := [s for s in sessions if not s.finished]:
        rounds = [(s, DraftRound(drafts_from(r, len(s.committed) - s.prompt_len, rng), None))
                  for s, r in zip(sessions, references, strict=True) if not s.finished]
        for outcome in engine.run_batch(rounds):
            assert not isinstance(outcome, Exception), outcome
            fed.append((round_no, outcome.fed_tokens))
        round_no += 1
        if between_rounds:
            between_rounds(round_no, live)
    return [s.committed[s.prompt_len:] for s in sessions], fed


def test_greedy_rounds_are_vllms_own_greedy_generation(vllm_target, prompts, vllm_greedy):
    """48 realistic prompts x 64 tokens, K = 4, drafts right and wrong: every token is the
    one vLLM's own greedy decoding picks (100 %, no tolerance: both read vLLM's logits)."""
    _, engine = vllm_target
    got, fed = run_sessions(engine, prompts, vllm_greedy)
    diverged = [i for i, (g, want) in enumerate(zip(got, vllm_greedy, strict=True))
                if g != want]
    assert not diverged, f"prompts {diverged} diverge from vLLM's greedy output"
    # After a session's first round (its whole prompt), vLLM's prefix cache holds the
    # committed context: a round prefills at most K + 1 + one block (32 tokens here).
    later = [n for r, n in fed if r > 0]
    assert later and max(later) <= K + 1 + 32, max(later)
    assert engine.reruns == 0


def test_an_evicted_prefix_cache_changes_nothing_but_the_prefill(vllm_target, prompts,
                                                                 vllm_greedy):
    """vLLM's prefix cache dropped whole (reset_prefix_cache) every 5 rounds: the next round
    prefills the whole context again, and the output is still vLLM's greedy output."""
    _, engine = vllm_target

    def evict(round_no, live):
        if round_no % 5 == 0:
            assert engine.llm.reset_prefix_cache()

    chosen = [i for i, p in enumerate(prompts) if len(p) > K + 1 + 32][:6]
    got, fed = run_sessions(engine, [prompts[i] for i in chosen],
                            [vllm_greedy[i] for i in chosen], between_rounds=evict)
    assert got == [vllm_greedy[i] for i in chosen]
    after_eviction = [n for r, n in fed if r > 0 and r % 5 == 0]
    assert min(after_eviction) > K + 1 + 32  # the context was prefilled again


def target_law(engine, prompt: list[int], temperature: float, top_k: int) -> np.ndarray:
    """p_1 for ``prompt`` from vLLM's full-vocabulary logprobs, shaped as the session's
    sampling parameters shape it (temperature, then top-k renormalised)."""
    from vllm import SamplingParams as VllmParams
    from vllm.inputs import TokensPrompt

    out = engine.llm.generate([TokensPrompt(prompt_token_ids=prompt)],
                              VllmParams(max_tokens=1, temperature=0.0, logprobs=-1,
                                         detokenize=False, flat_logprobs=True),
                              use_tqdm=False)[0].outputs[0].logprobs
    logits = np.full(engine.vocab_size, -np.inf)
    logits[out.token_ids] = out.logprobs
    logits = logits / temperature
    if top_k:
        logits[logits < np.sort(logits)[-top_k]] = -np.inf
    p = np.exp(logits - logits.max())
    return p / p.sum()


@pytest.mark.parametrize("temperature,top_k,n", [(1.0, 20, 2000), (0.8, 0, 2000)],
                         ids=["top-k-20", "full-vocabulary"])
def test_sampled_rounds_are_distributed_as_the_target(vllm_target, temperature, top_k, n):
    """One round per session (K = 1, the draft sampled from a q that is not p), n sessions
    with distinct seeds: the committed token's law is p_1. Bound per token bin: |count - n
    p| <= 6 sqrt(n p (1 - p)) + 5; the test has power (q's law breaks the bound). Seeds are
    reproducible: the first 50 sessions again give the same tokens."""
    target, engine = vllm_target
    # One token of context: every position of a prompt gets its logprobs, and a
    # full-vocabulary row is V entries on the host.
    prompt = [target.tokenizer.bos_token_id or 1]
    p = target_law(engine, prompt, temperature, top_k)
    top = np.argsort(p)[::-1][:6]
    # q: the target's top tokens in the wrong proportions, plus one it never picks first.
    q_ids = [int(t) for t in top[:4]] + [int(np.argsort(p)[0])]
    q_probs = np.array([0.1, 0.1, 0.3, 0.3, 0.2])
    rng = np.random.default_rng(7)

    def run(seeds: list[int], drafts: list[int]) -> list[int]:
        store = SessionStore(max_sessions=len(seeds), ttl_s=600)
        out = []
        for start in range(0, len(seeds), 250):
            batch = []
            for seed, d in zip(seeds[start:start + 250], drafts[start:start + 250],
                               strict=True):
                s = store.create("tenant", SamplingParams(temperature=temperature,
                                                          top_k=top_k, seed=seed),
                                 list(prompt), 1, frozenset())
                batch.append((s, DraftRound([d], [(q_ids, q_probs.tolist())])))
            for outcome in engine.run_batch(batch):
                assert not isinstance(outcome, Exception), outcome
                out.append(outcome.committed[0])
        return out

    seeds = list(range(10**6, 10**6 + n))
    drafts = [q_ids[i] for i in rng.choice(len(q_ids), size=n, p=q_probs)]
    tokens = run(seeds, drafts)
    assert run(seeds[:50], drafts[:50]) == tokens[:50]
    counts = np.bincount(tokens, minlength=engine.vocab_size)[top]
    expected = n * p[top]
    bound = 6 * np.sqrt(n * p[top] * (1 - p[top])) + 5
    assert np.all(np.abs(counts - expected) <= bound), (counts, expected, bound)
    q_law = np.zeros(engine.vocab_size)
    q_law[q_ids] = q_probs
    assert np.any(np.abs(n * q_law[top] - expected) > bound)  # the bound can fail


def test_the_client_core_over_grpc_on_vllm_is_vllms_greedy_output(vllm_target, prompts,
                                                                  vllm_greedy):
    """The whole stack on the vLLM engine: gRPC, the client core, the shipped ONNX draft.
    Then the verifier restarts (a new server on the same engine, vLLM's cache dropped) and
    a new generation runs again, identical."""
    from cloud_verifier.config import VerifierConfig
    from cloud_verifier.server import EmbeddedVerifier
    from edge_client.client import EdgeClient
    from edge_client.generation_config import GenerationConfig
    from shared.paths import default_draft_dir

    target, engine = vllm_target
    config = GenerationConfig(max_new_tokens=32, draft_len=K)
    for attempt in range(2):
        with EmbeddedVerifier(target, VerifierConfig(port=0), engine) as verifier, \
                EdgeClient(verifier.address, default_draft_dir()) as client:
            for ids, want in zip(prompts[:3], vllm_greedy[:3], strict=True):
                gen = client.generate(ids, config)
                list(gen)
                assert gen.token_ids == want[:32], attempt
                assert gen.stats.rounds < 32  # multi-token rounds: drafts were accepted
        engine.llm.reset_prefix_cache()


PRESSURE_BLOCKS = 48  # x 32 tokens: 1,536 tokens of KV for sessions that need about 2,200


@pytest.fixture(scope="module")
def starved(real_assets):
    """A second vLLM on the same checkpoint whose KV pool is far too small for the sessions
    batched on it: vLLM must preempt running requests and evict cached prefixes."""
    require_vllm()
    from cloud_verifier.vllm_engine import VllmSettings, load_vllm_engine

    return load_vllm_engine(real_assets[0], 1024,
                            VllmSettings(num_blocks=PRESSURE_BLOCKS, block_size=32))[1]


def test_under_vllms_kv_pressure_the_output_is_unchanged(starved, prompts, vllm_greedy):
    """16 sessions whose contexts add up to more than the pool holds, all their rounds batched:
    rounds lose their cached context (whole prefills again, counted) and the output is still
    vLLM's greedy output of the unstarved instance."""
    chosen = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))[:16]
    need = sum(len(prompts[i]) + NEW_TOKENS for i in chosen)
    assert need > PRESSURE_BLOCKS * 32, need
    got, fed = run_sessions(starved, [prompts[i] for i in chosen],
                            [vllm_greedy[i] for i in chosen])
    assert got == [vllm_greedy[i] for i in chosen]
    prefilled_again = [n for r, n in fed if r > 0 and n > K + 1 + 32]
    assert prefilled_again, "the pool never ran short: no cached context was lost"
