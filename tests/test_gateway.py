"""The session-affine gateway for real: Debian's nginx running deploy/nginx/gateway.conf in
front of 3 verifier processes (tiny model) on loopback.

- Every generation's rounds land on one replica, and every generation over one document on
  the same one, where its prefix cache is: shown from the replicas' Prometheus metrics,
  one generation at a time.
- A fleet through the gateway survives kill -9 of the replica serving most of its sessions:
  they reopen on another, 0 requests fail, outputs equal the target's greedy text.
- A rolling restart (SIGTERM one replica at a time: NOT_SERVING, drain, exit, start again)
  loses nothing either.

Skipped where nginx is not installed; under CI (which installs it, .ci/run) it fails instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from edge_client import local_verifier
from edge_client.bench.fleet.config import FleetConfig
from edge_client.bench.fleet.run import run_fleet_async
from edge_client.client import AsyncEdgeClient, GenerationConfig
from edge_client.connection import RetryPolicy, document_routing_key

REPO = Path(__file__).resolve().parent.parent
GATEWAY_CONF = REPO / "deploy" / "nginx" / "gateway.conf"
REPLICAS = 3
# The upstream's server lines (the k8s slot Services) and the listen directive: the only parts
# of the shipped configuration the test replaces.
_UPSTREAM_SERVER = re.compile(r"^([ \t]*)server\s+[\w.-]+:\d+(\s[^;]*)?;\n", re.MULTILINE)
_LISTEN = re.compile(r"^([ \t]*)listen\s+(\d+)((?:\s+http2)?);", re.MULTILINE)


def nginx_binary() -> str:
    found = shutil.which("nginx") or next(
        (p for p in ("/usr/sbin/nginx",) if os.access(p, os.X_OK)), None)
    if found is None:
        if os.environ.get("CI"):  # .ci/run installs it: never skip there
            pytest.fail("nginx is not installed (apt-get install nginx)")
        pytest.skip("nginx is not installed (apt-get install nginx)")
    return found


def render_gateway_conf(conf: str, upstreams: list[str], listen: dict[int, str],
                        conf_dir: Path) -> str:
    """The shipped gateway.conf with its upstream servers (keeping their parameters), listen
    addresses, include directory and access log replaced."""
    servers = list(_UPSTREAM_SERVER.finditer(conf))
    assert servers, "gateway.conf has no upstream server lines"
    first = servers[0]
    lines = "".join(f"{first.group(1)}server {a}{first.group(2) or ''};\n" for a in upstreams)
    conf = conf[:first.start()] + lines + _UPSTREAM_SERVER.sub("", conf[first.end():])

    def listen_on(m: re.Match) -> str:
        return f"{m.group(1)}listen {listen[int(m.group(2))]}{m.group(3)};"

    conf, listens = _LISTEN.subn(listen_on, conf)
    assert listens == len(listen), "gateway.conf listens on other ports than expected"
    conf = conf.replace("/etc/nginx/edgespec/", f"{conf_dir}/")
    conf = conf.replace("access_log /dev/stdout", f"access_log {conf_dir}/access.log")
    return conf


class Gateway:
    def __init__(self, tmp: Path, upstreams: list[str]) -> None:
        self.tmp = tmp
        self.port, self.health_port = local_verifier.free_port(), local_verifier.free_port()
        self.address = f"127.0.0.1:{self.port}"
        (tmp / "gateway.conf").write_text(render_gateway_conf(
            GATEWAY_CONF.read_text(), upstreams,
            {8080: self.address, 8081: f"127.0.0.1:{self.health_port}"}, tmp))
        shutil.copy(GATEWAY_CONF.with_name("routes.conf"), tmp / "routes.conf")
        temp = "\n".join(f"    {name}_temp_path {tmp}/{name};" for name in
                         ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
        (tmp / "nginx.conf").write_text(f"""
