"""Network emulation for the simulated edge fleet: per-device profiles and the delay of each
message on them.

A device's connection to the verifier is two ``OneWayLink``s (uplink, downlink). A message
of ``nbytes`` sent at time t is delivered at

    max(t + one_way, previous delivery on that link + serialization)

where one_way = propagation + X + serialization + retransmission:

- propagation = rtt_ms / 2 minus the jitter's mean, so that the mean RTT is ``rtt_ms``;
- X ~ Exponential(theta) per message and direction. Jitter is defined as measurement apps
  report it: the mean absolute difference between consecutive RTTs. An RTT holds two
  independent X, so consecutive RTTs differ by the sum of two Laplace(theta) variables, whose
  mean absolute value is 1.5 theta: theta = jitter_ms / 1.5, and the mean RTT sits
  2 theta above twice the propagation delay;
- serialization = (nbytes + WIRE_OVERHEAD_BYTES) * 8 / bandwidth of that direction;
- retransmission: gRPC runs over TCP, so a lost segment is not lost data but late data. Each
  of the message's ceil(bytes / MSS) segments is lost with probability ``loss``; a message
  with a lost segment waits one retransmission timeout, RTO = max(200 ms, mean RTT + 4 x
  jitter) (RFC 6298's SRTT + 4 RTTVAR, floored at Linux's 200 ms minimum RTO), doubling for
  each further loss of the retransmission, at most MAX_RETRANSMITS times. Small request /
  reply messages have no later segments to trigger fast retransmit, so an RTO is the
  realistic cost (Linux's tail loss probe can recover a little sooner: this is pessimistic).
- delivery is in order (TCP): a late message delays every later one on the same link.

The links draw from one seeded ``numpy.random.Generator`` per device, one draw per use.

Preset profiles are typical values, not measurements of any one network; the figures they
are chosen from (as published by their sources):

- ``wifi``: home Wi-Fi on fixed broadband. RTT 20 ms, jitter 4 ms, loss 0.1 %, 40 Mbit/s up,
  100 Mbit/s down. Ookla's market reports give median fixed-broadband multi-server latency of
  about 12 ms for a large operator (Movistar Argentina, Q1 2023); Wi-Fi's own hop adds a few
  ms. ITU-T Y.1541 QoS class 0 bounds packet loss at 1e-3, which we take as the Wi-Fi loss.
- ``5g``: RTT 30 ms, jitter 6 ms, loss 0.1 %, 20 Mbit/s up, 160 Mbit/s down. Ookla (Speedtest
  Intelligence, Q3 2021) measured a global median 5G download of 166.13 Mbit/s and upload of
  21.08 Mbit/s. ITU-R M.2410 sets the IMT-2020 user-plane latency requirement at 4 ms (eMBB)
  for the radio link alone; most of the RTT is the path beyond it.
- ``4g``: RTT 55 ms, jitter 12 ms, loss 0.5 %, 8 Mbit/s up, 20 Mbit/s down. Opensignal's State
  of LTE (November 2016) measured a global average LTE download of 17.4 Mbit/s (6.4 Mbit/s in
  India, 14 Mbit/s in the U.S.); Ookla's Q1 2023 market reports list median mobile
  multi-server latencies from 55 ms (Ethio Telecom, the lowest in Ethiopia) upward.
- ``3g-poor``: a weak 3G (HSPA) signal. RTT 200 ms, jitter 50 ms, loss 2 %, 0.4 Mbit/s up,
  1 Mbit/s down. Ookla's Q1 2023 report for Cameroon gives 184 ms as the *lowest* operator
  median mobile latency there; ITU-T Y.1541 bounds delay variation at 50 ms for its
  interactive classes; 3GPP TS 23.203 allows a packet error loss rate of 1e-2 for
  conversational voice (QCI 1). Verizon's LTE launch material put LTE user-plane latency at
  about half of 3G's.
- ``none``: no emulation (loopback as it is), for measuring the server alone.

``NetEmLink`` is how the emulation reaches the client core (edge_client.core): the core asks
its ``edge_client.link.Link`` when a message has crossed the uplink and when the device has a
reply, and waits for that time itself.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from edge_client.link import Link, until

# gRPC message prefix (5) + HTTP/2 DATA frame header (9) + TCP/IPv4 headers with timestamps
# (52), and a share of HEADERS frames; charged once per message.
WIRE_OVERHEAD_BYTES = 100
MSS_BYTES = 1448  # TCP payload per segment on a 1500-byte MTU with timestamps
MIN_RTO_S = 0.2  # Linux TCP_RTO_MIN
MAX_RETRANSMITS = 6
JITTER_TO_THETA = 1.5  # mean |Laplace(t) + Laplace(t)| = 1.5 t


@dataclass(frozen=True)
class NetworkProfile:
    name: str
    rtt_ms: float  # mean round-trip time
    jitter_ms: float  # mean |RTT_i - RTT_{i-1}|
    loss: float  # per TCP segment, each direction
    up_mbps: float  # device -> verifier; 0 = unlimited
    down_mbps: float  # verifier -> device; 0 = unlimited

    def __post_init__(self) -> None:
        if self.rtt_ms < 0 or self.jitter_ms < 0:
            raise ValueError("rtt_ms and jitter_ms must be >= 0")
        if self.jitter_ms * 2 / JITTER_TO_THETA > self.rtt_ms:
            raise ValueError(f"jitter {self.jitter_ms} ms is too large for a mean RTT of "
                             f"{self.rtt_ms} ms (needs rtt >= 4/3 jitter)")
        if not 0 <= self.loss < 1:
            raise ValueError("loss must be in [0, 1)")
        if self.up_mbps < 0 or self.down_mbps < 0:
            raise ValueError("bandwidths must be >= 0 (0 = unlimited)")

    @property
    def theta_s(self) -> float:
        """Mean of the exponential extra delay of one direction."""
        return self.jitter_ms / JITTER_TO_THETA / 1000

    @property
    def propagation_s(self) -> float:
        """The fixed part of one direction."""
        return self.rtt_ms / 2000 - self.theta_s

    @property
    def rto_s(self) -> float:
        return max(MIN_RTO_S, (self.rtt_ms + 4 * self.jitter_ms) / 1000)


PROFILES: dict[str, NetworkProfile] = {p.name: p for p in (
    NetworkProfile("none", 0.0, 0.0, 0.0, 0.0, 0.0),
    NetworkProfile("wifi", 20.0, 4.0, 0.001, 40.0, 100.0),
    NetworkProfile("5g", 30.0, 6.0, 0.001, 20.0, 160.0),
    NetworkProfile("4g", 55.0, 12.0, 0.005, 8.0, 20.0),
    NetworkProfile("3g-poor", 200.0, 50.0, 0.02, 0.4, 1.0),
)}


def profile(name: str) -> NetworkProfile:
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown network profile {name!r}; choose one of "
                         f"{', '.join(PROFILES)}") from None


class OneWayLink:
    """One direction of one device's connection: FIFO delivery times of its messages."""

    def __init__(self, prof: NetworkProfile, mbps: float, rng: np.random.Generator) -> None:
        self.profile = prof
        self.bytes_per_s = mbps * 1e6 / 8 if mbps > 0 else math.inf
        self.rng = rng
        self._last_delivery = -math.inf
        self.retransmits = 0

    def serialization_s(self, nbytes: int) -> float:
        return (nbytes + WIRE_OVERHEAD_BYTES) / self.bytes_per_s

    def retransmission_s(self, nbytes: int) -> float:
        p = self.profile.loss
        if p == 0:
            return 0.0
        segments = math.ceil((nbytes + WIRE_OVERHEAD_BYTES) / MSS_BYTES)
        p_message = 1 - (1 - p) ** segments
        delay, rto = 0.0, self.profile.rto_s
        for _ in range(MAX_RETRANSMITS):
            if self.rng.random() >= p_message:
                break
            delay += rto
            rto *= 2
            self.retransmits += 1
            p_message = p  # the retransmission is one segment
        return delay

    def one_way_s(self, nbytes: int) -> float:
        """Delay of one message on an idle link."""
        prof = self.profile
        jitter = self.rng.exponential(prof.theta_s) if prof.theta_s > 0 else 0.0
        return (prof.propagation_s + jitter + self.serialization_s(nbytes)
                + self.retransmission_s(nbytes))

    def deliver_at(self, sent_at: float, nbytes: int) -> float:
        """When a message sent at ``sent_at`` (seconds, any clock) arrives, in order."""
        arrival = max(sent_at + self.one_way_s(nbytes),
                      self._last_delivery + self.serialization_s(nbytes))
        self._last_delivery = arrival
        return arrival


class NetEm:
    """Both directions of one device's connection."""

    def __init__(self, prof: NetworkProfile, rng: np.random.Generator) -> None:
        self.profile = prof
        self.up = OneWayLink(prof, prof.up_mbps, rng)
        self.down = OneWayLink(prof, prof.down_mbps, rng)

    @property
    def enabled(self) -> bool:
        p = self.profile
        return bool(p.rtt_ms or p.loss or p.up_mbps or p.down_mbps)

    @property
    def retransmits(self) -> int:
        return self.up.retransmits + self.down.retransmits


class NetEmLink(Link):
    """The client core's link over one device's emulated connection."""

    def __init__(self, netem: NetEm) -> None:
        self.netem = netem

    async def send(self, nbytes: int) -> None:
        if self.netem.enabled:
            await until(self.netem.up.deliver_at(time.perf_counter(), nbytes))

    def arrival(self, nbytes: int) -> float:
        now = time.perf_counter()
        return self.netem.down.deliver_at(now, nbytes) if self.netem.enabled else now
