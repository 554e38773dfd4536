"""The fuzzed verifier: its own process (so that a crash is seen, and its RSS is its own),
with an API key, small memory caps and its log in a file; the calls the fuzz makes on it;
and the honest session that runs beside the fuzz.

``FuzzTarget.call`` makes one request and says how it ended: OK, a status (code and
ErrorInfo reason), or a hang (our own deadline passed). A stream is read to its end, or
cancelled by us after ``MAX_REPLIES`` replies (which counts as OK: we ended it).
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from edge_client import local_verifier
from edge_client.bench.fuzz.strategies import SERVICE, FuzzRequest, Limits
from shared import errors
from shared.pb import verifier_pb2 as pb
from shared.pb import verifier_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

# A call still running after this long is a hang. Generous: on a loaded 2-core machine a
# tiny-model step took up to 2.5 s (a 20 s limit failed there), and we read at most
# MAX_REPLIES replies.
CALL_DEADLINE_S = 60.0
MAX_REPLIES = 8
# The verifier's memory caps: RSS may grow by at most these plus RSS_SLACK_MB.
PREFIX_CACHE_MB = 16
KV_BUDGET_MB = 64
RSS_SLACK_MB = 128
# vLLM's KV pool (its prefix cache lives in it): allocated at start, but its pages count in
# RSS only once written, so the pool may show up as growth during the run (the least the
# verifier lets vLLM have on CPUs: whole GiB, at least one).
VLLM_KV_CACHE_GB = 1
SERVER_ARGS = ["--prefix-cache-mb", str(PREFIX_CACHE_MB), "--kv-budget-mb", str(KV_BUDGET_MB),
               "--max-sessions", "16", "--max-draft-len", "8", "--session-ttl", "30",
               "--grace", "1"]


@dataclass(frozen=True)
class Outcome:
    code: grpc.StatusCode | None  # None: OK (or a stream we ended ourselves)
    reason: str | None
    message: str = ""
    replies: int = 0

    @property
    def hang(self) -> bool:
        return self.code == grpc.StatusCode.DEADLINE_EXCEEDED and self.reason is None


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def is_vllm(extra: list[str]) -> bool:
    return "--engine=vllm" in extra or any(
        a == "--engine" and b == "vllm" for a, b in zip(extra, extra[1:], strict=False))


def server_args(extra: list[str]) -> list[str]:
    """SERVER_ARGS then ``extra`` (last, so they override it). vLLM refuses --kv-budget-mb
    (it owns its KV memory), so with --engine vllm the built-in engine's budget is replaced
    by vLLM's pool size."""
    base = list(SERVER_ARGS)
    if is_vllm(extra):
        i = base.index("--kv-budget-mb")
        base[i:i + 2] = ["--vllm-kv-cache-gb", str(VLLM_KV_CACHE_GB)]
    return base + extra


def memory_caps_mb(extra: list[str]) -> float:
    """What the verifier's memory may grow by, at most, under ``server_args(extra)``: the
    prefix cache and the KV budget, or with vLLM its KV pool (the prefix cache inside it)."""
    if is_vllm(extra):
        return VLLM_KV_CACHE_GB * 1024
    return PREFIX_CACHE_MB + KV_BUDGET_MB


