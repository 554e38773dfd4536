"""The product client survives a verifier restart: kill -9 mid-generation, restart on the same
port after a pause, and the output is exactly an undisturbed run's (greedy on both protocols,
seeded sampling on Verify rounds). The verifier is a real process serving the tiny model."""

from __future__ import annotations

import pytest

from edge_client import local_verifier
from edge_client.bench.restart_drill import Case, Verifier, run_case


@pytest.fixture(scope="module")
def verifier(tiny_llama_pair):
    v = Verifier(str(tiny_llama_pair.target_dir), local_verifier.free_port())
    yield v
    v.stop()


@pytest.mark.parametrize("protocol,temperature,down_s", [
    ("rounds", 0.0, 0.0), ("lookahead", 0.0, 1.5), ("rounds", 0.8, 1.5)])
def test_a_generation_survives_kill_and_restart(verifier, tiny_llama_pair, protocol,
                                                temperature, down_s):
    result = run_case(verifier, tiny_llama_pair.draft_dir, Case(protocol, temperature, down_s),
                      tokens=60, kill_after=8, rtt_ms=30, prompt="t5 t6 t7 t8")
    assert result["killed"], result
    assert result["error"] is None, result
    assert result["identical"] and result["tokens"] == 60, result
    assert result["reopens"] >= 1, result