daemon off;
worker_processes 1;
pid {tmp}/nginx.pid;
error_log {tmp}/error.log notice;
events {{ worker_connections 1024; }}
http {{
{temp}
    include {tmp}/gateway.conf;
}}
""")
        binary = nginx_binary()
        check = subprocess.run([binary, "-t", "-p", str(tmp), "-e", str(tmp / "error.log"),
                                "-c", str(tmp / "nginx.conf")], capture_output=True, text=True)
        assert check.returncode == 0, check.stderr
        self.proc = subprocess.Popen([binary, "-p", str(tmp), "-e", str(tmp / "error.log"),
                                      "-c", str(tmp / "nginx.conf")])
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, (tmp / "error.log").read_text()
            with contextlib.suppress(OSError):
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            time.sleep(0.05)
        raise AssertionError("nginx did not listen")

    def stop(self) -> None:
        local_verifier.stop(self.proc)


def _takes_drain_notice() -> bool:
    """Whether this verifier has the graceful drain of issue 18 item 2 (branch limits):
    health NOT_SERVING for --drain-notice seconds before the server stops."""
    import io

    from cloud_verifier.server import parse_args

    try:
        with contextlib.redirect_stderr(io.StringIO()):
            parse_args(["--drain-notice", "2"])
    except SystemExit:
        return False
    return True


DRAIN_NOTICE = _takes_drain_notice()


class Replica:
    """One verifier process with its Prometheus endpoint, on fixed ports across restarts."""

    def __init__(self, model: Path) -> None:
        self.model = model
        self.port, self.metrics_port = local_verifier.free_port(), local_verifier.free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.proc = self._spawn()

    def _spawn(self) -> subprocess.Popen:
        # One torch thread each: three replicas share this machine's cores with the fleet.
        return local_verifier.spawn(self.port, str(self.model), [
            "--metrics-port", str(self.metrics_port), "--grace", "5", "--threads", "1",
            *(["--drain-notice", "2"] if DRAIN_NOTICE else [])])

    def wait_serving(self) -> None:
        local_verifier.wait_serving(self.address, self.proc)

    def restart(self) -> None:
        self.proc = self._spawn()
        self.wait_serving()

    def kill9(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def metrics(self) -> dict[str, float]:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics",
                                    timeout=5) as reply:
            text = reply.read().decode()
        return {s.name: s.value for family in text_string_to_metric_families(text)
                for s in family.samples if not s.labels}

    def stop(self) -> None:
        local_verifier.stop(self.proc)


@pytest.fixture(scope="module")
def cluster(tiny_llama_pair, tmp_path_factory):
    replicas = [Replica(tiny_llama_pair.target_dir) for _ in range(REPLICAS)]
    gateway = None
    try:
        for r in replicas:
            r.wait_serving()
        gateway = Gateway(tmp_path_factory.mktemp("nginx"), [r.address for r in replicas])
        yield gateway, replicas
    finally:
        if gateway is not None:
            gateway.stop()
        for r in replicas:
            r.stop()


def counters(replicas: list[Replica], name: str) -> list[float]:
    return [r.metrics()[name] for r in replicas]


def test_render_replaces_only_upstreams_listeners_and_paths(tmp_path):
    shipped = GATEWAY_CONF.read_text()
    out = render_gateway_conf(shipped, ["127.0.0.1:1", "127.0.0.1:2"],
                              {8080: "127.0.0.1:3", 8081: "127.0.0.1:4"}, tmp_path)
    assert "cluster.local" not in out and "/etc/nginx" not in out
    assert "listen 127.0.0.1:3 http2;" in out and "listen 127.0.0.1:4;" in out
    assert re.findall(r"server (127\.0\.0\.1:\d) max_fails=1 fail_timeout=5s;", out) == [
        "127.0.0.1:1", "127.0.0.1:2"]
    strip = re.compile(r"^\s*(server \S+:\d+ [^;]*;|listen .*;|access_log .*;|include .*;)\n",
                       re.M)
    assert strip.sub("", out) == strip.sub("", shipped)


def test_the_gateway_image_configuration_passes_nginx_t(tmp_path):
    """The image's nginx.conf with every file of deploy/nginx (the TLS listener too, with a
    throwaway certificate) is what nginx accepts; only the k8s upstream names, which do not
    resolve here, become loopback ones."""
    conf_dir, tls = tmp_path / "edgespec", tmp_path / "tls"
    conf_dir.mkdir()
    tls.mkdir()
    made = subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes",
                           "-keyout", str(tls / "tls.key"), "-out", str(tls / "tls.crt"),
                           "-days", "1", "-subj", "/CN=gateway"], capture_output=True)
    assert made.returncode == 0, made.stderr
    upstreams = [f"127.0.0.1:{50051 + i}" for i in range(8)]
    (conf_dir / "gateway.conf").write_text(render_gateway_conf(
        GATEWAY_CONF.read_text(), upstreams, {8080: "127.0.0.1:8080", 8081: "127.0.0.1:8081"},
        conf_dir))
    for name in ("routes.conf", "tls.conf"):
        text = (GATEWAY_CONF.parent / name).read_text()
        (conf_dir / name).write_text(text.replace("/etc/nginx/edgespec/", f"{conf_dir}/")
                                     .replace("/etc/nginx/tls/", f"{tls}/"))
    main = (GATEWAY_CONF.parent / "nginx.conf").read_text().replace(
        "/tmp/", f"{tmp_path}/").replace("/etc/nginx/edgespec/", f"{conf_dir}/")
    assert "tls*.conf" in main and "gateway.conf" in main
    (tmp_path / "nginx.conf").write_text(main)
    check = subprocess.run([nginx_binary(), "-t", "-p", str(tmp_path), "-e",
                            str(tmp_path / "error.log"), "-c", str(tmp_path / "nginx.conf")],
                           capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
    assert "test is successful" in check.stderr


def test_the_gateway_answers_its_health_check(cluster):
    gateway, _ = cluster
    with urllib.request.urlopen(f"http://127.0.0.1:{gateway.health_port}/healthz",
                                timeout=5) as reply:
        assert reply.status == 200 and reply.read() == b"ok\n"


def test_generations_and_documents_stick_to_one_replica(cluster, tiny_llama_pair):
    """12 generations over 4 documents (3 successive IME sessions each, every prompt the
    previous one grown by part of its completion and newly typed tokens), one at a time:
    each one's rounds and tokens are counted on exactly one replica, each document's sessions
    on the same replica, whose prefix cache then serves the document's text."""
    gateway, replicas = cluster
    documents, sessions = 4, 3

    async def generate_once(client, prompt: list[int], key: str, tokens: int):
        """One generation routed by ``key``; the replica that served it, counted from the
        replicas' own metrics, and its tokens. Asserts no other replica saw any of it."""
        names = ("edgespec_verify_rounds_total", "edgespec_spec_decode_num_emitted_tokens_total",
                 "edgespec_prefix_cache_hits_total")
        before = [counters(replicas, n) for n in names]
        gen = client.generate(prompt, GenerationConfig(max_new_tokens=tokens, ignore_eos=True),
                              routing_key=key)
        async for _ in gen:
            pass
        assert len(gen.token_ids) == tokens
        d_rounds, d_emitted, d_hits = ([a - b for a, b in zip(counters(replicas, n), was,
                                                               strict=True)]
                                       for n, was in zip(names, before, strict=True))
        where = [i for i, n in enumerate(d_rounds) if n]
        assert len(where) == 1, (key, d_rounds)
        i = where[0]
        assert d_rounds[i] == gen.stats.rounds, (key, d_rounds, gen.stats)
        assert d_emitted == [tokens if j == i else 0 for j in range(REPLICAS)]
        return i, gen.token_ids, d_hits[i]

    async def run() -> tuple[dict[int, list[int]], list[int]]:
        placed: dict[int, list[int]] = {}
        async with AsyncEdgeClient(gateway.address, tiny_llama_pair.draft_dir,
                                   protocol="rounds") as client:
            for d in range(documents):
                key = document_routing_key(f"notes-{d}")
                prompt = [3 + (7 * d + i) % 90 for i in range(10)]
                for s in range(sessions):
                    i, tokens, hits = await generate_once(client, prompt, key, 8)
                    placed.setdefault(d, []).append(i)
                    if s:  # the previous session's prompt came from this replica's cache
                        assert hits >= len(prompt) - 5, (d, s, hits, len(prompt))
                    prompt = prompt + tokens[:2] + [3 + (d + s + j) % 90 for j in range(3)]
            # The ring spreads keys over replicas. Where it sends a key depends on the
            # replicas' (random) ports, so these four can share one replica (1 in 27 on an
            # even ring): then more keys, one token each, until one lands elsewhere. 20 of
            # them all on the same replica has odds under 1e-4 even if it held 60% of the ring.
            spread = [p[0] for p in placed.values()]
            for extra in range(20):
                if len(set(spread)) > 1:
                    break
                i, _, _ = await generate_once(client, [5, 6, 7],
                                              document_routing_key(f"spread-{extra}"), 1)
                spread.append(i)
        return placed, spread

    placed, spread = asyncio.run(run())
    assert all(len(set(p)) == 1 for p in placed.values()), placed
    assert len(set(spread)) > 1, spread


