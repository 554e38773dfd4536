"""Short fleet runs over real gRPC against an in-process verifier with tiny random models:
outputs equal the target's greedy text in every mode and protocol, replayed drafts equal
the model's, faults (refusals, evictions, a KV budget) lose nothing, the JSON keeps its keys,
and a fleet device runs the same client core as the app API (edge_client.core)."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest

from cloud_verifier.config import VerifierConfig
from cloud_verifier.server import EmbeddedVerifier
from edge_client import core
from edge_client.bench.fleet.config import FleetConfig
from edge_client.bench.fleet.run import run_fleet_async
from shared import errors
from shared.pb import verifier_pb2_grpc as pb_grpc

AGGREGATE_KEYS = ("tokens_per_s", "tpot_ms_p50", "tpot_ms_p95", "tpot_ms_p99", "ttft_ms_p50",
                  "round_trips_per_token", "target_forwards_per_token", "bytes_per_token",
                  "errors", "tokens", "requests_started", "requests_completed",
                  "requests_failed", "requests_failed_by_status", "reopens",
                  "bytes_up_per_token", "bytes_down_per_token", "drafted_per_token",
                  "acceptance_rate", "drafting_forward_share", "continued_share",
                  "server_queue_ms_per_token", "server_forward_ms_per_token", "ttft_ms_p95",
                  "ttft_ms_p99", "tpot_samples", "network_retransmits")
RESULT_KEYS = {"clients", "duration_s", "profile", "workload", "mode", "drafts", "drafter",
               "stop_confidence", "protocol",
               "replay_recorded_requests", "draft_len", "confidence", "adaptive",
               "temperature", "chat_tokens", "ime_document", "address", "target_model",
               "aggregate", "per_client", "samples"}


@pytest.fixture(scope="module")
def verifier(target):
    with EmbeddedVerifier(target, VerifierConfig(port=0)) as v:
        yield v


def fleet(address, draft_dir, tmp_path, **kw):
    config = FleetConfig(**({"clients": 4, "duration_s": 3.0, "profile": "wifi",
                             "chat_tokens": 16, "prompts": 4, "progress": False,
                             "ramp_s": 0.2, "keep_outputs": True} | kw))
    return asyncio.run(run_fleet_async(address, config, draft_dir,
                                       replay_cache=tmp_path / "replay.json"))


def check_result(res: dict, clients: int) -> None:
    assert set(res) - {"outputs", "verifier"} == RESULT_KEYS
    a = res["aggregate"]
    for key in AGGREGATE_KEYS:
        assert key in a, key
    assert res["clients"] == clients and len(res["per_client"]) == clients
    assert a["errors"] == {} and a["requests_failed"] == 0
    assert a["tokens"] > 0 and a["tokens_per_s"] > 0
    assert a["tpot_ms_p50"] <= a["tpot_ms_p95"] <= a["tpot_ms_p99"]
    assert a["ttft_ms_p50"] > 0
    assert a["bytes_per_token"] > 0 and a["round_trips_per_token"] > 0
    assert sum(c["tokens"] for c in res["per_client"]) == a["tokens"]


def completed_outputs(res: dict) -> dict[tuple[str, int], list[int]]:
    out: dict[tuple[str, int], list[int]] = {}
    for o in res["outputs"]:
        if o["completed"]:
            key = (o["prompt_key"], o["max_new_tokens"])
            assert out.setdefault(key, o["tokens"]) == o["tokens"]
    return out


def test_fleet_spec_replay_and_baseline(verifier, tiny_llama_pair, tmp_path):
    spec = fleet(verifier.address, tiny_llama_pair.draft_dir, tmp_path, workload="mixed",
                 protocol="rounds")
    check_result(spec, 4)
    assert spec["mode"] == "spec" and spec["drafts"] == "replay"
    assert (spec["drafter"], spec["stop_confidence"]) == ("combined", 0.1)  # the product's
    assert spec["protocol"] == "rounds" and spec["adaptive"] is True
    assert spec["profile"]["name"] == "wifi" and spec["workload"] == "mixed"
    a = spec["aggregate"]
    assert a["replay_hits"] > 0 and a["replay_misses"] == 0
    # One target forward per round and at least one token per round; at most one round trip
    # per round (K = 0 rounds stream back to back in one Decode).
    assert a["round_trips_per_token"] <= a["target_forwards_per_token"] <= 1
    base = fleet(verifier.address, tiny_llama_pair.draft_dir, tmp_path, workload="mixed",
                 mode="baseline")
    check_result(base, 4)
    assert base["drafts"] is None and base["protocol"] is None
    assert base["aggregate"]["target_forwards_per_token"] == pytest.approx(1.0)
    # Greedy: both modes commit the target's own continuation.
    spec_out, base_out = completed_outputs(spec), completed_outputs(base)
    common = spec_out.keys() & base_out.keys()
    assert common
    assert all(spec_out[k] == base_out[k] for k in common)


def test_greedy_replay_output_equals_model_output(verifier, tiny_llama_pair, tmp_path):
    kw = {"clients": 2, "workload": "ime", "profile": "none", "duration_s": 2.5,
          "protocol": "rounds"}
    replay = fleet(verifier.address, tiny_llama_pair.draft_dir, tmp_path, **kw)
    model = fleet(verifier.address, tiny_llama_pair.draft_dir, tmp_path, drafts="model", **kw)
    check_result(model, 2)
    assert model["aggregate"]["draft_s"] > 0
    a, b = completed_outputs(replay), completed_outputs(model)
    assert a.keys() & b.keys()
    assert all(a[k] == b[k] for k in a.keys() & b.keys())
    # The replayed drafts are the model's: the same acceptance, round for round.
    assert replay["aggregate"]["acceptance_rate"] == pytest.approx(
        model["aggregate"]["acceptance_rate"], abs=0.15)


def test_saturated_server_decodes_in_session_without_a_round_trip_per_token(
        verifier, target, tiny_llama_pair, tmp_path):
    """When the server says drafting does not pay (here: a verify cost so high that it always
    suggests K = 0), rounds clients let it decode (Decode): the same output as the baseline,
    one forward per token, and far fewer round trips than tokens."""
    kw = {"clients": 2, "workload": "chat", "profile": "none", "duration_s": 2.5,
          "protocol": "rounds"}
    base = fleet(verifier.address, tiny_llama_pair.draft_dir, tmp_path, mode="baseline", **kw)
    config = VerifierConfig(port=0, verify_token_cost=100.0, fit_verify_cost=False)
    with EmbeddedVerifier(target, config) as saturated:
        spec = fleet(saturated.address, tiny_llama_pair.draft_dir, tmp_path, **kw)
    check_result(spec, 2)
    a = spec["aggregate"]
    assert a["target_forwards_per_token"] <= 1.0
    assert a["round_trips_per_token"] < 0.4, a
    assert a["continued_share"] > 0.5, a
    got, want = completed_outputs(spec), completed_outputs(base)
    assert got.keys() & want.keys()
    assert all(got[k] == want[k] for k in got.keys() & want.keys())


def test_lookahead_protocol_commits_the_baseline_text_on_one_stream_per_request(
        verifier, tiny_llama_pair, tmp_path):
    """Spec clients on lookahead sessions (the default), replayed and live drafts: the
    baseline's greedy text, one round trip per request, at most one forward per token."""
    kw = {"clients": 2, "workload": "mixed", "profile": "wifi", "max_requests": 3,
          "duration_s": 60.0}
    base = fleet(verifier.address, tiny_llama_pair.draft_dir, tmp_path, mode="baseline", **kw)
    want = completed_outputs(base)
    for drafts in ("replay", "model"):
        res = fleet(verifier.address, tiny_llama_pair.draft_dir, tmp_path, drafts=drafts, **kw)
        check_result(res, 2)
        a = res["aggregate"]
        assert res["protocol"] == "lookahead" and a["requests_completed"] == 6
        assert a["round_trips_per_token"] == pytest.approx(6 / a["tokens"])
        assert a["target_forwards_per_token"] <= 1.0
        assert a["drafted_per_token"] > 0 and 0 < a["drafting_forward_share"] <= 1
        assert completed_outputs(res) == want
    assert a["draft_s"] > 0  # the model run drafted on the client


