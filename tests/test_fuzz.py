"""The fuzz suite on the tiny model: Hypothesis-drawn requests (every request message, raw
undecodable payloads, metadata) against a live verifier process with an API key, while an
honest session of the product client runs beside them all the time.

Deterministic (``derandomize``): the same requests on every run. Sample counts: 200
structured requests, 60 undecodable payloads, 40 mixed ones before the final checks.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from edge_client.bench.fuzz.run import run_fuzz
from edge_client.bench.fuzz.statuses import (
    DOCUMENTED_CODES,
    documented,
    outcome_name,
    parse_error_table,
    undecodable_answered_right,
)
from edge_client.bench.fuzz.strategies import any_requests, raw_requests, structured_requests
from edge_client.bench.fuzz.target import (
    KV_BUDGET_MB,
    PREFIX_CACHE_MB,
    RSS_SLACK_MB,
    SERVER_ARGS,
    VLLM_KV_CACHE_GB,
    FuzzTarget,
    HonestSession,
    memory_caps_mb,
    server_args,
)
from shared import errors

REPO = Path(__file__).resolve().parents[1]
RSS_BOUND_MB = PREFIX_CACHE_MB + KV_BUDGET_MB + RSS_SLACK_MB
FUZZ = dict(derandomize=True, database=None, deadline=None,
            suppress_health_check=list(HealthCheck))


@pytest.mark.parametrize("engine", [["--engine=vllm"], ["--engine", "vllm"]])
def test_vllm_target_swaps_the_builtin_kv_budget_for_its_pool(engine):
    # vLLM refuses --kv-budget-mb (it owns its KV memory): its pool size takes the place, the
    # rest of the limits stay, and the RSS bound counts the pool instead of the budget.
    args = server_args(engine + ["--max-sessions", "4"])
    assert "--kv-budget-mb" not in args
    i = args.index("--vllm-kv-cache-gb")
    assert args[i + 1] == str(VLLM_KV_CACHE_GB)
    assert args[-len(engine) - 2:] == engine + ["--max-sessions", "4"]
    assert len(args) == len(SERVER_ARGS) + len(engine) + 2
    assert server_args(["--threads=1"]) == SERVER_ARGS + ["--threads=1"]
    assert memory_caps_mb(engine) == VLLM_KV_CACHE_GB * 1024
    assert memory_caps_mb([]) == PREFIX_CACHE_MB + KV_BUDGET_MB


@pytest.fixture(scope="module")
def target(tiny_llama_pair):
    t = FuzzTarget(str(tiny_llama_pair.target_dir))
    yield t
    t.close()


@pytest.fixture(scope="module")
def honest(target, tiny_llama_pair):
    """Runs for the whole module, beside every fuzz test."""
    with HonestSession(target, tiny_llama_pair.draft_dir, "t5 t6 t7 t8", tokens=16) as h:
        yield h


def test_the_allowed_statuses_are_the_documented_ones():
    table = parse_error_table((REPO / "docs" / "protocol.md").read_text())
    assert set(table) == errors.REASONS, "docs/protocol.md documents every ErrorReason"
    assert table == {reason: code.name for reason, code in DOCUMENTED_CODES.items()}


@settings(max_examples=200, **FUZZ)
@given(data=st.data())
def test_structured_requests_end_only_with_documented_statuses(target, honest, data):
    request = data.draw(structured_requests(target.limits, target.api_key))
    outcome = target.call(request)
    assert not outcome.hang, request.describe()
    assert documented(outcome.code, outcome.reason), \
        f"{outcome_name(outcome.code, outcome.reason)}: {outcome.message}"


@settings(max_examples=60, phases=[Phase.explicit, Phase.generate], **FUZZ)
@given(data=st.data())
def test_undecodable_payloads_get_invalid_argument(target, honest, data):
    request = data.draw(raw_requests(target.api_key))
    outcome = target.call(request)
    assert undecodable_answered_right(outcome.code, outcome.reason,
                                      request.carries_key(target.api_key)), \
        f"{outcome_name(outcome.code, outcome.reason)}: {outcome.message}"


def test_the_server_held_through_the_fuzz(target, honest):
    """After everything above and 40 more mixed requests: the verifier is alive and serving,
    its RSS stayed within its caps plus slack, and every honest generation was unchanged."""
    report = run_fuzz(target, any_requests(target.limits, target.api_key), 40, 0, honest)
    props = report["properties"]
    assert props["no_crash"] and props["no_hang"], report
    assert props["rss_bounded"], report["rss_mb"]
    # ...and over the whole module, from the verifier's start.
    assert report["rss_mb"]["max"] <= target.initial_rss_mb + RSS_BOUND_MB, report["rss_mb"]
    assert report["honest"]["runs"] >= 2, report["honest"]
    assert props["honest_unchanged"], report["honest"]
    assert report["requests"] == 40
