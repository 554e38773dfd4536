"""The verifier a fleet run targets: ``--server`` (already running), ``--embedded`` (in this
process) or ``--spawn`` (``edgespec-verifier`` in a child process, on free loopback ports).

A spawned verifier is also watched, as an operator would watch one: its Prometheus endpoint
is scraped every ``SCRAPE_EVERY_S`` for the KV cache bytes in use, and at the end the report
(``VerifierReport``) gives its peak resident memory (the kernel's VmHWM), the largest KV
footprint seen against the configured budget, and how it exited (a crash shows as a
non-zero exit code).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc

log = logging.getLogger(__name__)

SPAWN_READY_TIMEOUT_S = 300.0
SCRAPE_EVERY_S = 0.5
KV_METRIC = "edgespec_kv_cache_bytes"
PREEMPTIONS_METRIC = "edgespec_num_preemptions_total"
# The verifier's online fit of what a forward costs (cloud_verifier.draft_policy), as the
# report names it: key -> (gauge, scale from the gauge's unit to the key's).
COST_METRICS = {"fixed_ms": ("edgespec_verify_cost_fixed_seconds", 1000.0),
                "session_cost": ("edgespec_verify_cost_per_session_ratio", 1.0),
                "token_cost": ("edgespec_verify_cost_per_token_ratio", 1.0)}


@dataclass
class VerifierReport:
    """What a spawned verifier did during a run (None where not observed)."""

    spawned: bool
    threads: int | None = None  # torch threads asked of a spawned verifier (None: its default)
    extra_args: list[str] = field(default_factory=list)  # --verifier-arg values, in order
    kv_budget_bytes: int | None = None
    kv_peak_bytes: float | None = None  # largest scraped value
    scrapes: int = 0
    # Sessions whose KV was dropped for an older one's round (last scraped count).
    preemptions: float | None = None
    peak_rss_bytes: int | None = None
    exit_code: int | None = None  # 0: drained and stopped cleanly on SIGTERM
    # Last scraped verify-cost fit: fixed_ms, session_cost and token_cost (relative).
    verify_cost_fit: dict[str, float] | None = None

    def as_dict(self) -> dict:
        out = dict(self.__dict__)
        out["kv_within_budget"] = (None if self.kv_budget_bytes is None
                                   or self.kv_peak_bytes is None
                                   else self.kv_peak_bytes <= self.kv_budget_bytes)
        out["peak_rss_mb"] = (None if self.peak_rss_bytes is None
                              else round(self.peak_rss_bytes / 2**20, 1))
        return out


@dataclass
class FleetVerifier:
    address: str
    report: VerifierReport = field(default_factory=lambda: VerifierReport(spawned=False))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def peak_rss_bytes(pid: int) -> int | None:
    """The process's peak resident set (Linux VmHWM), or None where unavailable."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def scrape_gauges(url: str, names: set[str], timeout_s: float = 2.0) -> dict[str, float]:
    """The unlabelled samples of ``names`` from a Prometheus text endpoint."""
    with urllib.request.urlopen(url, timeout=timeout_s) as reply:
        lines = reply.read().decode().splitlines()
    out = {}
    for line in lines:
        name, _, rest = line.partition(" ")
        if name in names:
            out[name] = float(rest.split()[0])
    return out


class _KVWatcher(threading.Thread):
    def __init__(self, url: str, report: VerifierReport) -> None:
        super().__init__(daemon=True, name="kv-watcher")
        self.url = url
        self.report = report
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(SCRAPE_EVERY_S):
            self.scrape()

    def scrape(self) -> None:
        try:
            values = scrape_gauges(self.url, {KV_METRIC, PREEMPTIONS_METRIC,
                                              *(m for m, _ in COST_METRICS.values())})
        except OSError:
            return  # not up yet, or shutting down
        r = self.report
        value = values.get(KV_METRIC)
        if value is not None:
            r.scrapes += 1
            r.kv_peak_bytes = value if r.kv_peak_bytes is None else max(r.kv_peak_bytes, value)
        r.preemptions = values.get(PREEMPTIONS_METRIC, r.preemptions)
        if values.get(COST_METRICS["fixed_ms"][0], 0.0) > 0:  # 0 until the verifier's first fit
            r.verify_cost_fit = {key: values[name] * scale
                                 for key, (name, scale) in COST_METRICS.items() if name in values}


