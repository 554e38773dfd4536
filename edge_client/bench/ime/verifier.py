"""The verifier a typing run talks to, and what it computed.

``--embedded`` starts ``python -m cloud_verifier.server`` as a child process on fixed
loopback ports (edge_client.local_verifier), so that the outage drill can stop it with
SIGKILL and start it again on the same address. ``--server`` uses a running verifier, which
the benchmark cannot stop: no drill.

Server-side work comes from the verifier's Prometheus counters, read between fields (one
mode types at a time, so the difference belongs to that mode): target forwards, and the new
tokens those forwards computed (``edgespec_batch_tokens``' sum). A restarted verifier starts
its counters from zero, which ``ServerWork`` allows for.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from edge_client import local_verifier
from edge_client.bench.fleet.verifier import scrape_gauges

log = logging.getLogger(__name__)

FORWARDS = "edgespec_target_forwards_total"
TOKENS = "edgespec_batch_tokens_sum"
RESTART_POLL_S = 0.05


@dataclass
class Work:
    forwards: float = 0.0
    tokens: float = 0.0

    def __iadd__(self, other: Work) -> Work:
        self.forwards += other.forwards
        self.tokens += other.tokens
        return self


class ServerWork:
    """Reads the counters; ``since_last()`` is the work done since the previous read."""

    def __init__(self, metrics_url: str | None) -> None:
        self.url = metrics_url
        self._last: dict[str, float] | None = None

    @property
    def available(self) -> bool:
        return self.url is not None

    def _read(self) -> dict[str, float] | None:
        if self.url is None:
            return None
        try:
            return scrape_gauges(self.url, {FORWARDS, TOKENS})
        except OSError as err:  # down (the drill), or not serving metrics
            log.info("could not read %s: %s", self.url, err)
            return None

    async def since_last(self) -> Work | None:
        now = await asyncio.to_thread(self._read)
        if now is None:
            return None
        last, self._last = self._last, now
        if last is None:
            return None

        def delta(name: str) -> float:
            # A restarted verifier counts from zero again.
            value = now.get(name, 0.0)
            return value - last.get(name, 0.0) if value >= last.get(name, 0.0) else value

        return Work(delta(FORWARDS), delta(TOKENS))


class VerifierHandle:
    """A verifier at ``address``; ``stoppable`` when this run started it."""

    def __init__(self, address: str, metrics_url: str | None = None) -> None:
        self.address = address
        self.metrics_url = metrics_url
        self.stoppable = False
        self.startup_s: float | None = None

    def kill(self) -> None:
        raise RuntimeError("the benchmark cannot stop a verifier it did not start")

    async def restart(self) -> float:
        raise RuntimeError("the benchmark cannot start a verifier it did not start")

    def stop(self) -> None:
        pass


class SpawnedVerifier(VerifierHandle):
    """``python -m cloud_verifier.server`` on fixed ports, killed and restarted in place."""

    def __init__(self, model: str | None, extra: list[str] | None = None) -> None:
        port, metrics_port = local_verifier.free_port(), local_verifier.free_port()
        super().__init__(f"127.0.0.1:{port}", f"http://127.0.0.1:{metrics_port}/metrics")
        self.port = port
        self.model = model
        self.args = ["--metrics-port", str(metrics_port), *(extra or ())]
        self.stoppable = True
        self.proc = local_verifier.spawn(port, model, self.args)
        try:
            self.startup_s = local_verifier.wait_serving(self.address, self.proc)
        except BaseException:
            local_verifier.stop(self.proc)
            raise

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    async def restart(self) -> float:
        """Starts it again on the same ports; returns when it serves (perf_counter)."""
        self.proc = local_verifier.spawn(self.port, self.model, self.args)
        deadline = time.monotonic() + local_verifier.START_TIMEOUT_S
        while not await asyncio.to_thread(self._serving):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise local_verifier.VerifierStartError(
                    f"the restarted verifier did not serve (exit code {self.proc.poll()})")
            await asyncio.sleep(RESTART_POLL_S)
        return time.perf_counter()

    def _serving(self) -> bool:
        # A fresh channel per poll: one kept across the wait backs its reconnects off
        # (gRPC's default grows to minutes), and would notice the restart seconds late.
        with grpc.insecure_channel(self.address) as channel:
            try:
                reply = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=1.0)
            except grpc.RpcError:
                return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    def stop(self) -> None:
        local_verifier.stop(self.proc)