def test_the_window_stops_a_device_that_outlives_its_cancellation(
        verifier, tiny_llama_pair, tmp_path, monkeypatch):
    """On Python 3.11 asyncio.wait_for drops a cancellation that meets a result arriving at
    the same moment; a device that lives through its cancellation is cancelled again, so the
    run still ends with the window."""
    from edge_client.bench.fleet import device

    swallowed: list[int] = []

    async def stubborn(self, request, n, record):
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            swallowed.append(self.index)
            await asyncio.sleep(3600)

    monkeypatch.setattr(device.Device, "generate", stubborn)
    t0 = time.perf_counter()
    res = fleet(verifier.address, tiny_llama_pair.draft_dir, tmp_path, clients=2,
                duration_s=0.5, mode="baseline", warm_up=False)
    assert time.perf_counter() - t0 < 10
    assert sorted(swallowed) == [0, 1]
    a = res["aggregate"]
    assert (a["requests_started"], a["requests_completed"], a["tokens"]) == (2, 0, 0)


class MeddlingProxy(pb_grpc.VerifierServiceServicer):
    """Forwards to a real verifier, and misbehaves on cue like a loaded server would: the
    first session is refused (RESOURCE_EXHAUSTED, OVERLOADED with RetryInfo), the second
    ends after its second step with ``stream_end`` (an eviction by default), and every step
    suggests K = 1 (with no draft_token_cost, so that the suggestion rules)."""

    def __init__(self, address: str, stream_end=None) -> None:
        self.stream_end = stream_end or errors.rich_status(
            grpc.StatusCode.NOT_FOUND, "session evicted to free memory; reopen it",
            errors.SESSION_EVICTED)
        self.channel = grpc.aio.insecure_channel(address)
        self.stub = pb_grpc.VerifierServiceStub(self.channel)
        self.sessions = 0
        self.evicted = 0
        self.draft_lens: list[int] = []  # of Verify rounds

    async def GetInfo(self, request, context):
        return await self.stub.GetInfo(request)

    async def Generate(self, request, context):
        async for msg in self.stub.Generate(request):
            yield msg

    async def Session(self, request_iterator, context):
        self.sessions += 1
        n = self.sessions
        if n == 1:  # refused after reading the open, as the verifier does
            await anext(aiter(request_iterator))
            status = errors.rich_status(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                        "too many rounds queued", errors.OVERLOADED,
                                        retry_after_s=0.02)
            await context.abort(status.code, status.details, status.trailing_metadata)
        upstream = self.stub.Session()

        async def forward() -> None:
            async for message in request_iterator:
                if message.HasField("verify"):
                    self.draft_lens.append(len(message.verify.draft.token_ids))
                await upstream.write(message)
            await upstream.done_writing()

        pump = asyncio.ensure_future(forward())
        steps = 0
        try:
            async for reply in upstream:
                reply.step.suggested_draft_len = 1
                reply.step.ClearField("draft_token_cost")
                yield reply
                steps += 1
                if n == 2 and steps == 2:
                    upstream.cancel()  # the real session closes
                    self.evicted += 1
                    s = self.stream_end
                    await context.abort(s.code, s.details, s.trailing_metadata)
        finally:
            pump.cancel()


