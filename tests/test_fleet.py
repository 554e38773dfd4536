"""The simulated edge fleet: network emulation statistics, the I/O-free round logic, and
short fleet runs over real gRPC against an in-process verifier with tiny random models."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import grpc
import numpy as np
import pytest

from cloud_verifier.config import VerifierConfig
from cloud_verifier.server import EmbeddedVerifier
from edge_client.drafter import Proposal
from edge_client.fleet import FleetConfig, NotLoopback, require_loopback, run_fleet_async
from edge_client.netem import PROFILES, Link, NetEm
from edge_client.rate_chooser import CONTINUE, EXPLORE_CONTINUE_TOKENS, SPEC, RateChooser
from edge_client.rounds import GenerationRounds, ProtocolError, ServerLimits, SessionParams
from shared.pb import verifier_pb2 as pb
from shared.pb import verifier_pb2_grpc as pb_grpc

AGGREGATE_KEYS = ("tokens_per_s", "tpot_ms_p50", "tpot_ms_p95", "tpot_ms_p99", "ttft_ms_p50",
                  "round_trips_per_token", "target_forwards_per_token", "bytes_per_token",
                  "errors")


# -- network emulation --------------------------------------------------------------------------


def test_netem_rtt_mean_and_jitter_match_the_profile():
    """n = 20000 RTTs of small messages on the 4g profile without loss: the mean RTT is
    within 2 % of rtt_ms, and the mean |RTT_i - RTT_{i-1}| within 4 % of jitter_ms."""
    prof = dataclasses.replace(PROFILES["4g"], loss=0.0, up_mbps=0.0, down_mbps=0.0)
    net = NetEm(prof, np.random.default_rng(1))
    rtts = np.array([net.up.one_way_s(0) + net.down.one_way_s(0) for _ in range(20000)]) * 1000
    assert abs(rtts.mean() - prof.rtt_ms) < 0.02 * prof.rtt_ms
    jitter = np.abs(np.diff(rtts)).mean()
    assert abs(jitter - prof.jitter_ms) < 0.04 * prof.jitter_ms
    assert rtts.min() >= 2 * prof.propagation_s * 1000 - 1e-9


def test_netem_loss_costs_a_retransmission_timeout():
    """n = 20000 one-segment messages at loss p = 0.05 with no jitter: a message is late by
    at least one RTO with probability p (|count - n p| <= 5 sqrt(n p (1 - p))), else on time."""
    prof = dataclasses.replace(PROFILES["3g-poor"], jitter_ms=0.0, loss=0.05, up_mbps=0.0)
    link = Link(prof, 0.0, np.random.default_rng(2))
    delays = np.array([link.one_way_s(100) for _ in range(20000)])
    base = prof.rtt_ms / 2000
    late = delays > base + 1e-9
    n, p = len(delays), prof.loss
    assert abs(late.sum() - n * p) <= 5 * np.sqrt(n * p * (1 - p))
    assert np.all(delays[late] >= base + prof.rto_s - 1e-9)
    assert np.allclose(delays[~late], base)


def test_netem_bandwidth_and_in_order_delivery():
    prof = dataclasses.replace(PROFILES["none"], up_mbps=8.0)  # 1 byte per microsecond
    link = Link(prof, prof.up_mbps, np.random.default_rng(0))
    first = link.deliver_at(0.0, 9900)  # 10000 bytes with the per-message overhead
    assert first == pytest.approx(0.01)
    # Sent at the same time, the second waits for the first to be on the wire.
    assert link.deliver_at(0.0, 9900) == pytest.approx(0.02)


def test_fleet_only_targets_loopback():
    require_loopback("127.0.0.1:50051")
    require_loopback("localhost:50051")
    with pytest.raises(NotLoopback):
        require_loopback("192.0.2.1:50051")


@pytest.mark.parametrize("bad", [{"clients": 0}, {"duration_s": 0}, {"max_requests": 0},
                                 {"chat_tokens": 0}, {"workload": "essay"}, {"mode": "x"},
                                 {"drafts": "replay", "temperature": 0.7}])
def test_fleet_config_rejects_bad_values(bad):
    with pytest.raises(ValueError):
        FleetConfig(**bad)


# -- round logic --------------------------------------------------------------------------------

LIMITS = ServerLimits(vocab_size=96, max_draft_len=8, max_context=64)


def result(round_no: int, n: int, token: int, length: int, finished=False, suggested=None,
           cost=None):
    reply = pb.RoundResult(round=round_no, num_accepted=n, next_token=token,
                           committed_length=length, finished=finished, target_forwards=1)
    if suggested is not None:
        reply.suggested_draft_len = suggested
    if cost is not None:
        reply.draft_token_cost = cost
    return reply


def test_rounds_apply_commits_accepted_drafts_and_the_next_token():
    r = GenerationRounds([5, 6, 7], SessionParams(max_new_tokens=10), LIMITS, draft_len=4)
    assert r.open_request(Proposal([1, 2, 3, 4], None)).max_new_tokens == 10
    assert r.apply(Proposal([1, 2, 3, 4], None), result(0, 2, 9, 6)) == [1, 2, 9]
    assert r.committed == [5, 6, 7, 1, 2, 9] and r.round_no == 1
    assert r.verify_request("s", Proposal([4], None)).round == 1


@pytest.mark.parametrize("bad", [
    result(1, 0, 9, 4),  # answers another round
    result(0, 3, 9, 6),  # accepts more drafts than sent
    result(0, 0, 96, 4),  # token out of the vocabulary
    result(0, 1, 9, 7),  # committed length disagrees
])
def test_rounds_reject_inconsistent_replies(bad):
    r = GenerationRounds([5, 6, 7], SessionParams(max_new_tokens=10), LIMITS, draft_len=2)
    with pytest.raises(ProtocolError):
        r.apply(Proposal([1, 2], None), bad)


def test_rounds_follow_the_suggested_draft_len_and_the_room_left():
    r = GenerationRounds([5], SessionParams(max_new_tokens=6), LIMITS, draft_len=4)
    assert r.next_k() == 4
    r.apply(Proposal([1, 2, 3, 4], None), result(0, 0, 9, 2, suggested=2))
    assert r.next_k() == 2  # min(own 4, suggested 2)
    r.apply(Proposal([1, 2], None), result(1, 0, 9, 3, suggested=0))
    assert r.next_k() == 0  # 0 = send no drafts: plain decoding is cheaper now
    r.apply(Proposal([], None), result(2, 0, 9, 4))
    assert r.next_k() == 2  # no suggestion: own K, but only 3 tokens remain
    r.apply(Proposal([1, 2], None), result(3, 2, 9, 7, finished=True))
    assert r.finished and r.remaining == 0


def test_rounds_with_confidences_are_cut_by_the_servers_token_cost():
    r = GenerationRounds([5], SessionParams(max_new_tokens=20), LIMITS, draft_len=6)
    sure = Proposal([1, 2, 3, 4, 5, 6], None, [0.99, 0.95, 0.6, 0.3, 0.9, 0.9])
    assert r.worth_sending(sure) == sure  # no cost known yet: all of it
    r.apply(sure, result(0, 0, 9, 2, suggested=1, cost=0.1))
    assert r.next_k() == 6  # with confidences the suggestion (1) gives way to the cut
    sent = r.worth_sending(sure)
    assert sent.tokens == [1, 2, 3] and sent.confidence == [0.99, 0.95, 0.6]
    assert not r.verify_request("s", sent).draft.confidence  # already cut: not sent
    assert r.lookahead_request(sure).lookahead.draft.confidence == pytest.approx(
        sure.confidence)  # the verifier cuts lookaheads itself
    plain = Proposal([1, 2], None)  # a drafter without confidences: the suggestion rules
    assert r.worth_sending(plain) == plain and r.next_k() == 1
    for bad in (-0.5, float("nan"), float("inf")):  # checked before anything is applied
        with pytest.raises(ProtocolError, match="draft_token_cost"):
            r.apply(plain, result(1, 0, 9, 3, cost=bad))
    assert r.round_no == 1 and r.committed == [5, 9]


def test_rate_chooser_picks_the_faster_mode_and_keeps_measuring_the_other():
    c = RateChooser(weight=0.5, explore_every=4)
    assert c.choose() == SPEC  # nothing measured yet: draft first
    c.observe(SPEC, 2, 0.2)  # 10 tok/s
    assert c.choose() == CONTINUE  # then measure the server decoding alone
    assert c.continue_tokens() == EXPLORE_CONTINUE_TOKENS
    c.observe(CONTINUE, 16, 0.8)  # 20 tok/s
    picks = [c.choose() for _ in range(8)]
    # Continue is faster; every 4th decision re-measures drafting.
    assert picks == [CONTINUE, CONTINUE, CONTINUE, SPEC] * 2
    c.observe(SPEC, 9, 0.2)  # drafting got much faster (45 -> EMA 27.5 tok/s)
    assert c.rate[SPEC] == pytest.approx(27.5)
    assert c.choose() == SPEC
    c.observe(SPEC, 0, 0.1)  # nothing delivered: no information, ignored
    assert c.rate[SPEC] == pytest.approx(27.5)


def test_rounds_continue_when_k_is_zero_or_when_the_chooser_says_so():
    chooser = RateChooser()
    r = GenerationRounds([5], SessionParams(max_new_tokens=100), LIMITS, draft_len=4,
                         chooser=chooser)
    assert not r.wants_continue()  # drafting is measured first
    r.apply(Proposal([1, 2], None), result(0, 2, 9, 4, suggested=0))
    assert r.wants_continue()  # the server says drafting does not pay: until it does
    req = r.continue_request("s")
    assert (req.round, req.max_tokens, req.stop_when_drafting_pays) == (1, 97, True)
    r.apply(Proposal([], None), result(1, 0, 9, 5, suggested=3))
    r.observe(SPEC, 3, 0.3)
    assert r.wants_continue()  # the chooser has not measured Continue yet
    req = r.continue_request("s")
    assert (req.max_tokens, req.stop_when_drafting_pays) == (EXPLORE_CONTINUE_TOKENS, False)
    # Without a chooser, only K = 0 leads to Continue.
    plain = GenerationRounds([5], SessionParams(max_new_tokens=100), LIMITS, draft_len=0)
    assert plain.wants_continue()
    assert plain.continue_request("s").stop_when_drafting_pays is False


def test_reopen_resends_the_full_context_with_the_same_params():
    params = SessionParams(max_new_tokens=10, temperature=0.5, seed=77, stop_token_ids=(3,))
    r = GenerationRounds([5, 6], params, LIMITS, draft_len=2)
    r.apply(Proposal([1, 2], None), result(0, 2, 9, 5))
    r.apply(Proposal([4, 4], None), result(1, 1, 8, 7))
    req = r.reopen_request(Proposal([11, 12], None))
    assert list(req.prompt_token_ids) == [5, 6, 1, 2, 9, 4, 8]
    assert req.max_new_tokens == 5 and list(req.stop_token_ids) == [3]
    assert req.sampling.seed == 77 and req.sampling.temperature == pytest.approx(0.5)
    assert list(req.first_draft.token_ids) == [11, 12]
    assert r.round_no == 0  # the new session's first round rides on OpenSession


# -- fleet runs -----------------------------------------------------------------------------------


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
    a = res["aggregate"]
    for key in AGGREGATE_KEYS:
        assert key in a
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
    assert spec["profile"]["name"] == "wifi" and spec["workload"] == "mixed"
    a = spec["aggregate"]
    assert a["replay_hits"] > 0 and a["replay_misses"] == 0
    # One target forward per round and at least one token per round; at most one round trip
    # per round (K = 0 rounds stream back to back on one Continue call).
    assert a["round_trips_per_token"] <= a["target_forwards_per_token"] <= 1
    base = fleet(verifier.address, tiny_llama_pair.draft_dir, tmp_path, workload="mixed",
                 mode="baseline")
    check_result(base, 4)
    assert base["drafts"] is None
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
    suggests K = 0), spec clients let it decode through Continue streams: the same output as
    the baseline, one forward per token, and far fewer round trips than tokens."""
    kw = {"clients": 2, "workload": "chat", "profile": "none", "duration_s": 2.5,
          "protocol": "rounds"}
    base = fleet(verifier.address, tiny_llama_pair.draft_dir, tmp_path, mode="baseline", **kw)
    config = VerifierConfig(port=0, verify_token_cost=100.0,
                            fit_verify_cost=False)
    with EmbeddedVerifier(target, config) as saturated:
        spec = fleet(saturated.address, tiny_llama_pair.draft_dir, tmp_path, **kw)
    check_result(spec, 2)
    a = spec["aggregate"]
    # Round trips: the open, then one Continue per PROBE_EVERY rounds plus the probe's Verify.
    assert a["target_forwards_per_token"] <= 1.0
    assert a["round_trips_per_token"] < 0.4, a
    got, want = completed_outputs(spec), completed_outputs(base)
    assert got.keys() & want.keys()
    assert all(got[k] == want[k] for k in got.keys() & want.keys())


