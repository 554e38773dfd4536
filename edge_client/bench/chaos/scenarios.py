"""The chaos scenarios: each turns a fault point into the faults of one run.

A run's fault point k (1..7, from the run's index) places its faults: at the k-th Step the
verifier sends (down message k; message 0 is the GetInfo reply), or at the client's round
k + 1 (up message k + 1; 0 is GetInfo, 1 the open). Over the runs the faults therefore land
at different points of the generation, each run exactly reproducible.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from edge_client.bench.chaos.proxy import (
    BLACKHOLE,
    CALL,
    CLOSE,
    DELAY,
    LOSE_REPLY,
    MUTE,
    REFUSE,
    RESET,
    UP,
    Fault,
)

# name -> (protocol, temperature): the decodings whose output is a function of the seed.
DECODINGS = {"rounds-greedy": ("rounds", 0.0), "rounds-seeded": ("rounds", 0.8),
             "lookahead-greedy": ("lookahead", 0.0)}
FAULT_POINTS = 7
# The client's deadlines in chaos runs (shorter than the defaults, so that a stall costs
# seconds): a stall lasts past the reply deadline, a delay stays well under it.
REPLY_DEADLINE_S = 3.0
CALL_DEADLINE_S = 5.0
DELAY_S = 0.25
STALL_S = REPLY_DEADLINE_S + 1.5


class VerifierControl(Protocol):
    def kill_and_restart(self) -> None: ...

    def terminate_and_restart(self) -> None: ...


def fault_point(run: int) -> int:
    return 1 + run % FAULT_POINTS


@dataclass(frozen=True)
class Scenario:
    name: str
    what: str  # one line: what happens to the generation
    faults: Callable[[int, VerifierControl], list[Fault]]  # (fault point, verifier)
    restarts_verifier: bool = False


SCENARIOS: dict[str, Scenario] = {s.name: s for s in (
    Scenario("delay", f"Step k and round k+1 arrive {DELAY_S:g} s late",
             lambda k, v: [Fault(DELAY, message=k, delay_s=DELAY_S),
                           Fault(DELAY, direction=UP, message=k + 1, delay_s=DELAY_S)]),
    Scenario("stall", f"Step k arrives {STALL_S:g} s late, past the client's "
                      f"{REPLY_DEADLINE_S:g} s reply deadline",
             lambda k, v: [Fault(DELAY, message=k, delay_s=STALL_S)]),
    Scenario("close", "the connection is closed cleanly (FIN) after Step k",
             lambda k, v: [Fault(CLOSE, message=k)]),
    Scenario("reset-down", "the connection is reset (RST) in the middle of Step k",
             lambda k, v: [Fault(RESET, message=k)]),
    Scenario("reset-up", "the connection is reset in the middle of round k+1",
             lambda k, v: [Fault(RESET, direction=UP, message=k + 1)]),
    Scenario("refuse", "reset in the middle of Step k, then the next two connections are "
                       "refused",
             lambda k, v: [Fault(RESET, message=k), Fault(REFUSE, connection=1),
                           Fault(REFUSE, connection=2)]),
    Scenario("blackhole", "after Step k nothing passes either way, sockets open",
             lambda k, v: [Fault(BLACKHOLE, message=k)]),
    Scenario("mute", "reset in the middle of Step k, then the reconnection is accepted and "
                     "never answered",
             lambda k, v: [Fault(RESET, message=k), Fault(MUTE, connection=1)]),
    Scenario("lost-reply", "round k+1 is verified but its answer is lost with the "
                           "connection: the retry re-sends a verified round",
             lambda k, v: [Fault(LOSE_REPLY, direction=UP, message=k + 1)]),
    Scenario("kill-9", "the verifier is killed (SIGKILL) after Step k; a fresh one starts "
                       "on the same port",
             lambda k, v: [Fault(CALL, message=k, action=v.kill_and_restart)],
             restarts_verifier=True),
    Scenario("sigterm", "the verifier is stopped (SIGTERM: drain, grace) after Step k; a "
                        "fresh one starts on the same port",
             lambda k, v: [Fault(CALL, message=k, action=v.terminate_and_restart)],
             restarts_verifier=True),
)}