# What a lost stream looks like to the client: a transport error without ErrorInfo.
LOST_STREAM = SimpleNamespace(code=grpc.StatusCode.INTERNAL, details="Internal error from Core",
                              trailing_metadata=())


@pytest.mark.parametrize("protocol, lost", [
    ("rounds", False), ("lookahead", False), ("lookahead", True)])
def test_reopen_after_eviction_and_backoff_keep_the_output(verifier, tiny_llama_pair, tmp_path,
                                                           protocol, lost):
    # Bounded by count (every prompt once), not by time, and drafting whenever the server
    # suggests K > 0 (not by measured rate), so a slow machine runs the same rounds.
    kw = {"clients": 1, "workload": "chat", "profile": "none", "duration_s": 120.0,
          "draft_len": 3, "max_requests": 4, "adaptive": False, "protocol": protocol}
    want = completed_outputs(fleet(verifier.address, tiny_llama_pair.draft_dir, tmp_path,
                                   **kw))

    async def through_proxy():
        proxy = MeddlingProxy(verifier.address, LOST_STREAM if lost else None)
        server = grpc.aio.server()
        pb_grpc.add_VerifierServiceServicer_to_server(proxy, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            config = FleetConfig(progress=False, keep_outputs=True, chat_tokens=16, prompts=4,
                                 warm_up=False, **kw)
            res = await run_fleet_async(f"127.0.0.1:{port}", config, tiny_llama_pair.draft_dir,
                                        replay_cache=tmp_path / "replay.json")
        finally:
            await server.stop(0)
            await proxy.channel.close()
        return res, proxy

    res, proxy = asyncio.run(through_proxy())
    a = res["aggregate"]
    # The core reopened twice: after the refusal and after the eviction (or lost stream);
    # each lost attempt is counted under its status.
    assert proxy.evicted == 1 and a["reopens"] == 2, a
    # A write of the client's that meets the stream the proxy just ended makes grpc.aio
    # report INTERNAL "Internal error from Core" in place of the server's status, on the
    # call itself too (grpc/grpc#36066); the core retries it as a lost stream all the same.
    assert a["errors"] in ({"RESOURCE_EXHAUSTED": 1, "INTERNAL" if lost else "NOT_FOUND": 1},
                           {"RESOURCE_EXHAUSTED": 1, "INTERNAL": 1}), a["errors"]
    assert a["requests_failed"] == 0 and a["requests_failed_by_status"] == {}
    got = completed_outputs(res)
    assert len(got) == len(want) == 4 and a["requests_completed"] == 4
    assert got == want
    if protocol == "rounds":  # after the first reply every round follows the suggestion
        assert proxy.draft_lens and max(proxy.draft_lens) <= 1


def test_a_refusing_verifier_fails_requests_by_status_within_the_retry_budget(
        verifier, tiny_llama_pair, tmp_path):
    """A verifier that refuses every session: each request fails once the core's retry
    budget is spent (VerifierUnavailable), counted as UNAVAILABLE; every refusal the core
    retried is counted as RESOURCE_EXHAUSTED."""

    class Refusing(MeddlingProxy):
        async def Session(self, request_iterator, context):
            self.sessions += 1
            await anext(aiter(request_iterator))
            status = errors.rich_status(grpc.StatusCode.RESOURCE_EXHAUSTED, "full",
                                        errors.OVERLOADED, retry_after_s=0.01)
            await context.abort(status.code, status.details, status.trailing_metadata)

    async def run():
        proxy = Refusing(verifier.address)
        server = grpc.aio.server()
        pb_grpc.add_VerifierServiceServicer_to_server(proxy, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            config = FleetConfig(clients=1, profile="none", workload="chat", chat_tokens=8,
                                 prompts=2, max_requests=2, duration_s=30.0, warm_up=False,
                                 retry_budget_s=0.3, progress=False, protocol="rounds")
            return await run_fleet_async(f"127.0.0.1:{port}", config,
                                         tiny_llama_pair.draft_dir,
                                         replay_cache=tmp_path / "replay.json"), proxy
        finally:
            await server.stop(0)
            await proxy.channel.close()

    res, proxy = asyncio.run(run())
    a = res["aggregate"]
    assert a["requests_failed"] == 2 and a["requests_failed_by_status"] == {"UNAVAILABLE": 2}
    assert a["errors"]["UNAVAILABLE"] == 2
    assert a["errors"]["RESOURCE_EXHAUSTED"] + 2 == proxy.sessions


def kv_per_token(target) -> int:
    from cloud_verifier.engine import VerifierEngine

    return VerifierEngine(target.model, target.vocab_size, target.max_context) \
        .kv.bytes_per_token


@pytest.mark.parametrize("protocol", ["rounds", "lookahead"])
def test_fleet_recovers_from_real_kv_budget_evictions(target, tiny_llama_pair, tmp_path,
                                                      protocol):
    """A KV budget of about two sessions for four clients, and every output stays the
    target's: whatever the verifier does for memory (evict idle sessions, preempt, make
    rounds wait), no request fails and the core's reopens lose nothing."""
    # Bounded by count (two requests per client), not by time, so a slow machine runs the
    # same requests.
    kw = {"workload": "chat", "duration_s": 120.0, "profile": "wifi", "max_requests": 2,
          "protocol": protocol}
    with EmbeddedVerifier(target, VerifierConfig(port=0)) as roomy:  # also records drafts
        want = completed_outputs(fleet(roomy.address, tiny_llama_pair.draft_dir, tmp_path,
                                       **kw))
    config = VerifierConfig(port=0, kv_budget_bytes=2 * 40 * kv_per_token(target),
                            kv_wait_s=60.0)
    with EmbeddedVerifier(target, config) as tight:
        res = fleet(tight.address, tiny_llama_pair.draft_dir, tmp_path, **kw)
    a = res["aggregate"]
    assert a["requests_failed"] == 0 and a["requests_completed"] == 8, a
    # Every reopen is a lost attempt the core retried, counted under its status.
    assert sum(a["errors"].values()) == a["reopens"], a
    assert completed_outputs(res) == want


def test_a_fleet_device_and_the_app_client_run_the_same_core(
        target, tiny_llama_pair, tmp_path, monkeypatch):
    """The fleet's device and EdgeClient both deliver through edge_client.core (one spy on
    the core sees both), give the same output for the same prompt, and a fault injected in
    the fleet (rounds refused under a tight KV budget, rounds) is survived by the core: its
    back-off saw the verifier's statuses, and the output is EdgeClient's on a roomy verifier.
    The budget holds about two sessions of the four that start together, and a round that
    does not fit is refused at once (no wait for memory): waiting, preemption and evicting
    idle sessions are invisible to clients, and a fast machine may finish every session
    without any of them, so only a refusal makes the fault certain."""
    from edge_client.client import EdgeClient, GenerationConfig

    deliveries: Counter = Counter()
    lost: list[str] = []
    deliver, wait = core.Wire.deliver, core.Backoff.wait

    def spy_deliver(self, *args, **kwargs):
        deliveries[who[0]] += 1
        return deliver(self, *args, **kwargs)

    async def spy_wait(self, details):
        lost.append(details.reason or details.code.name)
        return await wait(self, details)

    monkeypatch.setattr(core.Wire, "deliver", spy_deliver)
    monkeypatch.setattr(core.Backoff, "wait", spy_wait)
    who = ["fleet"]
    kw = {"clients": 4, "workload": "chat", "duration_s": 120.0, "profile": "none",
          "max_requests": 2, "protocol": "rounds", "drafts": "model", "adaptive": False,
          "warm_up": False}
    config = VerifierConfig(port=0, kv_budget_bytes=2 * 40 * kv_per_token(target),
                            kv_wait_s=0.0)
    with EmbeddedVerifier(target, config) as tight:
        res = fleet(tight.address, tiny_llama_pair.draft_dir, tmp_path, **kw)
    a = res["aggregate"]
    assert a["requests_completed"] == 8 and a["requests_failed"] == 0, a
    assert deliveries["fleet"] > 0
    assert lost, "the KV budget caused no fault to survive"
    assert len(lost) == a["reopens"] == sum(a["errors"].values())
    got = completed_outputs(res)
    who[0] = "app"
    with EmbeddedVerifier(target, VerifierConfig(port=0)) as roomy, EdgeClient(
            roomy.address, tiny_llama_pair.draft_dir, protocol="rounds") as client:
        for (key, max_new), tokens in got.items():
            prompt = [int(t) for t in key.split(",")]
            gen = client.generate(prompt, GenerationConfig(max_new_tokens=max_new,
                                                           draft_len=4))
            assert [t for chunk in gen for t in chunk] == tokens
    assert deliveries["app"] > 0


def test_cli_fleet_writes_json_and_plot(tiny_llama_pair, tmp_path):
    from edge_client.bench.cli import main

    out = tmp_path / "fleet.json"
    rc = main(["fleet", "--spawn", "--model", str(tiny_llama_pair.target_dir),
               "--kv-budget-mb", "8", "--verifier-threads", "1",
               "--verifier-arg=--prefix-cache-mb=4",
               "--draft-dir", str(tiny_llama_pair.draft_dir), "--clients", "2", "--duration",
               "1.5", "--profile", "5g", "--workload", "ime", "--mode", "spec", "--drafts",
               "replay", "--json", str(out), "--plot", str(tmp_path / "cdf.png"),
               "--replay-cache", str(tmp_path / "replay.json"), "--no-progress"])
    assert rc == 0
    res = json.loads(out.read_text())
    assert (res["clients"], res["profile"]["name"], res["workload"], res["mode"],
            res["drafts"], res["protocol"]) == (2, "5g", "ime", "spec", "replay", "lookahead")
    check_result(res, 2)
    # The spawned verifier was watched: its metrics scraped, its peak memory read, and it
    # stopped cleanly.
    v = res["verifier"]
    assert v["spawned"] and v["exit_code"] == 0 and v["threads"] == 1
    assert v["extra_args"] == ["--prefix-cache-mb=4"]
    assert v["scrapes"] > 0 and 0 < v["kv_peak_bytes"] <= v["kv_budget_bytes"] == 8 * 2**20
    assert v["kv_within_budget"] is True and v["peak_rss_mb"] > 10
    assert v["preemptions"] is not None  # scraped from the verifier
    # ... including the verify-cost fit its draft-length suggestions came from.
    fit = v["verify_cost_fit"]
    assert fit["fixed_ms"] > 0 and fit["session_cost"] >= 0 and fit["token_cost"] >= 0
    assert (tmp_path / "cdf.png").read_bytes()[:4] == b"\x89PNG"


def test_sweep_writes_capacity_and_plots(tiny_llama_pair, tmp_path):
    from edge_client.bench.cli import main

    out = tmp_path / "bench" / "fleet.json"
    rc = main([
        "sweep", "--embedded", "--model", str(tiny_llama_pair.target_dir),
        "--draft-dir", str(tiny_llama_pair.draft_dir), "--json", str(out), "--clients", "1",
        "2", "--profiles", "wifi", "--duration", "1.0", "--repeats", "2", "--chat-tokens",
        "12", "--prompts", "2", "--replay-cache", str(tmp_path / "replay.json"),
        "--no-progress"])
    assert rc == 0
    data = json.loads(out.read_text())
    assert set(data["capacity"]) == {"spec", "baseline"}
    assert all(set(v) == {"wifi"} for v in data["capacity"].values())
    # Tiny models on loopback + 20 ms RTT: both client counts meet a 200 ms p95 TPOT.
    assert data["capacity"]["baseline"]["wifi"] == 2
    assert data["capacity_figures"]["baseline"]["wifi"]["clients"] == 2
    assert data["capacity_figures"]["baseline"]["wifi"]["windows"] == 2
    assert data["repeats"] == 2 and len(data["runs"]) == 8
    # The modes alternate within a client count, so each comparison is taken close in time.
    assert [(r["clients"], r["mode"]) for r in data["runs"]] == [
        (1, "spec"), (1, "baseline"), (1, "spec"), (1, "baseline"),
        (2, "spec"), (2, "baseline"), (2, "spec"), (2, "baseline")]
    rows = data["never_worse"]
    assert [(r["profile"], r["clients"], r["pairs"]) for r in rows] == [("wifi", 1, 2),
                                                                        ("wifi", 2, 2)]
    for i, row in enumerate(rows):
        runs = data["runs"][4 * i: 4 * i + 4]
        ratios = [s["aggregate"]["tokens_per_s"] / b["aggregate"]["tokens_per_s"]
                  for s, b in (runs[0:2], runs[2:4])]
        assert row["ratio"] == pytest.approx(sum(ratios) / 2)  # the median of two
        assert (row["ratio_min"], row["ratio_max"]) == pytest.approx(sorted(ratios))
    for png in data["plots"].values():
        assert Path(png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("where", ["--spawn", "--embedded"])
def test_verifier_args_reach_the_verifier(tiny_llama_pair, where):
    """--verifier-arg goes to the verifier's own command line: one it rejects stops the run
    before any client starts."""
    import argparse

    from edge_client.bench.fleet.cli import add_common_args
    from edge_client.bench.fleet.verifier import fleet_verifier

    p = argparse.ArgumentParser()
    add_common_args(p)
    args = p.parse_args([where, "--model", str(tiny_llama_pair.target_dir),
                         "--verifier-arg=--prefix-cache-mb=-1"])
    with pytest.raises((RuntimeError, SystemExit)) as info:
        with fleet_verifier(args, clients=1):
            pass
    assert (info.type is RuntimeError) == (where == "--spawn")