def test_lookahead_protocol_commits_the_baseline_text_on_one_stream_per_request(
        verifier, tiny_llama_pair, tmp_path):
    """Spec clients on Lookahead streams, replayed and live drafts: the baseline's greedy
    text, one round trip per request, at most one forward per token."""
    kw = {"clients": 2, "workload": "mixed", "profile": "wifi", "max_requests": 3,
          "duration_s": 60.0}
    base = fleet(verifier.address, tiny_llama_pair.draft_dir, tmp_path, mode="baseline", **kw)
    want = completed_outputs(base)
    for drafts in ("replay", "model"):
        res = fleet(verifier.address, tiny_llama_pair.draft_dir, tmp_path, drafts=drafts,
                    protocol="lookahead", **kw)
        check_result(res, 2)
        a = res["aggregate"]
        assert res["protocol"] == "lookahead" and a["requests_completed"] == 6
        assert a["round_trips_per_token"] == pytest.approx(6 / a["tokens"])
        assert a["target_forwards_per_token"] <= 1.0
        assert a["drafted_per_token"] > 0 and 0 < a["drafting_forward_share"] <= 1
        got = completed_outputs(res)
        assert got == want
    assert a["draft_s"] > 0  # the model run drafted on the client


class MeddlingProxy(pb_grpc.VerifierServicer):
    """Forwards to a real verifier, and misbehaves on cue like a loaded server would:
    evicts the first session on its second Verify, answers the first OpenSession with
    RESOURCE_EXHAUSTED, and suggests K = 1 in every reply (with no draft_token_cost, so that
    the suggestion rules)."""

    def __init__(self, address: str, stream_end: tuple[grpc.StatusCode, str] = (
            grpc.StatusCode.NOT_FOUND,
            "session abcd1234... was evicted to free memory; reopen it")) -> None:
        # The status the second Lookahead stream ends with after its two steps.
        self.stream_end = stream_end
        self.channel = grpc.aio.insecure_channel(address)
        self.stub = pb_grpc.VerifierStub(self.channel)
        self.opens = 0
        self.verifies = 0
        self.evicted = 0
        self.streams = 0
        self.draft_lens: list[int] = []

    async def GetInfo(self, request, context):
        return await self.stub.GetInfo(request)

    async def OpenSession(self, request, context):
        self.opens += 1
        if self.opens == 1:
            context.set_trailing_metadata((("retry-after-ms", "20"),))
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "too many rounds queued")
        reply = await self.stub.OpenSession(request)
        reply.first_round.suggested_draft_len = 1
        reply.first_round.ClearField("draft_token_cost")
        return reply

    async def Verify(self, request, context):
        self.verifies += 1
        self.draft_lens.append(len(request.draft.token_ids))
        if self.verifies == 2:
            self.evicted += 1
            await self.stub.CloseSession(pb.CloseSessionRequest(session_id=request.session_id))
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                "session abcd1234... was evicted to free memory; reopen it")
        reply = await self.stub.Verify(request)
        reply.result.suggested_draft_len = 1
        reply.result.ClearField("draft_token_cost")
        return reply

    async def CloseSession(self, request, context):
        return await self.stub.CloseSession(request)

    async def Generate(self, request, context):
        async for msg in self.stub.Generate(request):
            yield msg

    async def Continue(self, request, context):
        async for msg in self.stub.Continue(request):
            msg.suggested_draft_len = 1
            msg.ClearField("draft_token_cost")
            yield msg

    async def Lookahead(self, request_iterator, context):
        """The first stream is refused (RESOURCE_EXHAUSTED), the second evicted after two
        steps; every step suggests K = 1."""
        self.streams += 1
        if self.streams == 1:  # refused after reading the open, as the verifier does
            await anext(aiter(request_iterator))
            context.set_trailing_metadata((("retry-after-ms", "20"),))
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "too many rounds queued")
        call = self.stub.Lookahead(request_iterator)
        steps = 0
        async for step in call:
            self.draft_lens.append(step.num_drafted)
            step.suggested_draft_len = 1
            step.ClearField("draft_token_cost")
            yield step
            steps += 1
            if self.streams == 2 and steps == 2:
                call.cancel()
                self.evicted += 1
                await context.abort(*self.stream_end)


