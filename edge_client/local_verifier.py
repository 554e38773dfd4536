"""A verifier process on this machine, for ``edge-client generate --embedded`` and the
restart drill: started as ``python -m cloud_verifier.server`` so that the device side never
imports the cloud side (which needs the cloud extra, torch included)."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

START_TIMEOUT_S = 300.0


class VerifierStartError(RuntimeError):
    """The verifier process exited or did not start serving in time."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(port: int, model: str | None = None, extra: list[str] | None = None
          ) -> subprocess.Popen:
    # Nobody probes a local verifier's health while it drains: stop soon after SIGTERM
    # (``extra`` may say otherwise; the last flag wins).
    cmd = [sys.executable, "-m", "cloud_verifier.server", "--host", "127.0.0.1",
           "--port", str(port), "--log-level", "WARNING", "--drain-notice", "0.2"]
    if model:
        cmd += ["--model", str(model)]
    # Its own session: a Ctrl-C at the terminal (edge-client chat cancels an answer with
    # it) must not reach the verifier too; the parent stops it (``stop``).
    return subprocess.Popen(cmd + list(extra or ()), start_new_session=True)


def wait_serving(address: str, proc: subprocess.Popen,
                 timeout_s: float = START_TIMEOUT_S) -> float:
    """Waits until the verifier's health check says SERVING; returns the seconds it took."""
    t0 = time.monotonic()
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() - t0 < timeout_s:
            if proc.poll() is not None:
                raise VerifierStartError(f"the verifier process exited with code {proc.returncode}")
            with contextlib.suppress(grpc.RpcError):
                reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=1)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return time.monotonic() - t0
            time.sleep(0.1)
    raise VerifierStartError(f"the verifier at {address} was not serving after {timeout_s:.0f} s")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def local_verifier(model: str | None = None, extra: list[str] | None = None
                   ) -> Iterator[str]:
    """A verifier on a free loopback port for the block; yields its address."""
    port = free_port()
    proc = spawn(port, model, extra)
    try:
        wait_serving(f"127.0.0.1:{port}", proc)
        yield f"127.0.0.1:{port}"
    finally:
        stop(proc)
