"""SIGTERM under load, on real verifier processes serving the tiny target: health turns
NOT_SERVING first and stays observable, and 4 in-flight generations (greedy Verify rounds,
greedy lookahead, seeded sampled Verify rounds, cloud-only Generate) all finish with exactly
the output of a fault-free run: on the draining verifier when its grace period allows, or
else told DRAINING and reopened on a second verifier behind the same channel."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from edge_client import local_verifier
from edge_client.client import EdgeClient, GenerationConfig

PROMPT = "t5 t6 t7 t8"
TOKENS = 100
# Each forward waits this long for company, so a generation takes seconds on any machine.
SLOW = ["--gather-window-ms", "25"]
CASES = [("rounds", 0.0), ("lookahead", 0.0), ("rounds", 0.8), ("cloud", 0.0)]


def config(temperature: float) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=TOKENS, temperature=temperature,
                            top_p=0.95 if temperature else 1.0, seed=5, ignore_eos=True)


def start(model, *extra: str):
    port = local_verifier.free_port()
    proc = local_verifier.spawn(port, model, [*SLOW, *extra])
    return proc, f"127.0.0.1:{port}"


@pytest.fixture(scope="module")
def spare(tiny_llama_pair):
    """The second verifier: references come from it, evacuated generations finish on it."""
    proc, address = start(tiny_llama_pair.target_dir)
    local_verifier.wait_serving(address, proc)
    yield address
    local_verifier.stop(proc)


@pytest.fixture(scope="module")
def references(spare, tiny_llama_pair):
    out = {}
    for protocol, temperature in CASES:
        with EdgeClient(spare, tiny_llama_pair.draft_dir, protocol=protocol) as client:
            gen = client.generate(PROMPT, config(temperature))
            out[protocol, temperature] = [t for chunk in gen for t in chunk]
    return out


def health_trace(address: str, until: threading.Event) -> list[str]:
    """Health statuses seen every 50 ms (an RpcError's code once the port is gone)."""
    seen: list[str] = []
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while not until.is_set():
            try:
                status = stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status
                name = health_pb2.HealthCheckResponse.ServingStatus.Name(status)
            except grpc.RpcError as err:
                name = err.code().name
            if not seen or seen[-1] != name:
                seen.append(name)
            time.sleep(0.05)
    return seen


def not_serving_first(trace: list[str]) -> bool:
    """SERVING (until the signal is handled), then NOT_SERVING, observed before the port
    goes, and never SERVING again."""
    if "NOT_SERVING" not in trace:
        return False
    i = trace.index("NOT_SERVING")
    return set(trace[:i]) <= {"SERVING"} and "SERVING" not in trace[i:]


def run_under_sigterm(address: str, proc, draft_dir, started_tokens: int = 3):
    """The 4 cases at once on ``address``; SIGTERM once each has ``started_tokens``."""
    results: dict = {}
    progress = {case: 0 for case in CASES}
    all_started = threading.Event()
    lock = threading.Lock()

    def run(case) -> None:
        protocol, temperature = case
        with EdgeClient(address, draft_dir, protocol=protocol) as client:
            gen = client.generate(PROMPT, config(temperature))
            tokens = []
            for chunk in gen:
                tokens.extend(chunk)
                with lock:
                    progress[case] = len(tokens)
                    if min(progress.values()) >= started_tokens:
                        all_started.set()
            results[case] = (tokens, gen.stats)

    threads = [threading.Thread(target=run, args=(case,)) for case in CASES]
    for t in threads:
        t.start()
    assert all_started.wait(120), progress
    assert max(progress.values()) < TOKENS, progress  # all 4 in flight
    os.kill(proc.pid, signal.SIGTERM)
    done = threading.Event()
    trace: list[str] = []
    watcher = threading.Thread(target=lambda: trace.extend(health_trace(address.split(
        ",")[0].removeprefix("ipv4:"), done)))
    watcher.start()
    for t in threads:
        t.join(120)
    assert proc.wait(60) == 0
    done.set()
    watcher.join(10)
    return results, trace


def test_generations_finish_on_the_draining_verifier_within_the_grace(
        tiny_llama_pair, references):
    proc, address = start(tiny_llama_pair.target_dir, "--grace", "60", "--drain-notice", "1")
    try:
        local_verifier.wait_serving(address, proc)
        results, trace = run_under_sigterm(address, proc, tiny_llama_pair.draft_dir)
    finally:
        local_verifier.stop(proc)
    assert not_serving_first(trace), trace
    for case, (tokens, stats) in results.items():
        assert tokens == references[case], case
        assert stats.reopens == 0, (case, stats.lost_attempts)  # rounds were not refused


def test_generations_past_the_grace_are_told_draining_and_reopen_elsewhere(
        tiny_llama_pair, references, spare, caplog):
    caplog.set_level(logging.INFO, logger="edge_client.core")
    proc, address = start(tiny_llama_pair.target_dir, "--grace", "0.3", "--drain-notice", "1")
    try:
        local_verifier.wait_serving(address, proc)
        # pick_first: every call goes to the draining verifier while it listens, then to the
        # spare, as behind a gateway.
        both = f"ipv4:{address},{spare}"
        results, trace = run_under_sigterm(both, proc, tiny_llama_pair.draft_dir)
    finally:
        local_verifier.stop(proc)
    assert not_serving_first(trace), trace
    for case, (tokens, stats) in results.items():
        assert tokens == references[case], case
        assert stats.reopens >= 1, case
    drained = [r for r in caplog.records if "UNAVAILABLE DRAINING" in r.getMessage()]
    assert len(drained) >= len(CASES), [r.getMessage() for r in caplog.records]