@contextlib.contextmanager
def spawned_verifier(model: str | None, max_sessions: int, kv_budget_mb: float | None = None,
                     threads: int | None = None,
                     extra_args: list[str] | None = None) -> Iterator[FleetVerifier]:
    """``edgespec-verifier`` in a child process; watched while it runs, stopped on exit.
    ``extra_args`` go last on its command line."""
    port, metrics_port = _free_port(), _free_port()
    cmd = [sys.executable, "-m", "cloud_verifier.server", "--host", "127.0.0.1", "--port",
           str(port), "--max-sessions", str(max_sessions), "--metrics-port",
           str(metrics_port), "--log-level", "WARNING"]
    if model:
        cmd += ["--model", str(model)]
    if kv_budget_mb is not None:
        cmd += ["--kv-budget-mb", str(kv_budget_mb)]
    if threads:
        cmd += ["--threads", str(threads)]
    cmd += extra_args or []
    report = VerifierReport(spawned=True, threads=threads, extra_args=list(extra_args or []),
                            kv_budget_bytes=None if kv_budget_mb is None
                            else int(kv_budget_mb * 2**20))
    proc = subprocess.Popen(cmd)
    address = f"127.0.0.1:{port}"
    watcher = _KVWatcher(f"http://127.0.0.1:{metrics_port}/metrics", report)
    try:
        with grpc.insecure_channel(address) as channel:
            deadline = time.monotonic() + SPAWN_READY_TIMEOUT_S
            while True:  # bounded: the child loads the target first
                try:
                    grpc.channel_ready_future(channel).result(timeout=2.0)
                    break
                except grpc.FutureTimeoutError:
                    if proc.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"the spawned verifier did not come up on "
                                           f"{address} (exit code {proc.poll()})") from None
        watcher.start()
        yield FleetVerifier(address, report)
    finally:
        if watcher.is_alive():
            watcher.stopped.set()
            watcher.join()
            watcher.scrape()
        report.peak_rss_bytes = peak_rss_bytes(proc.pid)
        proc.terminate()  # SIGTERM: the verifier drains and exits
        try:
            report.exit_code = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            report.exit_code = proc.wait()
        log.info("spawned verifier: %s", report.as_dict())


@contextlib.contextmanager
def fleet_verifier(args, clients: int) -> Iterator[FleetVerifier]:
    """The --server address, or a verifier started for --embedded / --spawn."""
    max_sessions = args.max_sessions or max(64, 2 * clients)
    kv_budget_mb = getattr(args, "kv_budget_mb", None)
    extra = list(getattr(args, "verifier_arg", None) or [])
    if getattr(args, "spawn", False):
        with spawned_verifier(args.model, max_sessions, kv_budget_mb,
                              getattr(args, "verifier_threads", None), extra) as verifier:
            yield verifier
        return
    if not args.embedded:
        yield FleetVerifier(args.server)
        return
    # the cloud side needs torch
    from cloud_verifier.server import EmbeddedVerifier, load_served_target, parse_args

    budget = [] if kv_budget_mb is None else ["--kv-budget-mb", str(kv_budget_mb)]
    _, config = parse_args(["--port", "0", "--max-sessions", str(max_sessions), *budget,
                            *extra])
    with EmbeddedVerifier(load_served_target(args.model), config) as verifier:
        yield FleetVerifier(verifier.address, VerifierReport(spawned=False, extra_args=extra))