FLEET = {"clients": 6, "workload": "chat", "profile": "none", "chat_tokens": 24,
         "prompts": 6, "progress": False, "ramp_s": 0.5, "keep_outputs": True,
         "protocol": "rounds", "retry_budget_s": 60.0, "deadline_s": 20.0}


def fleet(address: str, draft_dir: Path, cache: Path, **kw) -> dict:
    config = FleetConfig(**(FLEET | kw))
    return asyncio.run(run_fleet_async(address, config, draft_dir, replay_cache=cache))


def completed_outputs(res: dict) -> dict[tuple[str, int], list[int]]:
    out: dict[tuple[str, int], list[int]] = {}
    for o in res["outputs"]:
        if o["completed"]:
            key = (o["prompt_key"], o["max_new_tokens"])
            assert out.setdefault(key, o["tokens"]) == o["tokens"]
    return out


@pytest.fixture(scope="module")
def reference(cluster, tiny_llama_pair, tmp_path_factory):
    """The target's greedy text for the fleet's prompts (a cloud-only Generate run), and the
    replayed drafts' book, recorded now so that the drills' windows start at once."""
    gateway, _ = cluster
    cache = tmp_path_factory.mktemp("replay") / "book.json"
    base = fleet(gateway.address, tiny_llama_pair.draft_dir, cache, mode="baseline",
                 duration_s=60.0, max_requests=1)
    assert base["aggregate"]["requests_failed"] == 0
    want = completed_outputs(base)
    spec = fleet(gateway.address, tiny_llama_pair.draft_dir, cache, duration_s=60.0,
                 max_requests=1, warm_up=False)
    check_fleet(spec, want)
    return want, cache


