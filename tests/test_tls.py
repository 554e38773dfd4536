"""TLS and mutual TLS on the API port, and plaintext refused off loopback, on both ends.

Certificates are made per test session with the openssl command line (tests/tls_certs.py);
the verifier is the real one on a loopback port with the tiny target, and the client the
real edge client with the tiny ONNX draft.
"""

from __future__ import annotations

import asyncio
import shutil

import grpc
import pytest
from stream_helpers import PROMPT, reference_greedy
from tls_certs import Pki, make_pki

from cloud_verifier.config import VerifierConfig
from cloud_verifier.server import EmbeddedVerifier, VerifierServer, parse_args
from cloud_verifier.tls import PlaintextRefused, ServerTls, check_plaintext, is_loopback
from edge_client.client import EdgeClient, GenerationConfig
from edge_client.connection import ClientTls, Connection, is_loopback_address
from edge_client.connection import PlaintextRefused as ClientPlaintextRefused
from shared.pb import verifier_pb2 as pb
from shared.pb import verifier_pb2_grpc as pb_grpc


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def tls_verifier(target, pki):
    config = VerifierConfig(port=0, tls=ServerTls(pki.server_cert, pki.server_key))
    with EmbeddedVerifier(target, config) as v:
        yield v


@pytest.fixture(scope="module")
def mtls_verifier(target, pki):
    config = VerifierConfig(port=0, tls=ServerTls(pki.server_cert, pki.server_key,
                                                  client_ca=pki.ca))
    with EmbeddedVerifier(target, config) as v:
        yield v


def channel_creds(ca, cert=None, key=None) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        root_certificates=ca.read_bytes(), private_key=None if key is None else key.read_bytes(),
        certificate_chain=None if cert is None else cert.read_bytes())


def get_info(address: str, creds: grpc.ChannelCredentials | None) -> pb.GetInfoResponse:
    channel = (grpc.insecure_channel(address) if creds is None
               else grpc.secure_channel(address, creds))
    with channel:
        return pb_grpc.VerifierServiceStub(channel).GetInfo(pb.GetInfoRequest(), timeout=5)


def test_a_generation_over_tls_is_the_targets(tls_verifier, tiny_llama_pair, target, pki):
    want = reference_greedy(target, PROMPT, 12)
    with EdgeClient(tls_verifier.address, tiny_llama_pair.draft_dir,
                    tls=ClientTls(ca=pki.ca)) as client:
        gen = client.generate(PROMPT, GenerationConfig(max_new_tokens=12, ignore_eos=True))
        assert [t for chunk in gen for t in chunk] == want


def test_a_tls_port_refuses_plaintext_and_an_unknown_ca(tls_verifier, pki):
    assert get_info(tls_verifier.address, channel_creds(pki.ca)).protocol_version
    for creds in (None, channel_creds(pki.rogue_ca)):
        with pytest.raises(grpc.RpcError) as err:
            get_info(tls_verifier.address, creds)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_mtls_needs_a_client_certificate_from_its_ca(mtls_verifier, tiny_llama_pair, target,
                                                     pki):
    address = mtls_verifier.address
    for creds in (channel_creds(pki.ca),  # no client certificate
                  channel_creds(pki.ca, pki.rogue_client_cert, pki.rogue_client_key)):
        with pytest.raises(grpc.RpcError) as err:
            get_info(address, creds)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert get_info(address, channel_creds(pki.ca, pki.client_cert, pki.client_key)).vocab_size
    want = reference_greedy(target, PROMPT, 6)
    with EdgeClient(address, tiny_llama_pair.draft_dir, protocol="lookahead",
                    tls=ClientTls(pki.ca, pki.client_cert, pki.client_key)) as client:
        gen = client.generate(PROMPT, GenerationConfig(max_new_tokens=6, ignore_eos=True))
        assert [t for chunk in gen for t in chunk] == want


def test_cli_generate_over_mtls(mtls_verifier, tiny_llama_pair, pki, capsys):
    from edge_client.cli import main

    base = ["generate", "--server", mtls_verifier.address, "--draft-dir",
            str(tiny_llama_pair.draft_dir), "--prompt", "t5 t6 t7", "--raw",
            "--max-new-tokens", "4", "--retry-budget-s", "1"]
    assert main(base + ["--tls-ca", str(pki.ca), "--tls-cert", str(pki.client_cert),
                        "--tls-key", str(pki.client_key)]) == 0
    assert "4 tokens" in capsys.readouterr().err
    assert main(base + ["--tls-ca", str(pki.ca)]) == 2  # no client certificate
    assert "VerifierUnavailable" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="go together"):
        main(base + ["--tls-ca", str(pki.ca), "--tls-cert", str(pki.client_cert)])


