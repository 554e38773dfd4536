"""All of the verifier's tensor work runs on one thread (cloud_verifier.torch_thread)."""

from __future__ import annotations

import asyncio
import threading

import grpc

from cloud_verifier import torch_thread
from cloud_verifier.config import VerifierConfig
from cloud_verifier.server import EmbeddedVerifier
from shared.pb import verifier_pb2 as pb
from shared.pb import verifier_pb2_grpc as pb_grpc


def _name() -> str:
    return threading.current_thread().name


def test_run_and_call_use_one_thread():
    async def called() -> set[str]:
        return {await torch_thread.call(_name) for _ in range(5)}

    names = {torch_thread.run(_name) for _ in range(5)} | asyncio.run(called())
    assert len(names) == 1 and names.pop().startswith("edgespec-torch")
    assert not torch_thread.on_torch_thread()


def test_run_on_the_torch_thread_does_not_wait_for_itself():
    assert torch_thread.run(lambda: torch_thread.run(lambda: 7)) == 7


def test_submitted_work_runs_before_work_submitted_later():
    order: list[str] = []
    gate = threading.Event()
    torch_thread.submit(lambda: (gate.wait(5), order.append("copy")))
    later = threading.Thread(target=lambda: torch_thread.run(order.append, "forward"))
    later.start()
    gate.set()
    later.join(5)
    assert order == ["copy", "forward"]


def test_the_servers_forwards_run_on_the_torch_thread(target):
    """Through gRPC, including a session restored from the prefix cache (whose copy is queued
    on that thread: the prefix-cache tests check that outputs do not change)."""
    seen: list[str] = []
    with EmbeddedVerifier(target, VerifierConfig(port=0)) as server:
        engine = server.server.service.engine
        forward = engine._forward

        def recording_forward(model, segments):
            seen.append(_name())
            return forward(model, segments)

        engine._forward = recording_forward
        with grpc.insecure_channel(server.address) as channel:
            stub = pb_grpc.VerifierServiceStub(channel)
            for _ in range(2):  # the second request restores the first one's prefix
                list(stub.Generate(pb.GenerateRequest(prompt_token_ids=[1, 5, 9, 11, 13],
                                                      max_new_tokens=4, ignore_eos=True)))
        hits = server.server.metrics.prefix_cache_hits._value.get()
    assert seen and all(name.startswith("edgespec-torch") for name in seen), seen
    assert hits > 0
