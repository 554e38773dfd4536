"""The simulated edge fleet without a verifier: network emulation (statistics, and its
``Link`` into the client core), configuration, the I/O-free generation state the core and
the fleet share, the sweep's arithmetic and its JSON-before-plots order, the command line,
and that the fleet runs no client loop of its own. Fleet runs over real gRPC are in
tests/test_fleet_e2e.py."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from edge_client.bench.fleet.config import FleetConfig, NotLoopback, require_loopback
from edge_client.bench.fleet.netem import PROFILES, NetEm, NetEmLink, OneWayLink
from edge_client.drafter import Proposal
from edge_client.generation_state import (
    LOOKAHEAD,
    NO_DRAFTS,
    GenerationState,
    ProtocolError,
    ServerLimits,
    SessionParams,
)
from edge_client.rate_chooser import CONTINUE, EXPLORE_CONTINUE_TOKENS, SPEC, RateChooser
from shared.pb import verifier_pb2 as pb

FLEET_DIR = Path(__file__).resolve().parents[1] / "edge_client" / "bench" / "fleet"

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
    link = OneWayLink(prof, 0.0, np.random.default_rng(2))
    delays = np.array([link.one_way_s(100) for _ in range(20000)])
    base = prof.rtt_ms / 2000
    late = delays > base + 1e-9
    n, p = len(delays), prof.loss
    assert abs(late.sum() - n * p) <= 5 * np.sqrt(n * p * (1 - p))
    assert np.all(delays[late] >= base + prof.rto_s - 1e-9)
    assert np.allclose(delays[~late], base)


def test_netem_bandwidth_and_in_order_delivery():
    prof = dataclasses.replace(PROFILES["none"], up_mbps=8.0)  # 1 byte per microsecond
    link = OneWayLink(prof, prof.up_mbps, np.random.default_rng(0))
    first = link.deliver_at(0.0, 9900)  # 10000 bytes with the per-message overhead
    assert first == pytest.approx(0.01)
    # Sent at the same time, the second waits for the first to be on the wire.
    assert link.deliver_at(0.0, 9900) == pytest.approx(0.02)


def test_netem_link_delays_what_the_core_sends_and_receives():
    """The core's Link over the emulation: a send returns once the message crossed the
    uplink (half the RTT here, no jitter or loss), a received reply is the device's half an
    RTT later, and 'none' adds nothing."""
    prof = dataclasses.replace(PROFILES["none"], name="fixed", rtt_ms=80.0)
    link = NetEmLink(NetEm(prof, np.random.default_rng(0)))

    async def send() -> float:
        t0 = time.perf_counter()
        await link.send(100)
        return time.perf_counter() - t0

    assert 0.039 <= asyncio.run(send()) < 0.2
    t0 = time.perf_counter()
    assert link.arrival(100) - t0 == pytest.approx(0.04, abs=0.01)
    plain = NetEmLink(NetEm(PROFILES["none"], np.random.default_rng(0)))
    assert asyncio.run(asyncio.wait_for(plain.send(10**6), 0.05)) is None
    t0 = time.perf_counter()
    assert plain.arrival(10**6) - t0 < 0.01


def test_fleet_only_targets_loopback():
    require_loopback("127.0.0.1:50051")
    require_loopback("localhost:50051")
    with pytest.raises(NotLoopback):
        require_loopback("192.0.2.1:50051")


@pytest.mark.parametrize("bad", [{"clients": 0}, {"duration_s": 0}, {"max_requests": 0},
                                 {"chat_tokens": 0}, {"workload": "essay"}, {"mode": "x"},
                                 {"protocol": "unary"}, {"retry_budget_s": -1},
                                 {"drafts": "replay", "temperature": 0.7},
                                 {"drafter": "feature"}, {"stop_confidence": 1.0}])
def test_fleet_config_rejects_bad_values(bad):
    with pytest.raises(ValueError):
        FleetConfig(**bad)


def test_fleet_config_gives_the_core_its_protocol_deadlines_and_retry_budget():
    config = FleetConfig(duration_s=20.0, deadline_s=7.0, retry_budget_s=12.0)
    assert config.protocol == "lookahead" and config.core_protocol == "lookahead"
    assert FleetConfig(mode="baseline").core_protocol == "cloud"
    assert FleetConfig(protocol="rounds").core_protocol == "rounds"
    d = config.deadlines()
    assert (d.call_s, d.reply_s, d.stream_s) == (7.0, 7.0, 27.0)
    assert config.retry().budget_s == 12.0


# -- the generation state the fleet and the app client share ------------------------------------

LIMITS = ServerLimits(vocab_size=96, max_draft_len=8, max_context=64)


def step(round_no: int, drafts: list[int], n: int, token: int, length: int, finished=False,
         suggested=None, cost=None) -> pb.Step:
    """The Step that accepts ``n`` of ``drafts`` and commits ``token`` after them."""
    s = pb.Step(round=round_no, token_ids=drafts[:n] + [token], num_drafted=len(drafts),
                num_accepted=n, committed_length=length, finished=finished, target_forwards=1)
    if suggested is not None:
        s.suggested_draft_len = suggested
    if cost is not None:
        s.draft_token_cost = cost
    return s


def P(*tokens: int, confidence=None) -> Proposal:
    return Proposal(list(tokens), None, confidence)


def test_state_apply_commits_accepted_drafts_and_the_next_token():
    r = GenerationState([5, 6, 7], SessionParams(max_new_tokens=10), LIMITS, draft_len=4)
    assert r.open_message(P(1, 2, 3, 4)).open.max_new_tokens == 10
    assert r.apply(step(0, [1, 2, 3, 4], 2, 9, 6), P(1, 2, 3, 4)) == [1, 2, 9]
    assert r.committed == [5, 6, 7, 1, 2, 9] and r.round_no == 1
    assert r.verify_message(P(4)).verify.round == 1


@pytest.mark.parametrize("bad", [
    step(1, [1, 2], 0, 9, 4),  # answers another round
    pb.Step(round=0, token_ids=[1, 2, 5, 9], num_drafted=2, num_accepted=3,
            committed_length=7),  # accepts more drafts than sent
    step(0, [1, 2], 0, 96, 4),  # token out of the vocabulary
    step(0, [1, 2], 1, 9, 7),  # committed length disagrees
    step(0, [3, 2], 1, 9, 5),  # accepts a draft that was not sent
])
def test_state_rejects_inconsistent_replies(bad):
    r = GenerationState([5, 6, 7], SessionParams(max_new_tokens=10), LIMITS, draft_len=2)
    with pytest.raises(ProtocolError):
        r.apply(bad, P(1, 2))


def test_state_follows_the_suggested_draft_len_and_the_room_left():
    r = GenerationState([5], SessionParams(max_new_tokens=6), LIMITS, draft_len=4,
                        follow_suggestion=True)
    assert r.next_k() == 4
    r.apply(step(0, [1, 2, 3, 4], 0, 9, 2, suggested=2), P(1, 2, 3, 4))
    assert r.next_k() == 2  # min(own 4, suggested 2)
    r.apply(step(1, [1, 2], 0, 9, 3, suggested=0), P(1, 2))
    assert r.next_k() == 0  # 0 = send no drafts: plain decoding is cheaper now
    r.apply(step(2, [], 0, 9, 4), NO_DRAFTS)
    assert r.next_k() == 2  # no suggestion: own K, but only 3 tokens remain
    r.apply(step(3, [1, 2], 2, 9, 7, finished=True), P(1, 2))
    assert r.finished and r.remaining == 0


def test_state_with_confidences_is_cut_by_the_servers_token_cost():
    r = GenerationState([5], SessionParams(max_new_tokens=20), LIMITS, draft_len=6,
                        follow_suggestion=True)
    sure = P(1, 2, 3, 4, 5, 6, confidence=[0.99, 0.95, 0.6, 0.3, 0.9, 0.9])
    assert r.worth_sending(sure) == sure  # no cost known yet: all of it
    r.apply(step(0, sure.tokens, 0, 9, 2, suggested=1, cost=0.1), sure)
    assert r.next_k() == 6  # with confidences the suggestion (1) gives way to the cut
    sent = r.worth_sending(sure)
    assert sent.tokens == [1, 2, 3] and sent.confidence == [0.99, 0.95, 0.6]
    assert not r.verify_message(sent).verify.draft.confidence  # already cut: not sent
    assert r.lookahead_message(sure).lookahead.draft.confidence == pytest.approx(
        sure.confidence)  # the verifier cuts lookaheads itself
    plain = P(1, 2)  # a drafter without confidences: the suggestion rules
    assert r.worth_sending(plain) == plain and r.next_k() == 1


def test_state_checks_the_token_cost_before_applying_anything():
    r = GenerationState([5], SessionParams(max_new_tokens=20), LIMITS, draft_len=6,
                        follow_suggestion=True)
    r.apply(step(0, [1], 0, 9, 2, cost=0.1), P(1))
    for bad in (-0.5, float("nan"), float("inf")):
        with pytest.raises(ProtocolError, match="draft_token_cost"):
            r.apply(step(1, [1, 2], 0, 9, 3, cost=bad), P(1, 2))
    assert r.round_no == 1 and r.committed == [5, 9]


def test_rate_chooser_picks_the_faster_mode_and_keeps_measuring_the_other():
    c = RateChooser(weight=0.5, explore_every=4)
    assert c.choose() == SPEC  # nothing measured yet: draft first
    c.observe(SPEC, 2, 0.2)  # 10 tok/s
    assert c.choose() == CONTINUE  # then measure the server decoding alone
    assert c.continue_tokens() == EXPLORE_CONTINUE_TOKENS
    c.observe(CONTINUE, 16, 0.8)  # 20 tok/s
    picks = [c.choose() for _ in range(8)]
    # Decoding is faster; every 4th decision re-measures drafting.
    assert picks == [CONTINUE, CONTINUE, CONTINUE, SPEC] * 2
    c.observe(SPEC, 9, 0.2)  # drafting got much faster (45 -> EMA 27.5 tok/s)
    assert c.rate[SPEC] == pytest.approx(27.5)
    assert c.choose() == SPEC
    c.observe(SPEC, 0, 0.1)  # nothing delivered: no information, ignored
    assert c.rate[SPEC] == pytest.approx(27.5)


def test_state_decodes_when_k_is_zero_or_when_the_chooser_says_so():
    chooser = RateChooser()
    r = GenerationState([5], SessionParams(max_new_tokens=100), LIMITS, draft_len=4,
                        follow_suggestion=True, chooser=chooser)
    assert not r.wants_decode()  # drafting is measured first
    r.apply(step(0, [1, 2], 2, 9, 4, suggested=0), P(1, 2))
    assert r.wants_decode()  # the server says drafting does not pay: until it does
    d = r.decode_message().decode
    assert (d.round, d.max_tokens, d.stop_when_drafting_pays) == (1, 97, True)
    r.apply(step(1, [], 0, 9, 5, suggested=3), NO_DRAFTS)
    r.observe(SPEC, 3, 0.3)
    assert r.wants_decode()  # the chooser has not measured decoding yet
    d = r.decode_message().decode
    assert (d.max_tokens, d.stop_when_drafting_pays) == (EXPLORE_CONTINUE_TOKENS, False)
    # Without a chooser, only K = 0 leads to a Decode.
    plain = GenerationState([5], SessionParams(max_new_tokens=100), LIMITS, draft_len=0)
    assert plain.wants_decode()
    assert plain.decode_message().decode.stop_when_drafting_pays is False


def test_reopen_resends_the_full_context_the_same_params_and_the_draft_in_flight():
    params = SessionParams(max_new_tokens=10, temperature=0.5, seed=77, stop_token_ids=(3,))
    r = GenerationState([5, 6], params, LIMITS, draft_len=2)
    r.open_message(P(1, 2))
    r.apply(step(0, [1, 2], 2, 9, 5), P(1, 2))
    r.verify_message(P(4, 4))
    r.apply(step(1, [4, 4], 1, 8, 7), P(4, 4))
    r.verify_message(P(11, 12))  # in flight when the stream is lost
    first = r.reopen_first()
    assert first is not None and first.tokens == [11, 12]
    req = r.open_message(first).open
    assert list(req.prompt_token_ids) == [5, 6, 1, 2, 9, 4, 8]
    assert req.max_new_tokens == 5 and list(req.stop_token_ids) == [3]
    assert req.sampling.seed == 77 and req.sampling.temperature == pytest.approx(0.5)
    assert list(req.first_draft.token_ids) == [11, 12]
    assert req.drafting == pb.DRAFTING_ROUNDS
    assert r.round_no == 0  # the new session's first round rides on its open
    # A lookahead session drafts afresh after the committed text.
    assert GenerationState([5], params, LIMITS, 2, LOOKAHEAD).reopen_first() is None


# -- the device's accounting -----------------------------------------------------------------


# -- the sweep ----------------------------------------------------------------------------------


def fake_run(mode, clients, tok_s, p95, failed=0, profile="4g"):
    return {"mode": mode, "clients": clients, "profile": {"name": profile},
            "aggregate": {"tokens_per_s": tok_s, "tpot_ms_p50": p95 / 2, "tpot_ms_p95": p95,
                          "tpot_ms_p99": p95, "ttft_ms_p50": 1.0, "requests_failed": failed},
            "samples": {"tpot_ms": [p95 / 2, p95], "ttft_ms": [1.0, 2.0]}}


def test_sweep_points_are_medians_over_windows():
    from edge_client.bench.fleet.sweep import capacity, points

    runs = [fake_run("spec", 1, 10, 100), fake_run("spec", 1, 30, 150),
            fake_run("spec", 1, 20, 900), fake_run("spec", 2, 40, 190),
            fake_run("spec", 2, 50, 250), fake_run("spec", 2, 45, 199),
            fake_run("spec", 4, 60, 150), fake_run("spec", 4, 60, 150, failed=1),
            fake_run("spec", 4, 60, 150)]
    by = {p["clients"]: p for p in points(runs)}
    assert by[1]["tokens_per_s"] == 20 and by[1]["tpot_ms_p95"] == 150 and by[1]["windows"] == 3
    assert by[2]["tpot_ms_p95"] == 199 and by[4]["requests_failed"] == 1
    counts, figures = capacity(runs, 200.0)
    # One slow window does not sink a load; a failed request anywhere does.
    assert counts == {"spec": {"4g": 2}} and figures["spec"]["4g"]["tokens_per_s"] == 45


SWEEP_KEYS = {"slo_tpot_p95_ms", "capacity", "capacity_figures", "never_worse", "workload",
              "drafts", "draft_len", "duration_s", "repeats", "points", "started_unix",
              "wall_s", "plots", "verifier", "runs"}


def test_sweep_writes_its_json_before_it_plots(tmp_path, monkeypatch, caplog):
    """A plot that fails (here: no matplotlib) is a warning; the JSON is already on disk
    and lists only the plots written."""
    from edge_client.bench.fleet import sweep

    runs = [fake_run("spec", 1, 12, 100), fake_run("baseline", 1, 10, 120)]
    settings = {"workload": "chat", "drafts": "replay", "draft_len": 4, "duration_s": 1.0,
                "repeats": 1}
    out = tmp_path / "s.json"
    seen_on_disk = []

    def no_matplotlib(*args, **kwargs):
        seen_on_disk.append(json.loads(out.read_text()))
        raise ModuleNotFoundError("No module named 'matplotlib'")

    monkeypatch.setattr("edge_client.bench.fleet.plots.plot_latency_cdf", no_matplotlib)
    with caplog.at_level(logging.WARNING):
        sweep.write_sweep(out, None, runs, 200.0, settings, {"spawned": False}, time.time(),
                          ["4g"], ["spec", "baseline"])
    assert seen_on_disk and set(seen_on_disk[0]) == SWEEP_KEYS
    data = json.loads(out.read_text())
    assert set(data) == SWEEP_KEYS and data["plots"] == {}
    assert data["capacity"] == {"spec": {"4g": 1}, "baseline": {"4g": 1}}
    assert data["never_worse"][0]["ratio"] == pytest.approx(1.2)
    assert "plotting failed" in caplog.text


def test_sweep_plots_land_beside_the_json(tmp_path):
    pytest.importorskip("matplotlib")
    from edge_client.bench.fleet import sweep

    runs = [fake_run("spec", n, 10 * n, 50 * n) for n in (1, 2)] + [
        fake_run("baseline", n, 9 * n, 60 * n) for n in (1, 2)]
    data = sweep.write_sweep(tmp_path / "s.json", None, runs, 200.0, {}, {}, time.time(),
                             ["4g"], ["spec", "baseline"])
    assert set(data["plots"]) == {"latency_cdf", "vs_clients"}
    for png in data["plots"].values():
        assert Path(png).parent == tmp_path
        assert Path(png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# -- the command line and the package's shape --------------------------------------------------


def test_bench_cli_help_and_version_load_no_torch():
    code = """
