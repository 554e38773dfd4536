"""Per-tenant quotas (sessions, queued rounds, tokens per second), fair share of a full
session table between keys, and the cap on a session's new tokens."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from stream_helpers import (
    PROMPT,
    SessionCall,
    error_of,
    open_message,
    stream_error,
    verify_message,
)

from cloud_verifier.config import VerifierConfig, key_digest
from cloud_verifier.engine import VerifierEngine
from cloud_verifier.errors import InvalidRequest, TooManySessions
from cloud_verifier.metrics import VerifierMetrics
from cloud_verifier.quotas import (
    FAIR_SHARE_IDLE_S,
    Quota,
    QuotaExceeded,
    TenantQuotas,
)
from cloud_verifier.rounds import RoundRunner
from cloud_verifier.sampling import SamplingParams
from cloud_verifier.server import EmbeddedVerifier, parse_args
from cloud_verifier.target_engine import NO_DRAFT
from cloud_verifier.wire import ROUNDS, OpenParams
from shared import errors
from shared.pb import verifier_pb2 as pb
from shared.pb import verifier_pb2_grpc as pb_grpc

ALICE, BOB = "alice-key-0123456789", "bob-key-0123456789ab"
KEYS = ((key_digest(ALICE), "alice"), (key_digest(BOB), "bob"))


def bearer(key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


# -- the token bucket -------------------------------------------------------------------------

def test_the_token_bucket_admits_until_in_debt_and_refills_at_the_rate():
    clock = FakeClock()
    quotas = TenantQuotas(Quota(tokens_per_s=10, token_burst=20, pace_s=0), clock)
    assert quotas.debt_s("a") == 0
    quotas.charge("a", 50)  # one round may cost more than the burst: it runs, then owes
    assert quotas.debt_s("a") == pytest.approx(3.0)  # (50 - 20) / 10
    assert quotas.debt_s("b") == 0  # tenants do not share a bucket
    with pytest.raises(QuotaExceeded) as err:
        asyncio.run(quotas.pace("a"))
    assert err.value.retry_after_s == pytest.approx(3.0)
    assert (err.value.reason, err.value.metadata) == (errors.OVERLOADED,
                                                      {"quota": "tokens_per_s"})
    clock.now = 3.0
    assert quotas.debt_s("a") == 0
    asyncio.run(quotas.pace("a"))  # out of debt: no wait, no error
    clock.now = 1000.0  # refills up to the burst, no further
    quotas.charge("a", 21)
    assert quotas.debt_s("a") == pytest.approx(0.1)


def test_a_short_debt_is_waited_out_instead_of_refused():
    quotas = TenantQuotas(Quota(tokens_per_s=1000, token_burst=1, pace_s=5))
    quotas.charge("a", 51)  # 50 ms of debt, well under pace_s
    asyncio.run(quotas.pace("a"))
    assert quotas.debt_s("a") == 0


def test_quota_flags():
    _, config = parse_args(["--quota-sessions", "3", "--quota-queued-rounds", "2",
                            "--quota-tokens-per-s", "500", "--max-new-tokens-cap", "0"])
    assert config.quota == Quota(sessions=3, queued_rounds=2, tokens_per_s=500)
    assert config.quota.burst == 500 and config.max_new_tokens_cap is None
    for bad in (["--quota-sessions", "0"], ["--quota-tokens-per-s", "-1"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


# -- sessions, queued rounds, new tokens: on the runner -----------------------------------------

def _params(max_new_tokens: int = 0) -> OpenParams:
    return OpenParams(list(PROMPT), SamplingParams(), max_new_tokens, frozenset(), ROUNDS,
                      NO_DRAFT)


def _runner(target, **config) -> RoundRunner:
    engine = VerifierEngine(target.model, target.vocab_size, target.max_context)
    return RoundRunner(engine, VerifierConfig(port=0, **config), VerifierMetrics())


def test_a_tenant_holds_at_most_its_sessions(target):
    runner = _runner(target, quota=Quota(sessions=2))
    mine = [runner.create_session(_params(), "alice") for _ in range(2)]
    with pytest.raises(QuotaExceeded) as err:
        runner.create_session(_params(), "alice")
    assert err.value.metadata == {"quota": "sessions"} and err.value.retry_after_s > 0
    runner.create_session(_params(), "bob")  # another tenant is not held back
    runner.close(mine[0])
    runner.create_session(_params(), "alice")  # a closed session frees its place
    assert runner.metrics.quota_rejections.labels("sessions")._value.get() == 1


def test_a_tenant_queues_at_most_its_rounds(target):
    """The batcher is not running, so submitted rounds stay queued."""
    runner = _runner(target, quota=Quota(queued_rounds=1))

    async def scenario():
        a1, a2, b1 = (runner.create_session(_params(), owner)
                      for owner in ("alice", "alice", "bob"))
        first = asyncio.ensure_future(runner.run_round(a1, 0, NO_DRAFT))
        while runner.batcher.queued_for("alice") == 0:
            await asyncio.sleep(0)
        with pytest.raises(QuotaExceeded) as err:
            await runner.run_round(a2, 0, NO_DRAFT)
        assert err.value.metadata == {"quota": "queued_rounds"}
        other = asyncio.ensure_future(runner.run_round(b1, 0, NO_DRAFT))
        while runner.batcher.queued_for("bob") == 0:
            await asyncio.sleep(0)
        assert len(runner.batcher) == 2
        for task in (first, other):
            task.cancel()
        await asyncio.gather(first, other, return_exceptions=True)

    asyncio.run(scenario())


def test_max_new_tokens_is_capped(target):
    runner = _runner(target, max_new_tokens_cap=5)
    assert runner.create_session(_params(0), "a").max_new_tokens == 5  # 0 asks for the cap
    assert runner.create_session(_params(5), "a").max_new_tokens == 5
    with pytest.raises(InvalidRequest, match="cap of 5") as err:
        runner.create_session(_params(6), "a")
    assert err.value.metadata == {"field": "max_new_tokens"}
    assert _runner(target, max_new_tokens_cap=None).create_session(
        _params(0), "a").max_new_tokens == 0


def test_a_full_table_is_shared_fairly(target):
    runner = _runner(target, max_sessions=4)
    alice = [runner.create_session(_params(), "alice") for _ in range(4)]
    with pytest.raises(TooManySessions):  # alice's sessions are not idle long enough yet
        runner.create_session(_params(), "bob")
    for i, session in enumerate(alice):  # idle, the first one longest
        session.last_used -= FAIR_SHARE_IDLE_S + 10 - i
    bob = runner.create_session(_params(), "bob")
    assert alice[0].evicted and not any(s.evicted for s in alice[1:])
    with pytest.raises(TooManySessions):  # alice cannot take back from bob what is fair
        runner.create_session(_params(), "alice")
    runner.create_session(_params(), "carol")  # alice still holds 3 against carol's 0
    assert alice[1].evicted
    runner.create_session(_params(), "dave")  # alice 2, bob 1, carol 1: alice's turn
    assert alice[2].evicted
    with pytest.raises(TooManySessions):  # one each: nobody gives up one for eve
        runner.create_session(_params(), "eve")
    assert not bob.evicted and not alice[3].evicted
    assert runner.metrics.evictions.labels("fair_share")._value.get() == 3


# -- over gRPC --------------------------------------------------------------------------------

def test_one_keys_idle_sessions_do_not_lock_out_another(target):
    """alice fills the table and leaves her sessions idle; bob still opens one, and the
    alice session that made room is told to reopen (SESSION_EVICTED)."""
    config = VerifierConfig(port=0, max_sessions=3, api_keys=KEYS)
    with EmbeddedVerifier(target, config) as server, \
            grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.VerifierServiceStub(channel)
        calls = [SessionCall(stub, open_message(), metadata=bearer(ALICE)) for _ in range(3)]
        try:
            for call in calls:
                assert call.step().round == 0
            err = stream_error(stub, open_message(), metadata=bearer(BOB))
            assert (err.code, err.reason) == (grpc.StatusCode.RESOURCE_EXHAUSTED,
                                              errors.OVERLOADED)
            time.sleep(FAIR_SHARE_IDLE_S + 0.1)  # alice's sessions are now idle
            with SessionCall(stub, open_message(), metadata=bearer(BOB)) as bob:
                assert bob.step().committed_length == len(PROMPT) + 1
            # One of alice's sessions made room (the least recently used; the three were
            # answered in one batched forward, so which one is a tie); the others go on.
            outcomes = []
            for call in calls:
                try:
                    outcomes.append(call.send(verify_message(1)).step().round)
                except grpc.RpcError as exc:
                    err = errors.details_of(exc)
                    outcomes.append((err.code, err.reason))
            assert sorted(outcomes, key=str) == sorted(
                [1, 1, (grpc.StatusCode.NOT_FOUND, errors.SESSION_EVICTED)], key=str), outcomes
        finally:
            for call in calls:
                call.cancel()


def test_over_quota_is_resource_exhausted_with_retry_info(target):
    """1 token a second, a burst of 8: the open (6 prompt tokens) and a round of 8 drafts
    leave 7 tokens of debt, so the next round is refused with a RetryInfo of the debt."""
    config = VerifierConfig(port=0, api_keys=KEYS, max_draft_len=8,
                            quota=Quota(sessions=1, tokens_per_s=1, token_burst=8, pace_s=0))
    with EmbeddedVerifier(target, config) as server, \
            grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.VerifierServiceStub(channel)
        with SessionCall(stub, open_message(), metadata=bearer(ALICE)) as call:
            assert call.step().round == 0
            err = stream_error(stub, open_message(), metadata=bearer(ALICE))
            assert (err.code, err.reason, err.metadata) == (
                grpc.StatusCode.RESOURCE_EXHAUSTED, errors.OVERLOADED, {"quota": "sessions"})
            assert err.retry_after_s is not None and err.retry_after_s > 0
            assert call.send(verify_message(1, [5] * 8)).step().round == 1
            err = error_of(call.send(verify_message(2)).step)
            assert (err.code, err.reason, err.metadata) == (
                grpc.StatusCode.RESOURCE_EXHAUSTED, errors.OVERLOADED,
                {"quota": "tokens_per_s"})
            assert 0 < err.retry_after_s <= 7
        with SessionCall(stub, open_message(), metadata=bearer(BOB)) as other:
            assert other.step().round == 0  # bob has his own quota
        metrics = server.server.metrics.quota_rejections
        assert metrics.labels("sessions")._value.get() == 1
        assert metrics.labels("tokens_per_s")._value.get() == 1


def test_generate_without_max_new_tokens_stops_at_the_cap(target):
    config = VerifierConfig(port=0, max_new_tokens_cap=7)
    with EmbeddedVerifier(target, config) as server, \
            grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.VerifierServiceStub(channel)
        steps = [r.step for r in stub.Generate(pb.GenerateRequest(
            prompt_token_ids=PROMPT, max_new_tokens=0, ignore_eos=True), timeout=60)]
        assert len(steps) == 7 and steps[-1].finished
        err = error_of(lambda: list(stub.Generate(pb.GenerateRequest(
            prompt_token_ids=PROMPT, max_new_tokens=8), timeout=60)))
        assert (err.code, err.reason, err.metadata) == (
            grpc.StatusCode.INVALID_ARGUMENT, errors.INVALID_ARGUMENT,
            {"field": "max_new_tokens"})
