"""The chaos suite on the tiny model: the fault proxy's message counting, every scenario a
few times through ``edgespec-bench chaos`` (0 tokens lost or duplicated, outputs identical to
a fault-free run), and kill -9 / SIGTERM of the verifier process under a generation."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from edge_client.bench.chaos.http2 import PREFACE, GrpcMessageScanner, Message
from edge_client.bench.chaos.proxy import FaultProxy
from edge_client.bench.chaos.run import RunSettings, VerifierProcess, run_one, token_diff
from edge_client.bench.chaos.scenarios import DECODINGS

PROMPT = "t5 t6 t7 t8"
TOKENS = 12


def frame(kind: int, stream: int, payload: bytes, flags: int = 0) -> bytes:
    return len(payload).to_bytes(3, "big") + bytes([kind, flags]) + \
        stream.to_bytes(4, "big") + payload


def grpc_message(body: bytes) -> bytes:
    return b"\0" + len(body).to_bytes(4, "big") + body


def test_scanner_finds_messages_across_frames_padding_and_chunks():
    m1, m2, m3 = grpc_message(b"abc"), grpc_message(b""), grpc_message(b"x" * 40)
    data = (PREFACE + frame(0x4, 0, b"\0" * 6)  # SETTINGS
            + frame(0x1, 1, b"headers")  # HEADERS: not counted
            + frame(0x0, 1, m1 + m2)  # two messages in one DATA frame
            + frame(0x0, 3, m3[:10])  # a message split over two frames...
            + frame(0x0, 3, bytes([4]) + m3[10:] + b"\0" * 4, flags=0x8))  # ...padded
    whole = GrpcMessageScanner(client_side=True).feed(data)
    bytewise = GrpcMessageScanner(client_side=True)
    assert [m for i in range(len(data)) for m in bytewise.feed(data[i:i + 1])] == whole
    assert [(m.index, m.stream_id) for m in whole] == [(0, 1), (1, 1), (2, 3)]
    first_data = len(PREFACE) + 9 + 6 + 9 + 7 + 9
    assert whole[0] == Message(0, 1, first_data, first_data + len(m1))
    assert whole[1].end - whole[1].start == 5
    assert data[whole[2].start:whole[2].start + 10] == m3[:10]
    # The split message ends after its 10 + 9 + 1 (pad length) + 35 bytes.
    assert whole[2].end - whole[2].start == 10 + 9 + 1 + (len(m3) - 10)
    assert bytewise.offset == len(data)


def test_token_diff_counts_lost_and_duplicated_tokens():
    assert token_diff([1, 2, 3], [1, 2, 3]) == (0, 0)
    assert token_diff([1, 2, 3, 4], [1, 2, 3, 3, 4]) == (0, 1)
    assert token_diff([1, 2, 3, 4], [1, 4]) == (2, 0)


@pytest.fixture(scope="module")
def verifier(tiny_llama_pair):
    v = VerifierProcess(str(tiny_llama_pair.target_dir))
    yield v
    v.stop()


@pytest.fixture(scope="module")
def settings(tiny_llama_pair, verifier):
    return RunSettings(tiny_llama_pair.draft_dir, PROMPT, TOKENS, 60 + 3 * verifier.startup_s)


def test_the_proxy_relays_real_grpc_unchanged_and_counts_its_messages(verifier):
    from shared.pb import verifier_pb2 as pb
    from shared.pb import verifier_pb2_grpc as pb_grpc

    async def through_proxy():
        proxy = FaultProxy(verifier.address)
        address = await proxy.start()
        try:
            async with grpc.aio.insecure_channel(address) as channel:
                stub = pb_grpc.VerifierServiceStub(channel)
                info = await stub.GetInfo(pb.GetInfoRequest())
                steps = [r.step async for r in stub.Generate(pb.GenerateRequest(
                    prompt_token_ids=[5, 6, 7], max_new_tokens=5, ignore_eos=True))]
            return info, steps, proxy
        finally:
            await proxy.close()

    with grpc.insecure_channel(verifier.address) as channel:
        direct = [r.step.token_ids[:] for r in pb_grpc.VerifierServiceStub(channel).Generate(
            pb.GenerateRequest(prompt_token_ids=[5, 6, 7], max_new_tokens=5, ignore_eos=True))]
    info, steps, proxy = asyncio.run(through_proxy())
    assert info.vocab_size > 0 and proxy.connections == 1 and not proxy.fired
    assert [s.token_ids[:] for s in steps] == direct and len(steps) == 5


def test_every_network_scenario_loses_and_duplicates_nothing(tiny_llama_pair, tmp_path):
    """Each scenario three times, one per decoding (greedy rounds, seeded sampling on rounds,
    greedy lookahead), at fault points 1..3: the table must say 0 lost, 0 duplicated."""
    from edge_client.bench.cli import main

    scenarios = ["delay", "stall", "close", "reset-down", "reset-up", "refuse", "mute",
                 "lost-reply"]
    out = tmp_path / "chaos.json"
    rc = main(["chaos", "--runs", "3", "--json", str(out), "--model",
               str(tiny_llama_pair.target_dir), "--draft-dir", str(tiny_llama_pair.draft_dir),
               "--prompt", PROMPT, "--tokens", str(TOKENS), "--scenarios", *scenarios])
    report = json.loads(out.read_text())
    failed = [r for r in report["runs"] if not r["ok"]]
    assert rc == 0 and report["ok"] and not failed, failed
    assert [row["scenario"] for row in report["table"]] == scenarios
    for row in report["table"]:
        assert row["runs"] == row["fired"] == row["identical"] == 3, row
        assert row["tokens_lost"] == row["tokens_duplicated"] == row["errors"] == 0, row
        assert row["outcomes"] == "..."
    assert set(report["references"]) == set(DECODINGS)
    assert all(len(t) == TOKENS for t in report["references"].values())
    by = {(r["scenario"], r["run"]): r for r in report["runs"]}
    for run in range(3):
        # Faults that cut the connection make the client reopen; a short delay does not.
        assert by["delay", run]["reopens"] == 0
        for name in ("stall", "close", "reset-down"):
            assert by[name, run]["reopens"] >= 1, by[name, run]
        # Faults on the client's message k+1: a round waits for its answer, so the cut
        # always costs a reopen. A lookahead draft does not: the verifier decodes on without
        # it and may have sent all TOKENS before the draft leaves the device (the tiny
        # target decodes in milliseconds), so the cut can come after the generation ended.
        if DECODINGS[by["delay", run]["decoding"]][0] == "rounds":
            for name in ("reset-up", "lost-reply"):
                assert by[name, run]["reopens"] >= 1, by[name, run]
            # The verifier really answered the round whose reply was lost.
            assert by["lost-reply", run]["swallowed_replies"] >= 1
        # Both refusals happened before a connection got through.
        assert by["refuse", run]["connections"] >= 4


@pytest.mark.parametrize("scenario,run", [("kill-9", 0), ("kill-9", 1), ("sigterm", 0),
                                          ("sigterm", 1)])
def test_a_generation_survives_kill_or_stop_of_the_verifier(verifier, settings, scenario,
                                                            run):
    decoding = list(DECODINGS)[run]  # greedy, then seeded sampling, on Verify rounds
    reference = asyncio.run(_reference(verifier, settings, decoding))
    pid = verifier.proc.pid
    record = asyncio.run(run_one(verifier, settings, scenario, run, decoding, reference))
    assert record["ok"], record
    assert verifier.proc.pid != pid, "a fresh verifier process serves on the same port"
    assert record["lost"] == record["duplicated"] == 0
    if scenario == "kill-9":
        assert record["reopens"] >= 1
    # SIGTERM drains: a generation this short finishes on the draining verifier within its
    # grace (reopens 0), a longer one is told DRAINING and reopens (tests/test_drain.py).


def test_a_silent_partition_is_survived(verifier, settings):
    """Blackhole after the first Step: only the client's own deadline and keepalive notice
    (one run: it costs gRPC's ping timeout)."""
    reference = asyncio.run(_reference(verifier, settings, "rounds-greedy"))
    record = asyncio.run(run_one(verifier, settings, "blackhole", 0, "rounds-greedy",
                                 reference))
    assert record["ok"], record
    assert record["connections"] == 2  # the silent one was abandoned for a new one


async def _reference(verifier, settings, decoding):
    from edge_client.bench.chaos.run import generate

    proxy = FaultProxy(verifier.address)
    try:
        tokens, _ = await generate(await proxy.start(), settings, decoding)
        return tokens
    finally:
        await proxy.close()


def test_the_client_notices_a_silent_partition_within_its_keepalive_timeout(monkeypatch):
    from edge_client import connection

    seen = {}

    def capture(address, options=None, **kwargs):
        seen.update(dict(options or ()))
        return real(address, options=options, **kwargs)

    real = grpc.aio.insecure_channel
    monkeypatch.setattr(connection.grpc.aio, "insecure_channel", capture)
    asyncio.run(_open_and_close(connection))
    assert seen["grpc.keepalive_timeout_ms"] == 5_000
    # Every ping the channel waits on must time out as a keepalive ping does.
    assert seen.get("grpc.http2.ping_timeout_ms", 60_000) <= seen["grpc.keepalive_timeout_ms"]


async def _open_and_close(connection) -> None:
    await connection.Connection("127.0.0.1:1").close()


def test_the_client_connects_over_a_slow_handshake(verifier):
    from edge_client.bench.chaos.proxy import HOLD, Fault
    from edge_client.connection import Connection

    async def connect():
        proxy = FaultProxy(verifier.address, [Fault(HOLD, delay_s=0.5)])
        conn = Connection(await proxy.start())
        try:
            return await conn.info(), proxy
        finally:
            await conn.close()
            await proxy.close()

    info, proxy = asyncio.run(connect())
    assert info.vocab_size > 0 and len(proxy.fired) == 1
