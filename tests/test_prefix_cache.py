"""Prefix caching (cloud_verifier.prefix_cache): what is kept, what a new session reuses, who
may reuse it, the memory it may hold, and that reuse changes no output."""

from __future__ import annotations

import threading

import grpc
import torch
from stream_helpers import SessionCall, open_message, verify_message

from cloud_verifier import torch_thread
from cloud_verifier.config import VerifierConfig, key_digest
from cloud_verifier.engine import VerifierEngine
from cloud_verifier.kv_store import KVStore, SessionKV
from cloud_verifier.prefix_cache import PrefixCache, common_prefix_len
from cloud_verifier.server import EmbeddedVerifier
from shared.pb import verifier_pb2 as pb
from shared.pb import verifier_pb2_grpc as pb_grpc

BYTES_PER_TOKEN = 2 * 2 * 1 * 4 * 4  # k/v x 2 layers x 1 head x head_dim 4 x float32


def store(budget: int | None = None) -> KVStore:
    return KVStore(num_layers=2, kv_heads=1, head_dim=4, dtype=torch.float32,
                   device=torch.device("cpu"), budget_bytes=budget, max_context=512)


def filled(kv_store: KVStore, tokens: list[int]) -> SessionKV:
    """A buffer over ``tokens`` whose key/value at position i is the token id (recognisable
    after a copy)."""
    kv = kv_store.ensure(None, len(tokens))
    kv.buffer[:, :, :, :len(tokens)] = torch.tensor(tokens, dtype=torch.float32)[:, None]
    kv.length = len(tokens)
    return kv


def cached_tokens(kv: SessionKV) -> list[int]:
    """Read on the torch thread, after the restore's copy queued there."""
    return torch_thread.run(lambda: kv.buffer[0, 0, 0, :kv.length, 0].long().tolist())


def test_common_prefix_len():
    import numpy as np

    a = np.array([1, 2, 3, 4])
    assert common_prefix_len(a, np.array([1, 2, 9])) == 2
    assert common_prefix_len(a, np.array([1, 2])) == 2
    assert common_prefix_len(a, np.array([7])) == 0
    assert common_prefix_len(a, np.array([], dtype=int)) == 0


def test_a_buffer_grown_before_its_restore_copy_ran_still_holds_the_prefix():
    """Under a tight KV budget a restored buffer holds just the prompt, so the session's
    first round grows it from the event loop, possibly while the restore's copy is still
    queued behind a forward on the torch thread. The grown buffer must hold the prefix all
    the same (it held uninitialised memory when the growth copied at once)."""
    s = store()
    cache = PrefixCache(s, max_bytes=1 << 20, ttl_s=60)
    cache.keep("alice", [1, 2, 3, 4, 5, 6], filled(s, [1, 2, 3, 4, 5, 6]))
    busy = threading.Event()
    torch_thread.submit(busy.wait)  # a forward in progress, done in 0.3 s
    threading.Timer(0.3, busy.set).start()
    kv = cache.restore("alice", [1, 2, 3, 4, 5, 7])  # its copy waits behind the forward
    grown = s.ensure(kv, kv.capacity + 10)  # from another thread, meanwhile
    assert grown is not kv and cached_tokens(grown) == [1, 2, 3, 4, 5]


def test_a_grown_buffer_is_complete_when_ensure_returns():
    """Callers off the torch thread (an in-process benchmark's forwards) read the grown
    buffer at once: the growth copy has finished by then."""
    s = store()
    kv = filled(s, [4, 5, 6])
    grown = s.ensure(kv, kv.capacity + 1)
    assert grown.buffer[0, 0, 0, :3, 0].long().tolist() == [4, 5, 6] and grown.length == 3


def test_restore_copies_the_longest_shared_prefix_of_the_owners_buffers():
    s = store()
    cache = PrefixCache(s, max_bytes=1 << 20, ttl_s=60)
    cache.keep("alice", [1, 2, 3, 4, 5, 6], filled(s, [1, 2, 3, 4, 5, 6]))
    cache.keep("alice", [1, 2, 9, 9], filled(s, [1, 2, 9, 9]))
    kv = cache.restore("alice", [1, 2, 3, 4, 7, 8])
    assert kv is not None and kv.length == 4 and cached_tokens(kv) == [1, 2, 3, 4]
    assert kv.capacity >= 6  # room for the whole prompt
    # The kept buffers are untouched and still there for the next session.
    assert len(cache) == 2 and cache.restore("alice", [1, 2, 9, 9, 5]).length == 4


def test_the_last_prompt_token_is_always_fed():
    s = store()
    cache = PrefixCache(s, max_bytes=1 << 20, ttl_s=60)
    cache.keep("alice", [1, 2, 3, 4], filled(s, [1, 2, 3, 4]))
    assert cache.restore("alice", [1, 2, 3, 4]).length == 3
    assert cache.restore("alice", [1, 2]).length == 1
    assert cache.restore("alice", [1]) is None
    assert cache.restore("alice", [5, 1, 2]) is None