# grpc.aio's status for a client write that met a stream the server had just ended
# (grpc/grpc#36066): the server's own status is lost, and the client must reopen.
LOST_TO_A_WRITE = (grpc.StatusCode.INTERNAL, "Internal error from Core")


@pytest.mark.parametrize("protocol, stream_end", [
    ("rounds", None), ("lookahead", None), ("lookahead", LOST_TO_A_WRITE)])
def test_reopen_after_eviction_and_backoff_keep_the_output(verifier, tiny_llama_pair, tmp_path,
                                                           protocol, stream_end):
    # Bounded by count (every prompt once), not by time, and drafting whenever the server
    # suggests K > 0 (not by measured rate), so a slow machine runs the same rounds.
    kw = {"clients": 1, "workload": "chat", "profile": "none", "duration_s": 120.0,
          "draft_len": 3, "max_requests": 4, "adaptive": False, "protocol": protocol}
    want = completed_outputs(fleet(verifier.address, tiny_llama_pair.draft_dir, tmp_path,
                                   **kw))

    async def through_proxy():
        proxy = MeddlingProxy(verifier.address, *([stream_end] if stream_end else []))
        server = grpc.aio.server()
        pb_grpc.add_VerifierServicer_to_server(proxy, server)
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
    assert proxy.evicted == 1 and a["reopens"] == 1
    evicted = [{"RESOURCE_EXHAUSTED": 1, (stream_end or [grpc.StatusCode.NOT_FOUND])[0].name: 1}]
    if protocol == "lookahead":
        # The client's lookahead for step 2 may meet the stream the proxy just ended: grpc.aio
        # then reports INTERNAL in place of NOT_FOUND; the client reopens all the same.
        evicted.append({"RESOURCE_EXHAUSTED": 1, "INTERNAL": 1})
    assert a["errors"] in evicted, a["errors"]
    assert a["requests_failed"] == 0
    got = completed_outputs(res)
    assert len(got) == len(want) == 4 and a["requests_completed"] == 4
    assert got == want
    if protocol == "rounds":  # after the first reply every round follows the suggestion
        assert max(proxy.draft_lens) <= 1


