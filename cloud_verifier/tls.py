"""Transport security of the API port: TLS, mutual TLS, and where plaintext is allowed.

Bearer keys, prompts and drafts cross this port, so plaintext is only for loopback: a
server asked to listen in the clear on any other address refuses to start unless the
operator says ``--insecure`` (for a TLS-terminating proxy on the same host or pod, say).
With ``client_ca`` the server asks every client for a certificate signed by that CA (mTLS)
and refuses the handshake without one.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from pathlib import Path

import grpc

_LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost"})


class PlaintextRefused(ValueError):
    """Plaintext was asked for on an address other hosts can reach."""


@dataclass(frozen=True)
class ServerTls:
    cert: Path  # PEM certificate chain, leaf first
    key: Path  # PEM private key of the leaf
    client_ca: Path | None = None  # PEM CA bundle; set: clients must present a cert it signed

    def credentials(self) -> grpc.ServerCredentials:
        """Read now, so that a missing or unreadable file fails the start, not a handshake."""
        chain = _read(self.cert, "--tls-cert")
        key = _read(self.key, "--tls-key")
        ca = None if self.client_ca is None else _read(self.client_ca, "--tls-client-ca")
        return grpc.ssl_server_credentials([(key, chain)], root_certificates=ca,
                                           require_client_auth=ca is not None)


def _read(path: Path, flag: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as err:
        raise ValueError(f"{flag} {path}: {err.strerror}") from err
    if b"-----BEGIN" not in data:
        raise ValueError(f"{flag} {path} is not a PEM file")
    return data


def is_loopback(host: str) -> bool:
    """True for names and addresses only this machine can reach (127.0.0.0/8, ::1,
    localhost); False for wildcards (0.0.0.0, ::, empty) and everything else."""
    host = host.strip().strip("[]").lower()
    if host in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # another name: it may resolve anywhere


def check_plaintext(host: str, tls: ServerTls | None, insecure: bool) -> None:
    """Raises PlaintextRefused when the server would listen in the clear off loopback."""
    if tls is None and not insecure and not is_loopback(host):
        raise PlaintextRefused(
            f"refusing to serve plaintext on {host!r}, which other machines can reach: API "
            "keys, prompts and drafts would travel in the clear. Give --tls-cert and "
            "--tls-key (and --tls-client-ca for mutual TLS), bind a loopback address, or "
            "pass --insecure if a proxy on this host terminates TLS")