def test_an_owner_never_reuses_another_owners_tokens():
    s = store()
    cache = PrefixCache(s, max_bytes=1 << 20, ttl_s=60)
    cache.keep("alice", [1, 2, 3, 4], filled(s, [1, 2, 3, 4]))
    assert cache.restore("bob", [1, 2, 3, 4, 5]) is None
    assert cache.restore("alice", [1, 2, 3, 4, 5]).length == 4


def test_bytes_are_bounded_least_recently_used_first_and_accounted():
    s = store()
    one = s.ensure(None, 4).nbytes  # MIN_CAPACITY positions
    s.bytes_in_use = 0
    cache = PrefixCache(s, max_bytes=2 * one, ttl_s=60)
    cache.keep("a", [1, 1], filled(s, [1, 1]))
    cache.keep("a", [2, 2], filled(s, [2, 2]))
    assert cache.restore("a", [1, 1, 5]).length == 2  # [1, 1] is now the most recent
    restored_bytes = s.bytes_in_use - cache.nbytes
    cache.keep("a", [3, 3], filled(s, [3, 3]))  # over the cap: [2, 2] goes
    assert len(cache) == 2 and cache.nbytes == 2 * one
    assert cache.restore("a", [2, 2, 5]) is None
    assert s.bytes_in_use == cache.nbytes + restored_bytes
    assert cache.free(lambda: False) == 2 and cache.nbytes == 0
    assert s.bytes_in_use == restored_bytes


def test_a_kept_prefix_of_a_newer_buffer_is_dropped():
    s = store()
    cache = PrefixCache(s, max_bytes=1 << 20, ttl_s=60)
    cache.keep("a", [1, 2], filled(s, [1, 2]))
    cache.keep("b", [1, 2], filled(s, [1, 2]))
    cache.keep("a", [1, 2, 3], filled(s, [1, 2, 3]))
    assert len(cache) == 2  # a's [1, 2] went, b's stays (another owner)


def test_nothing_is_kept_when_disabled_or_empty():
    s = store()
    off = PrefixCache(s, max_bytes=0, ttl_s=60)
    off.keep("a", [1, 2], filled(s, [1, 2]))
    assert len(off) == 0 and s.bytes_in_use == 0 and off.restore("a", [1, 2, 3]) is None
    on = PrefixCache(s, max_bytes=1 << 20, ttl_s=60)
    empty = s.ensure(None, 4)
    on.keep("a", [], empty)
    assert len(on) == 0 and s.bytes_in_use == 0


def test_unused_buffers_expire_after_the_ttl():
    now = [0.0]
    s = store()
    cache = PrefixCache(s, max_bytes=1 << 20, ttl_s=10, clock=lambda: now[0])
    cache.keep("a", [1, 2, 3], filled(s, [1, 2, 3]))
    now[0] = 8.0
    assert cache.restore("a", [1, 2, 3, 4]).length == 3  # use renews it
    now[0] = 16.0
    assert cache.expire() == 0
    now[0] = 19.0
    assert cache.restore("a", [1, 2, 3, 4]) is None and len(cache) == 0


def test_restore_frees_other_kept_buffers_for_its_own_within_the_kv_budget():
    s = store(budget=None)
    one = s.ensure(None, 4).nbytes
    s.bytes_in_use = 0
    s.budget_bytes = 3 * one
    cache = PrefixCache(s, max_bytes=1 << 20, ttl_s=60)
    for first in (1, 2, 3):
        cache.keep("a", [first, 5], filled(s, [first, 5]))
    kv = cache.restore("a", [1, 5, 6])  # the budget is full of kept buffers
    assert kv is not None and kv.length == 2 and len(cache) == 2
    assert s.bytes_in_use <= s.budget_bytes
    s.release(kv)
    cache.free(lambda: False)
    cache.keep("a", [1, 5], filled(s, [1, 5]))
    s.budget_bytes = s.bytes_in_use  # no room for a second buffer: no reuse, nothing breaks
    assert cache.restore("a", [1, 5, 6]) is None and len(cache) == 1


# -- through the service ---------------------------------------------------------------------

GREEDY = pb.SamplingParams(temperature=0.0)
SAMPLED = pb.SamplingParams(temperature=0.9, top_p=0.95, seed=7)


def generate(stub, prompt: list[int], n: int, sampling=GREEDY, metadata=None) -> list[int]:
    replies = stub.Generate(pb.GenerateRequest(prompt_token_ids=prompt, max_new_tokens=n,
                                               ignore_eos=True, sampling=sampling),
                            metadata=metadata)
    return [t for r in replies for t in r.step.token_ids]