def test_cli_fleet_writes_json_and_plot(tiny_llama_pair, tmp_path):
    import json

    from edge_client.cli import main

    out = tmp_path / "fleet.json"
    rc = main(["fleet", "--spawn", "--target", str(tiny_llama_pair.target_dir),
               "--kv-budget-mb", "8", "--verifier-threads", "1",
               "--verifier-arg=--prefix-cache-mb=4",
               "--draft-dir", str(tiny_llama_pair.draft_dir), "--clients", "2", "--duration",
               "1.5", "--profile", "5g", "--workload", "ime", "--mode", "spec", "--drafts",
               "replay", "--json", str(out), "--plot", str(tmp_path / "cdf.png"),
               "--replay-cache", str(tmp_path / "replay.json"), "--no-progress"])
    assert rc == 0
    res = json.loads(out.read_text())
    assert (res["clients"], res["profile"]["name"], res["workload"], res["mode"],
            res["drafts"]) == (2, "5g", "ime", "spec", "replay")
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


def test_bench_fleet_sweep_writes_capacity_and_plots(tiny_llama_pair, tmp_path):
    import json

    from edge_client.cli import main

    out = tmp_path / "bench" / "fleet.json"
    rc = main([
        "bench-fleet", "--embedded", "--target", str(tiny_llama_pair.target_dir),
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


def test_sweep_points_are_medians_over_windows():
    from edge_client.bench_fleet import capacity, points

    def run(mode, clients, tok_s, p95, failed=0):
        return {"mode": mode, "clients": clients, "profile": {"name": "4g"},
                "aggregate": {"tokens_per_s": tok_s, "tpot_ms_p50": p95 / 2, "tpot_ms_p95": p95,
                              "tpot_ms_p99": p95, "ttft_ms_p50": 1.0,
                              "requests_failed": failed}}

    runs = [run("spec", 1, 10, 100), run("spec", 1, 30, 150), run("spec", 1, 20, 900),
            run("spec", 2, 40, 190), run("spec", 2, 50, 250), run("spec", 2, 45, 199),
            run("spec", 4, 60, 150), run("spec", 4, 60, 150, failed=1), run("spec", 4, 60, 150)]
    by = {p["clients"]: p for p in points(runs)}
    assert by[1]["tokens_per_s"] == 20 and by[1]["tpot_ms_p95"] == 150 and by[1]["windows"] == 3
    assert by[2]["tpot_ms_p95"] == 199 and by[4]["requests_failed"] == 1
    counts, figures = capacity(runs, 200.0)
    # One slow window does not sink a load; a failed request anywhere does.
    assert counts == {"spec": {"4g": 2}} and figures["spec"]["4g"]["tokens_per_s"] == 45


@pytest.mark.parametrize("protocol", ["rounds", "lookahead"])
def test_fleet_recovers_from_real_kv_budget_evictions(target, tiny_llama_pair, tmp_path,
                                                      protocol):
    """A KV budget of about two sessions for four clients, and every output stays the
    target's. On Verify rounds the verifier evicts idle sessions (NOT_FOUND "evicted") and
    the clients reopen them. Lookahead sessions are never idle: the older ones keep or take
    the memory (preempting younger ones, recomputed later) and the others' rounds wait for
    it; no client sees an error."""
    from cloud_verifier.engine import VerifierEngine

    per_token = VerifierEngine(target.model, target.vocab_size, target.max_context) \
        .kv.bytes_per_token
    # Bounded by count (two requests per client), not by time, so a slow machine runs the
    # same requests.
    kw = {"workload": "chat", "duration_s": 120.0, "profile": "wifi", "max_requests": 2,
          "protocol": protocol}
    with EmbeddedVerifier(target, VerifierConfig(port=0)) as roomy:  # also records drafts
        want = completed_outputs(fleet(roomy.address, tiny_llama_pair.draft_dir, tmp_path,
                                       **kw))
    config = VerifierConfig(port=0, kv_budget_bytes=2 * 40 * per_token, kv_wait_s=60.0)
    with EmbeddedVerifier(target, config) as tight:
        res = fleet(tight.address, tiny_llama_pair.draft_dir, tmp_path, **kw)
        engine = tight.server.service.engine
        assert engine.kv.bytes_in_use <= config.kv_budget_bytes
    a = res["aggregate"]
    if protocol == "rounds":
        assert a["reopens"] > 0 and a["errors"].get("NOT_FOUND", 0) >= a["reopens"]
    else:
        assert a["errors"] == {} and a["reopens"] == 0, a
    assert a["requests_failed"] == 0 and a["requests_completed"] == 8, a
    assert completed_outputs(res) == want


@pytest.mark.parametrize("where", ["--spawn", "--embedded"])
def test_verifier_args_reach_the_verifier(tiny_llama_pair, where):
    """--verifier-arg goes to the verifier's own command line: one it rejects stops the run
    before any client starts."""
    import argparse

    from edge_client.fleet import add_common_args
    from edge_client.fleet_verifier import fleet_verifier

    p = argparse.ArgumentParser()
    add_common_args(p)
    args = p.parse_args([where, "--target", str(tiny_llama_pair.target_dir),
                         "--verifier-arg=--prefix-cache-mb=-1"])
    with pytest.raises((RuntimeError, SystemExit)) as info:
        with fleet_verifier(args, clients=1):
            pass
    assert (info.type is RuntimeError) == (where == "--spawn")


def test_ime_document_prompts_hold_the_text_typed_before():
    """--ime-document: the same typing (same seed) as sentences typed alone, but each prompt
    starts with every sentence before its own, as in one text field."""
    from edge_client.fleet import IME_SENTENCES, ime_requests
    from edge_client.tokenizer import EdgeTokenizer
    from shared.paths import default_draft_dir

    tok = EdgeTokenizer(default_draft_dir())  # the shipped draft's (SmolLM2) tokenizer
    alone = ime_requests(tok, 4, 2048, seed=0)
    document = ime_requests(tok, 4, 2048, seed=0, document=True)
    assert [len(s) for s in document] == [len(s) for s in alone] and len(document) == 4
    for i, (typed_alone, typed_in_document) in enumerate(zip(alone, document, strict=True)):
        before = "".join(sentence + " " for sentence in IME_SENTENCES[:i])
        for a, d in zip(typed_alone, typed_in_document, strict=True):
            assert tok.decode(list(d.prompt_ids)) == before + tok.decode(list(a.prompt_ids))
            assert d.max_new_tokens == a.max_new_tokens
    assert len(document[3][0].prompt_ids) > len(document[2][-1].prompt_ids) > 30