def test_healthcheck_over_mtls(mtls_verifier, pki, capsys):
    from cloud_verifier.healthcheck import main as healthcheck

    address = ["--address", mtls_verifier.address]
    assert healthcheck(address + ["--tls-ca", str(pki.ca), "--tls-cert", str(pki.client_cert),
                                  "--tls-key", str(pki.client_key)]) == 0
    assert "SERVING" in capsys.readouterr().out
    assert healthcheck(address + ["--tls-ca", str(pki.ca)]) == 1  # no client certificate
    assert healthcheck(address) == 1  # plaintext


def test_certificates_rotate_without_a_restart(target, pki, tmp_path):
    """reload (what SIGHUP calls) swaps the certificate for new connections; a file that
    does not load keeps the current one."""
    cert, key = tmp_path / "server.pem", tmp_path / "server.key"
    shutil.copy(pki.server_cert, cert)
    shutil.copy(pki.server_key, key)
    with EmbeddedVerifier(target, VerifierConfig(port=0, tls=ServerTls(cert, key))) as v:
        assert get_info(v.address, channel_creds(pki.ca)).vocab_size
        cert.write_text("not a certificate")
        assert not v.server.reload()
        assert get_info(v.address, channel_creds(pki.ca)).vocab_size
        shutil.copy(pki.next_server_cert, cert)
        shutil.copy(pki.next_server_key, key)
        assert v.server.reload()
        assert get_info(v.address, channel_creds(pki.rogue_ca)).vocab_size
        with pytest.raises(grpc.RpcError) as err:
            get_info(v.address, channel_creds(pki.ca))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_the_server_refuses_plaintext_off_loopback(target, pki):
    for host in ("0.0.0.0", "::", "", "10.0.0.7", "verifier.example.com"):
        assert not is_loopback(host)
        with pytest.raises(PlaintextRefused, match="--insecure"):
            check_plaintext(host, None, insecure=False)
        check_plaintext(host, None, insecure=True)
        check_plaintext(host, ServerTls(pki.server_cert, pki.server_key), insecure=False)
    for host in ("127.0.0.1", "127.1.2.3", "::1", "[::1]", "localhost"):
        check_plaintext(host, None, insecure=False)
    with pytest.raises(PlaintextRefused):  # before any model work
        VerifierServer(target, VerifierConfig(host="0.0.0.0", port=0))


def test_the_command_line_refuses_plaintext_off_loopback(capsys, pki):
    with pytest.raises(SystemExit):
        parse_args(["--host", "0.0.0.0"])
    assert "refusing to serve plaintext on '0.0.0.0'" in capsys.readouterr().err
    _, config = parse_args(["--host", "0.0.0.0", "--insecure"])
    assert config.insecure and config.tls is None
    _, config = parse_args(["--host", "0.0.0.0", "--tls-cert", str(pki.server_cert),
                            "--tls-key", str(pki.server_key), "--tls-client-ca", str(pki.ca)])
    assert config.tls == ServerTls(pki.server_cert, pki.server_key, pki.ca)
    for bad, says in ((["--tls-cert", str(pki.server_cert)], "go together"),
                      (["--tls-cert", str(pki.server_key), "--tls-key", "/nonexistent"],
                       "--tls-key /nonexistent"),
                      (["--tls-cert", str(pki.ca.parent / "ca.srl"),
                        "--tls-key", str(pki.server_key)], "not a PEM file")):
        with pytest.raises(SystemExit):
            parse_args(bad)
        assert says in capsys.readouterr().err


def test_the_client_refuses_plaintext_off_loopback(pki):
    for address in ("127.0.0.1:50051", "localhost:50051", "[::1]:50051", "::1",
                    "dns:///localhost:50051", "unix:/tmp/verifier.sock",
                    "ipv4:127.0.0.1:50051,127.0.0.1:50052"):
        assert is_loopback_address(address), address
    for address in ("10.0.0.7:50051", "verifier:50051", "[2001:db8::1]:443",
                    "ipv4:127.0.0.1:50051,10.0.0.7:50051",
                    "dns:///verifier.example.com:443"):
        assert not is_loopback_address(address), address
        with pytest.raises(ClientPlaintextRefused, match="insecure"):
            Connection(address)
        # Channels connect lazily: building them reaches nothing. grpc.aio channels want an
        # event loop, which earlier tests' asyncio.run calls leave closed.
        async def build(address=address):
            for conn in (Connection(address, insecure=True),
                         Connection(address, tls=ClientTls(ca=pki.ca))):
                assert conn.address == address
                await conn.close()

        asyncio.run(build())
    with pytest.raises(ValueError, match="go together"):
        ClientTls(ca=pki.ca, cert=pki.client_cert)