import sys
from edge_client.bench.cli import main
for argv in (["--help"], ["--version"], ["fleet", "--help"], ["sweep", "--help"],
             ["e2e", "--help"], ["acceptance", "--help"]):
    try:
        main(argv)
    except SystemExit as e:
        assert e.code == 0, (argv, e.code)
assert "torch" not in sys.modules and "onnxruntime" not in sys.modules, sorted(sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=Path(__file__).resolve().parents[1])
    assert out.returncode == 0, out.stderr
    assert "edgespec " in out.stdout
    for word in ("--protocol", "--json PATH", "--model", "--draft-dir", "--retry-budget-s"):
        assert word in out.stdout


def test_fleet_flags_reach_the_config():
    import argparse

    from edge_client.bench.fleet.cli import add_fleet_args, config_from_args

    p = argparse.ArgumentParser()
    add_fleet_args(p)
    args = p.parse_args(["--spawn", "--json", "x.json", "--model", "m", "--protocol",
                         "rounds", "--mode", "baseline", "--deadline", "5",
                         "--retry-budget-s", "9", "--clients", "3"])
    assert args.model == "m" and args.json == Path("x.json")
    c = config_from_args(args, args.clients, args.profile, args.mode, args.duration)
    assert (c.protocol, c.mode, c.core_protocol, c.clients) == ("rounds", "baseline", "cloud", 3)
    assert (c.deadline_s, c.retry_budget_s) == (5.0, 9.0)
    assert p.parse_args(["--server", "127.0.0.1:1", "--json", "y"]).protocol == "lookahead"
    c = config_from_args(p.parse_args(["--server", "127.0.0.1:1", "--json", "y", "--drafter",
                                       "model", "--stop-confidence", "0"]),
                         1, "wifi", "spec", 5.0)
    assert (c.drafter, c.stop_confidence) == ("model", 0.0)


