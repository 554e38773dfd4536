"""API keys: the key file format, tenants, reload on SIGHUP of a live server process, what
needs a key on the API port, and that neither logs nor metrics carry keys or text."""

from __future__ import annotations

import http.client
import logging
import os
import signal
import socket
import time
import urllib.error
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from stream_helpers import (
    PROMPT,
    SessionCall,
    error_of,
    open_message,
    reference_greedy,
    verify_message,
)

from cloud_verifier.auth import (
    ANONYMOUS,
    ENV_VAR,
    KeyFileError,
    KeyRing,
    default_tenant,
    parse_entries,
    parse_env,
    read_key_file,
)
from cloud_verifier.config import VerifierConfig, key_digest
from cloud_verifier.server import EmbeddedVerifier, parse_args
from edge_client import local_verifier
from edge_client.client import EdgeClient, GenerationConfig
from shared import errors
from shared.pb import verifier_pb2 as pb
from shared.pb import verifier_pb2_grpc as pb_grpc

SECRET = "sk-test-4f1c9a7e2b6d4e0f8a3c5b7d9e1f2a4c"  # a key that must never be written anywhere


def bearer(key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


# -- the key file -----------------------------------------------------------------------------

def test_key_entries_name_tenants_and_skip_comments():
    keys = parse_entries(["# key  tenant", "", "k-one-0123456789ab  acme",
                          "  k-two-0123456789ab acme ", "k-three-0123456789"], "keys.txt")
    assert keys == {key_digest("k-one-0123456789ab"): "acme",
                    key_digest("k-two-0123456789ab"): "acme",
                    key_digest("k-three-0123456789"): default_tenant(
                        key_digest("k-three-0123456789"))}
    assert default_tenant(key_digest("x")).startswith("key-") and \
        len(default_tenant(key_digest("x"))) == 16
    assert parse_env(f"{SECRET} acme,k-two-0123456789ab\nk-3-0123456789abcd") == {
        key_digest(SECRET): "acme", key_digest("k-two-0123456789ab"): default_tenant(
            key_digest("k-two-0123456789ab")),
        key_digest("k-3-0123456789abcd"): default_tenant(key_digest("k-3-0123456789abcd"))}


@pytest.mark.parametrize("lines, says", [
    ([f"{SECRET} acme extra"], "got 3 fields"),
    ([f"{SECRET} bad/name"], "a tenant name is"),
    ([f"{SECRET} acme", f"{SECRET} other"], "two tenants"),
])
def test_bad_key_entries_are_refused_without_quoting_the_key(lines, says):
    with pytest.raises(KeyFileError, match=says) as err:
        parse_entries(lines, "keys.txt")
    assert SECRET not in str(err.value)


def test_an_empty_or_missing_key_file_is_refused(tmp_path, capsys):
    empty = tmp_path / "keys.txt"
    empty.write_text("# no keys yet\n")
    for path, says in ((empty, "holds no keys"), (tmp_path / "none.txt", "cannot read")):
        with pytest.raises(KeyFileError, match=says):
            read_key_file(path)
        with pytest.raises(SystemExit):
            parse_args(["--api-keys-file", str(path)])
        assert says in capsys.readouterr().err


def test_keys_from_the_environment(monkeypatch):
    monkeypatch.setenv(ENV_VAR, f"{SECRET} acme")
    _, config = parse_args([])
    assert config.api_keys == ((key_digest(SECRET), "acme"),)
    assert SECRET not in repr(config)


def test_a_reload_swaps_keys_and_keeps_them_on_a_bad_file(tmp_path, caplog):
    path = tmp_path / "keys.txt"
    path.write_text("old-key-0123456789 acme\n")
    ring = KeyRing({key_digest("static-0123456789a"): "ops"}, path)
    old = ring.authenticate(bearer("old-key-0123456789"))
    assert old.tenant == "acme" and ring.authenticate(bearer("static-0123456789a")).tenant == "ops"
    path.write_text("new-key-0123456789 acme\n")
    assert ring.reload() and ring.version == 1
    assert not ring.still_valid(old)
    assert ring.authenticate(bearer("new-key-0123456789")).tenant == "acme"
    assert ring.authenticate(bearer("static-0123456789a")).tenant == "ops"  # env keys stay
    path.write_text("")  # a half-written file must not lock everyone out
    with caplog.at_level(logging.ERROR):
        assert not ring.reload()
    assert "not reloaded" in caplog.text and ring.version == 1
    assert ring.authenticate(bearer("new-key-0123456789")).tenant == "acme"
    assert KeyRing().authenticate(None).tenant == ANONYMOUS


# -- what needs a key -------------------------------------------------------------------------

def test_reflection_needs_a_key_and_health_does_not(target):
    config = VerifierConfig(port=0, api_keys=((key_digest(SECRET), "acme"),))
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    with EmbeddedVerifier(target, config) as server, \
            grpc.insecure_channel(server.address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        err = error_of(lambda: list(stub.ServerReflectionInfo(iter([request]), timeout=10)))
        assert (err.code, err.reason) == (grpc.StatusCode.UNAUTHENTICATED,
                                          errors.UNAUTHENTICATED)
        replies = list(stub.ServerReflectionInfo(iter([request]), metadata=bearer(SECRET),
                                                 timeout=10))
        names = {s.name for s in replies[0].list_services_response.service}
        assert "edgespec.v1.VerifierService" in names
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                           timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING


def test_logs_and_metrics_carry_no_key_and_no_text(target, tiny_llama_pair, caplog):
    """A generation from text with a key, a refused call with another key; then neither the
    captured logs (every logger, DEBUG) nor /metrics holds the keys, their digests, the
    prompt text or its token ids. /metrics listens on loopback, and not on the API port."""
    prompt_text = "t71 t33 t58 t19 t44 t86"
    wrong = "sk-wrong-9d8c7b6a5f4e3d2c1b0a9f8e7d6c"
    config = VerifierConfig(port=0, api_keys=((key_digest(SECRET), "acme"),), metrics_port=0)
    with caplog.at_level(logging.DEBUG), EmbeddedVerifier(target, config) as server:
        with EdgeClient(server.address, tiny_llama_pair.draft_dir, api_key=SECRET) as client:
            gen = client.generate(prompt_text, GenerationConfig(max_new_tokens=8,
                                                                ignore_eos=True), chat=False)
            assert len([t for chunk in gen for t in chunk]) == 8
            prompt_ids = gen.prompt_ids
        with grpc.insecure_channel(server.address) as channel:
            err = error_of(pb_grpc.VerifierServiceStub(channel).GetInfo, pb.GetInfoRequest(),
                           metadata=bearer(wrong))
            assert err.reason == errors.UNAUTHENTICATED and wrong not in err.message
        host, port = server.server.metrics._http.server_address[:2]
        assert host == "127.0.0.1" and port == server.server.metrics_port
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
        with pytest.raises((http.client.HTTPException, urllib.error.URLError, OSError)):
            urllib.request.urlopen(f"http://{server.address}/metrics", timeout=10).read()
    logs = caplog.text + "\n".join(str(r.args) for r in caplog.records)
    assert "session" in logs and "verifier serving" in logs  # the capture did capture
    assert b"edgespec_verify_rounds_total" in metrics
    for secret in (SECRET, wrong, key_digest(SECRET), key_digest(wrong), prompt_text,
                   str(prompt_ids)[1:-1], ",".join(map(str, prompt_ids))):
        assert secret not in logs, secret
        assert secret.encode() not in metrics, secret


# -- SIGHUP on a live server process ----------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _info_error(address: str, key: str) -> str | None:
    """The reason GetInfo with ``key`` fails with, None when it answers."""
    with grpc.insecure_channel(address) as channel:
        try:
            pb_grpc.VerifierServiceStub(channel).GetInfo(pb.GetInfoRequest(),
                                                         metadata=bearer(key), timeout=10)
        except grpc.RpcError as err:
            return errors.details_of(err).reason
    return None


def test_sighup_reloads_keys_in_a_live_process(tiny_llama_pair, target, tmp_path,
                                               monkeypatch):
    """Keys: keep (stays), old (removed), new (added), env (from the environment). After
    SIGHUP old is refused and its open stream ends UNAUTHENTICATED at its next reply; new is
    accepted; keep's open session goes on with the target's tokens."""
    keys = tmp_path / "keys.txt"
    keys.write_text("keep-key-0123456789 acme\nold-key-0123456789a beta\n")
    monkeypatch.setenv(ENV_VAR, "env-key-0123456789a ops")
    port = _free_port()
    address = f"127.0.0.1:{port}"
    proc = local_verifier.spawn(port, str(tiny_llama_pair.target_dir),
                                ["--api-keys-file", str(keys)])
    try:
        local_verifier.wait_serving(address, proc, timeout_s=120)
        assert _info_error(address, "new-key-0123456789a") == errors.UNAUTHENTICATED
        assert _info_error(address, "old-key-0123456789a") is None
        want = reference_greedy(target, PROMPT, 2)
        with grpc.insecure_channel(address) as channel:
            stub = pb_grpc.VerifierServiceStub(channel)
            kept = SessionCall(stub, open_message(), metadata=bearer("keep-key-0123456789"))
            revoked = SessionCall(stub, open_message(), metadata=bearer("old-key-0123456789a"))
            try:
                assert list(kept.step().token_ids) == want[:1]
                assert list(revoked.step().token_ids) == want[:1]
                keys.write_text("keep-key-0123456789 acme\nnew-key-0123456789a beta\n")
                os.kill(proc.pid, signal.SIGHUP)
                deadline = time.monotonic() + 60
                while _info_error(address, "old-key-0123456789a") is None:
                    assert time.monotonic() < deadline, "the keys were not reloaded"
                    time.sleep(0.1)
                assert proc.poll() is None  # reloaded, not restarted
                assert _info_error(address, "old-key-0123456789a") == errors.UNAUTHENTICATED
                assert _info_error(address, "new-key-0123456789a") is None
                assert _info_error(address, "env-key-0123456789a") is None
                assert list(kept.send(verify_message(1)).step().token_ids) == want[1:2]
                revoked.send(verify_message(1))
                err = error_of(revoked.rest)
                assert (err.code, err.reason) == (grpc.StatusCode.UNAUTHENTICATED,
                                                  errors.UNAUTHENTICATED)
            finally:
                kept.cancel()
                revoked.cancel()
    finally:
        local_verifier.stop(proc)