def speculate(stub, prompt: list[int], drafts: list[list[int]], sampling=GREEDY) -> list[int]:
    """A rounds session with point-mass drafts (the first in the open), ended by a
    half-close; returns what it committed."""
    call = SessionCall(stub, open_message(prompt, first=drafts[0], sampling=sampling),
                       timeout=30)
    out = list(call.step().token_ids)
    for round_no, tokens in enumerate(drafts[1:], start=1):
        out += call.send(verify_message(round_no, tokens)).step().token_ids
    call.close()
    assert call.rest() == []
    return out


def metric(server, name: str, labels: dict[str, str] | None = None) -> float:
    return server.server.metrics.registry.get_sample_value(name, labels) or 0.0


def typing_sessions(stub) -> list[list[int]]:
    """IME-style: each request's prompt is the previous one's plus more typed tokens."""
    typed = [1, 17, 42, 5, 63, 8]
    outputs = []
    for more in ([9, 30], [11], [2, 40, 3]):
        typed = typed + more
        outputs.append(generate(stub, typed, 6))
        outputs.append(speculate(stub, typed + [outputs[-1][0]], [[5, 6, 7], [8, 9]]))
    outputs.append(generate(stub, typed, 6, sampling=SAMPLED))
    outputs.append(speculate(stub, typed, [[5, 6, 7], [8, 9]], sampling=SAMPLED))
    return outputs


def test_reuse_changes_no_output_and_skips_the_shared_prefix(target):
    """The same requests (greedy and seeded sampling, Generate and Verify rounds) give the same
    tokens with prefix caching on and off, while the forwards with it on feed fewer tokens."""
    results = {}
    for mb in (0, 16):
        config = VerifierConfig(port=0, max_draft_len=8,
                                prefix_cache_bytes=int(mb * 2**20))
        with EmbeddedVerifier(target, config) as server, \
                grpc.insecure_channel(server.address) as channel:
            outputs = typing_sessions(pb_grpc.VerifierServiceStub(channel))
            results[mb] = (outputs, metric(server, "edgespec_batch_tokens_sum"),
                           metric(server, "edgespec_prefix_cache_hits_total"),
                           metric(server, "edgespec_prefix_cache_queries_total"))
    (off, off_tokens, off_hits, queries), (on, on_tokens, on_hits, on_queries) = \
        results[0], results[16]
    assert on == off
    assert off_hits == 0 and queries == on_queries > 0
    # Every session after the first reuses its predecessor's tokens.
    assert on_hits >= 30
    assert on_tokens == off_tokens - on_hits


def test_prefixes_are_kept_per_api_key(target):
    config = VerifierConfig(port=0, api_key_digests=frozenset({key_digest("alice"),
                                                               key_digest("bob")}))
    alice = (("authorization", "Bearer alice"),)
    bob = (("authorization", "Bearer bob"),)
    prompt = [1, 17, 42, 5, 63, 8, 9, 30]
    with EmbeddedVerifier(target, config) as server, \
            grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.VerifierServiceStub(channel)
        generate(stub, prompt, 4, metadata=alice)
        generate(stub, prompt + [3], 4, metadata=bob)
        assert metric(server, "edgespec_prefix_cache_hits_total") == 0
        generate(stub, prompt + [3], 4, metadata=alice)
        assert metric(server, "edgespec_prefix_cache_hits_total") == len(prompt)


def test_kept_prefixes_go_before_any_idle_session_under_the_kv_budget(target):
    """With the budget full of kept prefixes and one idle session, a new session's round
    frees prefixes and leaves the idle session alone."""
    engine = VerifierEngine(target.model, target.vocab_size, target.max_context)
    budget = 4 * KVStore.MIN_CAPACITY * engine.kv.bytes_per_token  # four smallest buffers
    config = VerifierConfig(port=0, max_sessions=8, kv_budget_bytes=budget)
    with EmbeddedVerifier(target, config) as server, \
            grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.VerifierServiceStub(channel)
        idle = SessionCall(stub, open_message([1, 2, 3], first=[]))
        idle.step()
        for first in (4, 5, 6):
            generate(stub, [first, 7, 8], 2)
        service = server.server.service
        assert len(service.prefix_cache) == 3
        assert service.engine.kv.bytes_in_use == budget
        generate(stub, [9, 9, 9], 2)  # needs a buffer: a kept prefix makes way
        step = idle.send(verify_message(1)).step()
        assert step.committed_length == 5  # the idle session was not evicted
        idle.cancel()
        assert metric(server, "edgespec_session_evictions_total", {"reason": "kv_budget"}) == 0
        assert len(service.prefix_cache) == 3  # one made way, the new session's came back
        assert service.engine.kv.bytes_in_use <= budget


def test_the_benchmark_runs_and_finds_the_outputs_equal(target, tiny_llama_pair, capsys):
    from cloud_verifier.bench import prefix_cache as bench_prefix_cache

    assert bench_prefix_cache.main(["--model", str(tiny_llama_pair.target_dir), "--contexts",
                                    "8", "40", "--repeats", "2"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert [r.split(" | ")[0] for r in rows[1:]] == ["| 8", "| 40"]
    assert all(r.endswith("| yes |") for r in rows[1:])