def test_the_fleet_drafts_as_the_product_does_by_default():
    """FleetConfig's drafter defaults are spelled out (parsing a fleet command imports no
    client); they are the product's, and its drafter kinds the product's independent ones."""
    from edge_client.bench.fleet.config import FLEET_DRAFTERS
    from edge_client.client import GenerationConfig
    from edge_client.combined_drafter import DRAFTER_KINDS, FEATURE

    assert FleetConfig().drafter == GenerationConfig.drafter
    assert FleetConfig().stop_confidence == GenerationConfig.stop_confidence
    assert set(FLEET_DRAFTERS) == set(DRAFTER_KINDS) - {FEATURE}


def test_the_fleet_runs_no_client_loop_of_its_own():
    """Every stream goes through edge_client.core: the fleet package opens no grpc.aio
    channel or stub of its own and has none of the old loops or retry constants."""
    source = "\n".join(p.read_text() for p in sorted(FLEET_DIR.glob("*.py")))
    for banned in ("VerifierServiceStub", "grpc.aio.insecure_channel", ".Session(", ".Generate(",
                   "DeviceLink", "class Outbox", "generate_tokens", "MAX_ATTEMPTS",
                   "BACKOFF_CAP_S", "retry-after-ms", "def _spec", "def _lookahead",
                   "def _baseline"):
        assert banned not in source, banned
    assert "core.generate(" in (FLEET_DIR / "device.py").read_text()
    for path in FLEET_DIR.glob("*.py"):
        assert len(path.read_text().splitlines()) <= 600, path.name
    for gone in ("fleet.py", "bench_fleet.py", "fleet_verifier.py", "netem.py"):
        assert not (FLEET_DIR.parents[1] / gone).exists(), gone


def test_ime_document_prompts_hold_the_text_typed_before():
    """ime_document: the same typing (same seed) as sentences typed alone, but each prompt
    starts with every sentence before its own, as in one text field."""
    from edge_client.bench.fleet.workload import IME_SENTENCES, ime_requests
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