def check_fleet(res: dict, want: dict) -> None:
    a = res["aggregate"]
    assert a["requests_failed"] == 0 and a["requests_failed_by_status"] == {}, a
    got = completed_outputs(res)
    assert got, a
    assert all(got[k] == want[k] for k in got), "an output differs from the target's text"


PROBE_KEY = document_routing_key("kill-drill")
PROBE_PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]
PROBE_TOKENS = 100


async def probe_generation(address: str, draft_dir: Path, on_tokens=None):
    """One long greedy generation with a fixed routing key: (tokens, stats)."""
    async with AsyncEdgeClient(address, draft_dir, protocol="rounds",
                               retry=RetryPolicy(budget_s=60.0)) as client:
        gen = client.generate(PROBE_PROMPT, GenerationConfig(max_new_tokens=PROBE_TOKENS,
                                                             ignore_eos=True),
                              routing_key=PROBE_KEY)
        async for _ in gen:
            if on_tokens is not None:
                on_tokens(len(gen.token_ids))
        return gen.token_ids, gen.stats


def test_fleet_survives_kill_9_of_a_replica(cluster, reference, tiny_llama_pair):
    """A fleet (6 clients, 3 requests each) and one long generation run through the
    gateway; when the long one has 10 of its 100 tokens, its replica (found from the
    metrics of an undisturbed run) is killed with SIGKILL, along with whatever fleet
    sessions it holds."""
    gateway, replicas = cluster
    want, cache = reference
    rounds = "edgespec_verify_rounds_total"
    before = counters(replicas, rounds)
    probe_want, _ = asyncio.run(probe_generation(gateway.address, tiny_llama_pair.draft_dir))
    [victim] = [i for i, (a, b) in enumerate(zip(counters(replicas, rounds), before,
                                                 strict=True)) if a > b]
    before = counters(replicas, rounds)
    killed: list[int] = []

    def kill_at(n: int) -> None:
        if n >= 10 and not killed:
            killed.append(n)
            replicas[victim].kill9()

    async def drill():
        config = FleetConfig(**(FLEET | {"duration_s": 300.0, "max_requests": 3}))
        return await asyncio.gather(
            run_fleet_async(gateway.address, config, tiny_llama_pair.draft_dir, cache),
            probe_generation(gateway.address, tiny_llama_pair.draft_dir, kill_at))

    try:
        res, (probe_got, probe_stats) = asyncio.run(drill())
        after = [r.metrics()[rounds] if i != victim else 0.0 for i, r in enumerate(replicas)]
    finally:
        if replicas[victim].proc.poll() is not None:
            replicas[victim].restart()
    assert killed, "the long generation never reached its 10th token"
    # The long generation lost its stream, reopened on another replica, and finished with
    # the undisturbed run's tokens.
    assert probe_stats.reopens >= 1 and probe_stats.lost_attempts, probe_stats
    assert probe_got == probe_want
    check_fleet(res, want)
    assert res["aggregate"]["requests_completed"] == 18, res["aggregate"]
    survivors = [i for i in range(REPLICAS) if i != victim]
    assert sum(after[i] - before[i] for i in survivors) > 0