class FuzzTarget:
    """A verifier process serving ``model`` on a free port, with one API key."""

    def __init__(self, model: str | None, workdir: Path | None = None,
                 extra: list[str] | None = None) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="edgespec-fuzz-") if workdir is None \
            else None
        self.workdir = Path(self._tmp.name) if self._tmp else workdir
        self.api_key = secrets.token_hex(16)
        keys = self.workdir / "api-keys"
        keys.write_text(self.api_key + "\n")
        self.log_path = self.workdir / "verifier.log"
        self.port = local_verifier.free_port()
        self.address = f"127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "cloud_verifier.server", "--host", "127.0.0.1",
               "--port", str(self.port), "--log-level", "WARNING", "--api-keys-file",
               str(keys), *server_args(list(extra or ()))]
        self.memory_caps_mb = memory_caps_mb(list(extra or ()))
        if model:
            cmd += ["--model", str(model)]
        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT)
        self.startup_s = local_verifier.wait_serving(self.address, self.proc)
        self.initial_rss_mb = self.rss_mb()
        self.channel = grpc.insecure_channel(self.address)
        self.stub = pb_grpc.VerifierServiceStub(self.channel)
        info = self.stub.GetInfo(pb.GetInfoRequest(), timeout=10, metadata=self.honest_metadata)
        self.info = info
        self.limits = Limits(info.vocab_size, info.max_draft_len, info.max_context)

    @property
    def honest_metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.api_key}"),)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def serving(self) -> bool:
        with contextlib.suppress(grpc.RpcError):
            reply = health_pb2_grpc.HealthStub(self.channel).Check(
                health_pb2.HealthCheckRequest(), timeout=5)
            return reply.status == health_pb2.HealthCheckResponse.SERVING
        return False

    def rss_mb(self) -> float:
        return rss_mb(self.proc.pid)

    def tracebacks(self) -> int:
        """Tracebacks in the verifier's log so far."""
        self._log.flush()
        return self.log_path.read_bytes().count(b"Traceback (most recent call last)")

    def call(self, request: FuzzRequest) -> Outcome:
        serialize = None if request.raw else (lambda m: m.SerializeToString())
        deserialize = None  # replies are counted, not read
        name = SERVICE + request.method
        try:
            if request.method == "GetInfo":
                self.channel.unary_unary(name, serialize, deserialize)(
                    request.messages[0], timeout=CALL_DEADLINE_S, metadata=request.metadata)
                return Outcome(None, None, replies=1)
            if request.method == "Generate":
                call = self.channel.unary_stream(name, serialize, deserialize)(
                    request.messages[0], timeout=CALL_DEADLINE_S, metadata=request.metadata)
            else:
                call = self.channel.stream_stream(name, serialize, deserialize)(
                    iter(request.messages), timeout=CALL_DEADLINE_S, metadata=request.metadata)
            return self._read(call)
        except grpc.RpcError as err:
            details = errors.details_of(err)
            return Outcome(details.code, details.reason, details.message)

    @staticmethod
    def _read(call) -> Outcome:
        replies = 0
        for _ in call:
            replies += 1
            if replies == MAX_REPLIES:
                call.cancel()
                return Outcome(None, None, "cancelled by the fuzzer", replies)
        return Outcome(None, None, replies=replies)

    def close(self) -> None:
        self.channel.close()
        local_verifier.stop(self.proc)
        self._log.close()
        if self._tmp is not None:
            self._tmp.cleanup()


@dataclass
class HonestReport:
    runs: int = 0
    mismatches: int = 0
    errors: list[str] = field(default_factory=list)


class HonestSession:
    """The product client generating the same greedy and seeded texts over and over beside
    the fuzz; each output must equal the one generated before the fuzz started."""

    def __init__(self, target: FuzzTarget, draft_dir: Path | None, prompt: str,
                 tokens: int = 24) -> None:
        from edge_client.client import EdgeClient, GenerationConfig

        self.configs = [GenerationConfig(max_new_tokens=tokens, ignore_eos=True),
                        GenerationConfig(max_new_tokens=tokens, ignore_eos=True,
                                         temperature=0.8, top_p=0.95, seed=5)]
        self.prompt = prompt
        self.client = EdgeClient(target.address, draft_dir, api_key=target.api_key)
        self.references = [self._generate(c) for c in self.configs]
        self.report = HonestReport()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="honest-session", daemon=True)

    def _generate(self, config) -> list[int]:
        gen = self.client.generate(self.prompt, config)
        for _ in gen:
            pass
        return list(gen.token_ids)

    def _loop(self) -> None:
        i = 0
        while not self._stop.is_set():
            which = i % len(self.configs)
            try:
                same = self._generate(self.configs[which]) == self.references[which]
                self.report.mismatches += not same
            except Exception as err:  # noqa: BLE001 - a failed honest run is a finding
                self.report.errors.append(f"{type(err).__name__}: {err}")
            self.report.runs += 1
            i += 1

    def __enter__(self) -> HonestSession:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=120)
        self.client.close()
