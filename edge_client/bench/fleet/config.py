"""What a fleet run is: ``FleetConfig``, and the check that it only targets this machine."""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING

from edge_client.bench.fleet.netem import profile

if TYPE_CHECKING:
    from edge_client.connection import Deadlines, RetryPolicy

WORKLOADS = ("chat", "ime", "mixed")
MODES = ("spec", "baseline")
# How a spec client talks to the verifier (edge_client.generation_state): one lookahead
# session per generation, or a Verify round trip per round (with cloud-side Decodes when
# drafting does not pay). Baseline runs the core's "cloud" protocol (Generate).
PROTOCOLS = ("lookahead", "rounds")
DRAFT_SOURCES = ("model", "replay")
# The drafters a simulated device can run: the product's independent ones (no target
# features), and the product's defaults (edge_client.client.GenerationConfig); spelled out
# here so that parsing a fleet command imports no client (tests/test_fleet.py checks them).
FLEET_DRAFTERS = ("combined", "model", "ngram")
DEFAULT_DRAFTER = "combined"
DEFAULT_STOP_CONFIDENCE = 0.1


class NotLoopback(ValueError):
    """The fleet only load-tests a verifier on this machine."""


def require_loopback(address: str) -> None:
    host = address.rsplit(":", 1)[0].strip("[]")
    try:
        infos = socket.getaddrinfo(host, None)
    except socket.gaierror as err:
        raise NotLoopback(f"cannot resolve {host!r}: {err}") from err
    for info in infos:
        if not ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback:
            raise NotLoopback(f"{address} is not a loopback address; the fleet load test "
                              "only targets a verifier on this machine (127.0.0.1)")


@dataclass(frozen=True)
class FleetConfig:
    clients: int = 4
    duration_s: float = 30.0
    profile: str = "4g"
    workload: str = "chat"
    mode: str = "spec"
    drafts: str = "replay"
    # What each device drafts with (and the replay book records): the product's defaults,
    # GenerationConfig.drafter (combined: copies where the text repeats, the model elsewhere)
    # and GenerationConfig.stop_confidence.
    drafter: str = DEFAULT_DRAFTER
    stop_confidence: float = DEFAULT_STOP_CONFIDENCE
    protocol: str = "lookahead"
    draft_len: int = 4
    # Greedy drafts carry the draft's confidences, and the server's draft_token_cost cuts them
    # (shared.draft_length); off: the suggested_draft_len alone decides (an A/B switch).
    confidence: bool = True
    # Rounds clients pick drafting or Decode by measured rate (edge_client.rate_chooser);
    # off: draft whenever the server's suggestion allows.
    adaptive: bool = True
    chat_tokens: int = 128  # max new tokens of a chat answer
    # IME: the sentences are one document typed in order, so a prompt holds every sentence
    # before the one being typed (long, growing contexts); off: each sentence stands alone.
    ime_document: bool = False
    prompts: int = 8  # distinct chat prompts / IME sentences the clients cycle through
    think_ms: float | None = None  # pause before each request; None: 0 chat, 300 IME
    temperature: float = 0.0
    seed: int = 0
    # The longest wait for the verifier's next message (and for a unary call).
    deadline_s: float = 30.0
    # A generation fails after this long without a new token (edge_client.connection).
    retry_budget_s: float = 30.0
    ramp_s: float = 1.0  # clients start spread uniformly over this long
    progress: bool = True
    warm_up: bool = True  # one uncounted request per kind before the window
    keep_outputs: bool = False  # put every request's output tokens in the result (tests)
    max_requests: int = 100_000  # per client: the load ends at this count or the window's end

    def __post_init__(self) -> None:
        if not 1 <= self.clients <= 1024:
            raise ValueError("clients must be in [1, 1024]")
        if not 0 < self.duration_s <= 3600:
            raise ValueError("duration_s must be in (0, 3600]")
        profile(self.profile)
        if self.workload not in WORKLOADS:
            raise ValueError(f"workload must be one of {', '.join(WORKLOADS)}")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}")
        if self.drafts not in DRAFT_SOURCES:
            raise ValueError(f"drafts must be one of {', '.join(DRAFT_SOURCES)}")
        if self.drafter not in FLEET_DRAFTERS:
            raise ValueError(f"drafter must be one of {', '.join(FLEET_DRAFTERS)}")
        if not 0 <= self.stop_confidence < 1:
            raise ValueError("stop_confidence must be in [0, 1)")
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"protocol must be one of {', '.join(PROTOCOLS)}")
        if self.drafts == "replay" and self.temperature != 0 and self.mode == "spec":
            raise ValueError("replayed drafts need greedy decoding (temperature 0): a replayed "
                             "sample is not a fresh draw from its q, so sampling would not be "
                             "lossless")
        if (self.draft_len < 0 or self.chat_tokens < 1 or self.prompts < 1
                or self.max_requests < 1):
            raise ValueError("draft_len must be >= 0; chat_tokens, prompts and max_requests "
                             ">= 1")
        if self.deadline_s <= 0 or self.ramp_s < 0 or self.retry_budget_s < 0:
            raise ValueError("deadline_s must be > 0, ramp_s and retry_budget_s >= 0")

    @property
    def core_protocol(self) -> str:
        """The client core's protocol (edge_client.generation_state.PROTOCOLS)."""
        return self.protocol if self.mode == "spec" else "cloud"

    def deadlines(self) -> Deadlines:
        from edge_client.connection import Deadlines

        # A stream outliving its gRPC deadline reopens, losing nothing; this one outlives
        # the window.
        return Deadlines(call_s=self.deadline_s, reply_s=self.deadline_s,
                         stream_s=self.duration_s + self.deadline_s)

    def retry(self) -> RetryPolicy:
        from edge_client.connection import RetryPolicy

        return RetryPolicy(budget_s=self.retry_budget_s)
