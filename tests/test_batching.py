"""Batched verification equals the same sessions run one at a time.

8 sessions with prompts of different lengths and different K (0..6) verify rounds together in
one packed forward; the same sessions run alone must commit the same tokens (greedy: token
identical; sampling with the same seeds: the same decisions).
"""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest
import torch
from stream_helpers import SessionCall, open_message, stream_error

from cloud_verifier.config import VerifierConfig
from cloud_verifier.engine import VerifierEngine
from cloud_verifier.packed_forward import Segment, packed_forward, sequential_forward
from cloud_verifier.sampling import SamplingParams
from cloud_verifier.server import EmbeddedVerifier
from cloud_verifier.sessions import SessionStore
from cloud_verifier.target_engine import DraftRound
from edge_client.client import EdgeClient, GenerationConfig
from shared import errors
from shared.pb import verifier_pb2 as pb
from shared.pb import verifier_pb2_grpc as pb_grpc

PROMPT_LENGTHS = [3, 20, 7, 12, 1, 30, 9, 15]
DRAFT_LENGTHS = [4, 1, 6, 0, 3, 5, 2, 4]
ROUNDS = 6


def prompt(i: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(100 + i)
    return torch.randint(3, vocab, (PROMPT_LENGTHS[i],), generator=g).tolist()


def drafts_for(committed: list[int], k: int, vocab: int, sampling: bool) -> DraftRound:
    """Deterministic in the committed tokens, so both runs propose the same drafts."""
    tokens = [(sum(committed) * (j + 7) + len(committed)) % vocab for j in range(k)]
    q = [([t, (t + 1) % vocab, (t + 2) % vocab], [0.5, 0.3, 0.2]) for t in tokens]
    return DraftRound(tokens, q if sampling else None)


def run(target, batched: bool, sampling: bool) -> list[list[int]]:
    engine = VerifierEngine(target.model, target.vocab_size, target.max_context)
    store = SessionStore(max_sessions=8, ttl_s=60, on_close=engine.release)
    params = SamplingParams(temperature=1.0 if sampling else 0.0, top_k=20)
    sessions = [store.create("me", SamplingParams(params.temperature, params.top_k, 1.0, seed=i),
                             prompt(i, target.vocab_size), 0, frozenset()) for i in range(8)]
    for _ in range(ROUNDS):
        rounds = [(s, drafts_for(s.committed, DRAFT_LENGTHS[i], target.vocab_size, sampling))
                  for i, s in enumerate(sessions)]
        if batched:
            outcomes = engine.run_batch(rounds)
            assert all(o.batch_sessions == 8 for o in outcomes)
        else:
            for s, d in rounds:
                engine.run_round(s, d)
    return [s.committed for s in sessions]


@pytest.mark.parametrize("sampling", [False, True], ids=["greedy", "sampling"])
def test_batched_rounds_equal_one_at_a_time(target, sampling):
    assert run(target, batched=True, sampling=sampling) == \
        run(target, batched=False, sampling=sampling)


@pytest.mark.parametrize("forward", [packed_forward, sequential_forward],
                         ids=["packed", "sequential-fallback"])
def test_forward_paths_match_the_model(target, forward):
    """Both forward paths, for three sessions, equal the model's own full forward."""
    engine = VerifierEngine(target.model, target.vocab_size, target.max_context)
    seqs = [prompt(i, target.vocab_size) + [5, 6, 7] for i in (0, 2, 5)]
    kvs = [engine.kv.ensure(None, len(s)) for s in seqs]
    forward(target.model, [Segment(kv, s[:-3], 1) for kv, s in zip(kvs, seqs, strict=True)])
    for kv, s in zip(kvs, seqs, strict=True):
        kv.length = len(s) - 3
    out = forward(target.model, [Segment(kv, s[-3:], 3)
                                 for kv, s in zip(kvs, seqs, strict=True)])
    with torch.no_grad():
        for got, s in zip(out, seqs, strict=True):
            want = target.model(torch.tensor([s])).logits[0, -3:]
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_concurrent_clients_get_their_own_output(target, tiny_llama_pair):
    """8 clients at once through gRPC (rounds share forwards) = each client alone."""
    config = VerifierConfig(port=0, gather_window_s=0.002)
    prompts = [prompt(i, target.vocab_size) for i in range(8)]

    def generate(address: str, i: int, out: dict) -> None:
        with EdgeClient(address, tiny_llama_pair.draft_dir) as client:
            gen = client.generate(prompts[i], GenerationConfig(
                max_new_tokens=24, draft_len=DRAFT_LENGTHS[i], temperature=0.8 * (i % 2),
                seed=i, ignore_eos=True))
            list(gen)
            out[i] = gen.token_ids

    with EmbeddedVerifier(target, config) as server:
        alone: dict[int, list[int]] = {}
        for i in range(8):
            generate(server.address, i, alone)
        together: dict[int, list[int]] = {}
        threads = [threading.Thread(target=generate, args=(server.address, i, together))
                   for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        batches = server.server.metrics.batch_sessions
        fitted_fixed_s = server.server.metrics.verify_fixed_seconds._value.get()
        cost_model = server.server.service.batcher.cost_model
    assert together == alone
    # The rounds really were batched: some forward served more than one session.
    assert _histogram_max_bucket_used(batches) > 1
    # ... and every forward fed the online cost fit the suggested draft length comes from.
    assert fitted_fixed_s > 0 and cost_model.fixed_ms == pytest.approx(fitted_fixed_s * 1000)
    assert all(c >= 0 for c in cost_model.relative_costs())


def _histogram_max_bucket_used(histogram) -> float:
    """Largest finite bucket bound that holds an observation (prometheus_client)."""
    samples = [s for m in histogram.collect() for s in m.samples if s.name.endswith("_bucket")]
    used, prev = 0.0, 0.0
    for s in samples:
        bound = float(s.labels["le"])
        if s.value > prev and bound != float("inf"):
            used = bound
        prev = s.value
    return used


def test_kv_budget_is_enforced(target):
    engine = VerifierEngine(target.model, target.vocab_size, target.max_context,
                            kv_budget_bytes=1)
    store = SessionStore(max_sessions=1, ttl_s=60, on_close=engine.release)
    session = store.create("me", SamplingParams(), [5, 6, 7], 0, frozenset())
    from cloud_verifier.errors import KVCacheFull

    with pytest.raises(KVCacheFull):
        engine.run_round(session, DraftRound([1], None))
    assert engine.kv.bytes_in_use == 0 and session.committed == [5, 6, 7]


def test_kv_budget_exhaustion_is_resource_exhausted(target):
    """A round that cannot fit even after evicting every idle session is refused cleanly,
    with OVERLOADED and a retry delay."""
    config = VerifierConfig(port=0, kv_budget_bytes=64 * engine_bytes_per_token(target))
    with EmbeddedVerifier(target, config) as server, \
            grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.VerifierServiceStub(channel)
        err = stream_error(stub, open_message([5] * 80, first=[]))
        assert (err.code, err.reason) == (grpc.StatusCode.RESOURCE_EXHAUSTED, errors.OVERLOADED)
        assert err.retry_after_s is not None and err.retry_after_s > 0
        assert server.server.service.engine.kv.bytes_in_use == 0
        with SessionCall(stub, open_message([5] * 30, first=[])) as call:
            assert call.step().committed_length == 31
            assert server.server.service.engine.kv.bytes_in_use <= config.kv_budget_bytes


def engine_bytes_per_token(target) -> int:
    return VerifierEngine(target.model, target.vocab_size, target.max_context).kv.bytes_per_token


def test_failed_open_leaves_no_session_behind(target):
    config = VerifierConfig(port=0, kv_budget_bytes=64 * engine_bytes_per_token(target))
    with EmbeddedVerifier(target, config) as server, \
            grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.VerifierServiceStub(channel)
        stream_error(stub, open_message([5] * 80, first=[]))
        server.call(asyncio.sleep(0.05))  # let a close after a round in flight run
        assert len(server.server.service.store) == 0


def test_concurrent_streams_share_forwards(target):
    """Streamed sessions (Generate, Decode) resubmit right after each answer; the batcher
    waits briefly for them, so four streams of 24 tokens take about 24 forwards, not 96."""
    import threading

    with EmbeddedVerifier(target, VerifierConfig(port=0)) as server:
        engine = server.server.service.engine
        batches: list[int] = []
        run_batch = engine.run_batch

        def counting(rounds):
            batches.append(len(rounds))
            return run_batch(rounds)

        engine.run_batch = counting
        outputs: dict[int, list[int]] = {}

        def stream(i: int) -> None:
            with grpc.insecure_channel(server.address) as channel:
                replies = pb_grpc.VerifierServiceStub(channel).Generate(pb.GenerateRequest(
                    prompt_token_ids=[1, 5 + i, 9], max_new_tokens=24, ignore_eos=True))
                outputs[i] = [t for r in replies for t in r.step.token_ids]

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert sorted(outputs) == [0, 1, 2, 3] and all(len(o) == 24 for o in outputs.values())
    # The streams start at slightly different times; after that they share every forward.
    assert len(batches) <= 24 + 6, batches
    assert sum(batches) == 4 * 24


@pytest.mark.parametrize("rows", [1, 2, 3, 9, 20])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("kernel", ["packed", "x_wt", "w_xt", "unpacked"])
def test_every_projection_kernel_equals_nn_linear(rows, bias, kernel):
    """``_linear`` through each kernel it can choose (or nn.Linear's path, without packed
    weights) gives nn.Linear's numbers, with or without a bias (Qwen2-style q/k/v
    projections), for one row, a few and many."""
    from cloud_verifier.packed_forward import CpuKernels, _linear, pack_weight

    torch.manual_seed(rows)
    layer = torch.nn.Linear(24, 40, bias=bias)
    x = torch.randn(1, rows, 24)
    kernels = (CpuKernels() if kernel == "unpacked"
               else CpuKernels({layer: pack_weight(layer.weight)}, {rows: kernel}))
    with torch.no_grad():
        out = _linear(x, layer, kernels)
        torch.testing.assert_close(out, layer(x), atol=1e-5, rtol=1e-5)
    # Contiguous, so the attention that reads the q/k/v projections gets a last-dimension
    # stride of 1 and takes the fused kernel, not the math fallback (packed_forward docstring).
    assert out.is_contiguous()


def test_few_row_kernels_are_timed_and_followed(monkeypatch):
    """tune_kernels picks, for every row count up to TUNED_ROWS, the kernel with the least
    measured time (here made known by a fake clock), and _linear runs the chosen one; more
    rows take the packed kernel."""
    import cloud_verifier.packed_forward as pf

    layers = [torch.nn.Linear(8, 8, bias=False) for _ in range(2)]
    packed = {m: pf.pack_weight(m.weight) for m in layers}
    slow = {"packed": {1: 3.0, 2: 1.0, 3: 2.0, 4: 1.0}, "x_wt": {1: 1.0, 2: 2.0, 3: 3.0, 4: 2.0},
            "w_xt": {1: 2.0, 2: 3.0, 3: 1.0, 4: 3.0}}
    clock = [0.0]
    real = pf._multiply

    def timed(rows, layer, weights, kernel):
        clock[0] += slow[kernel][rows.shape[0]]
        return real(rows, layer, weights, kernel)

    monkeypatch.setattr(pf, "_multiply", timed)
    monkeypatch.setattr(pf.time, "perf_counter", lambda: clock[0])
    choice = pf.tune_kernels(layers, packed)
    assert choice == {1: "x_wt", 2: "packed", 3: "w_xt", 4: "packed"}
    used = []
    monkeypatch.setattr(pf, "_multiply", lambda rows, layer, weights, kernel:
                        used.append(kernel) or real(rows, layer, weights, kernel))
    kernels = pf.CpuKernels(packed, choice)
    with torch.no_grad():
        for n in (1, 2, 3, 7):
            pf._linear(torch.randn(n, 8), layers[0], kernels)
    assert used == ["x_wt", "packed", "w_xt", "packed"]


@pytest.mark.parametrize("shape", [(1, 1), (2, 1), (3, 4), (12, 1)], ids=str)
def test_packed_attention_takes_the_fused_kernel(target, shape):
    """Attention in every packed forward (few rows or many) runs PyTorch's fused CPU kernel,
    never the math fallback, which a strided q/k/v projection silently selects (it cost 30 ms
    of a 75 ms 8-session decode step on the real target)."""
    from torch.profiler import ProfilerActivity, profile

    sessions, new = shape
    engine = VerifierEngine(target.model, target.vocab_size, target.max_context)
    segments = []
    for i in range(sessions):
        kv = engine.kv.ensure(None, PROMPT_LENGTHS[i % 8] + new)
        packed_forward(target.model, [Segment(kv, prompt(i % 8, target.vocab_size), 1)])
        kv.length = PROMPT_LENGTHS[i % 8]
        segments.append(Segment(kv, list(range(3, 3 + new)), new))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        packed_forward(target.model, segments)
    kernels = {e.key for e in prof.key_averages() if e.key.startswith("aten::_scaled_dot")}
    assert kernels == {"aten::_scaled_dot_product_flash_attention_for_cpu"}, kernels