@pytest.mark.xfail(not DRAIN_NOTICE, strict=True,
                   reason="graceful drain (health NOT_SERVING observable before the server "
                          "stops, --drain-notice) is built on branch limits")
def test_rolling_restart_loses_nothing(cluster, reference, tiny_llama_pair):
    """SIGTERM each replica in turn while a fleet runs: its health turns NOT_SERVING and
    stays so (observed over at least 1 s of a 2 s drain notice), it drains and exits, and is
    started again before the next one goes. 0 failed requests, outputs unchanged."""
    gateway, replicas = cluster
    want, cache = reference
    # (first, last) time each replica was seen NOT_SERVING after its SIGTERM.
    seen: list[tuple[float, float] | None] = []
    failures: list[BaseException] = []
    not_serving = health_pb2.HealthCheckResponse.NOT_SERVING

    def roll() -> None:
        try:
            time.sleep(1.0)
            for r in replicas:
                times: list[float] = []
                with grpc.insecure_channel(r.address) as channel:
                    stub = health_pb2_grpc.HealthStub(channel)
                    r.proc.send_signal(signal.SIGTERM)
                    while r.proc.poll() is None:
                        with contextlib.suppress(grpc.RpcError):
                            if stub.Check(health_pb2.HealthCheckRequest(),
                                          timeout=0.5).status == not_serving:
                                times.append(time.monotonic())
                        time.sleep(0.05)
                seen.append((times[0], times[-1]) if times else None)
                r.restart()
        except BaseException as err:  # noqa: BLE001 - reported by the test below
            failures.append(err)

    roller = threading.Thread(target=roll)
    roller.start()
    try:
        res = fleet(gateway.address, tiny_llama_pair.draft_dir, cache, duration_s=120.0,
                    max_requests=6, retry_budget_s=90.0, think_ms=200.0)
    finally:
        roller.join()
    assert not failures, failures
    check_fleet(res, want)
    assert res["aggregate"]["requests_completed"] == 36, res["aggregate"]
    assert len(seen) == REPLICAS
    assert all(s is not None and s[1] - s[0] >= 1.0 for s in seen), seen
