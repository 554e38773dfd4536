"""Transport security of the API port: TLS, mutual TLS, and where plaintext is allowed.

Bearer keys, prompts and drafts cross this port, so plaintext is only for loopback: a
server asked to listen in the clear on any other address refuses to start unless the
operator says ``--insecure`` (for a TLS-terminating proxy on the same host or pod, say).
With ``client_ca`` the server asks every client for a certificate signed by that CA (mTLS)
and refuses the handshake without one.

Certificates rotate without a restart: ``ReloadableCredentials.reload`` (SIGHUP) re-reads the
three files, and every handshake after it uses them; open connections keep theirs.
"""

from __future__ import annotations

import ipaddress
import logging
import threading
from dataclasses import dataclass
from pathlib import Path

import grpc

log = logging.getLogger(__name__)

_LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost"})


class PlaintextRefused(ValueError):
    """Plaintext was asked for on an address other hosts can reach."""


@dataclass(frozen=True)
class ServerTls:
    cert: Path  # PEM certificate chain, leaf first
    key: Path  # PEM private key of the leaf
    client_ca: Path | None = None  # PEM CA bundle; set: clients must present a cert it signed

    def certificate_configuration(self):
        """The files' current contents, read now, so that a missing or unreadable file fails
        the start (or the reload), not a handshake."""
        chain = _read(self.cert, "--tls-cert")
        key = _read(self.key, "--tls-key")
        ca = None if self.client_ca is None else _read(self.client_ca, "--tls-client-ca")
        return grpc.ssl_server_certificate_configuration([(key, chain)], root_certificates=ca)


class ReloadableCredentials:
    """Server credentials whose certificates ``reload`` replaces for later handshakes."""

    def __init__(self, tls: ServerTls) -> None:
        self.tls = tls
        self._lock = threading.Lock()
        self._pending = None
        # gRPC asks the fetcher before each handshake; None keeps the current certificates.
        self.credentials = grpc.dynamic_ssl_server_credentials(
            tls.certificate_configuration(), self._fetch,
            require_client_authentication=tls.client_ca is not None)

    def reload(self) -> bool:
        try:
            config = self.tls.certificate_configuration()
        except ValueError as err:
            log.error("TLS certificates not reloaded, the current ones stay: %s", err)
            return False
        with self._lock:
            self._pending = config
        log.info("TLS certificates reloaded from %s", self.tls.cert)
        return True

    def _fetch(self):
        with self._lock:
            config, self._pending = self._pending, None
        return config


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
