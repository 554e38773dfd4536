"""Throwaway certificates for TLS tests, made with the openssl command line.

``make_pki(dir)`` writes a CA, a server certificate for localhost / 127.0.0.1 signed by it, a
client certificate signed by it, and a second, unrelated CA with a client certificate of its
own (what a device that is not ours would present) and a server certificate (what a rotated
server presents).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import NamedTuple

import pytest

_CURVE = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


class Pki(NamedTuple):
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    rogue_ca: Path
    rogue_client_cert: Path
    rogue_client_key: Path
    next_server_cert: Path
    next_server_key: Path


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)


def _ca(d: Path, name: str) -> tuple[Path, Path]:
    cert, key = d / f"{name}.pem", d / f"{name}.key"
    _openssl("req", "-x509", *_CURVE, "-keyout", str(key), "-out", str(cert), "-days", "2",
             "-subj", f"/CN={name}", "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    return cert, key


def _leaf(d: Path, name: str, ca: tuple[Path, Path], ext: str) -> tuple[Path, Path]:
    cert, key, csr, extfile = (d / f"{name}.pem", d / f"{name}.key", d / f"{name}.csr",
                               d / f"{name}.ext")
    extfile.write_text(ext + "\n")
    _openssl("req", *_CURVE, "-keyout", str(key), "-out", str(csr), "-subj", f"/CN={name}")
    _openssl("x509", "-req", "-in", str(csr), "-CA", str(ca[0]), "-CAkey", str(ca[1]),
             "-CAcreateserial", "-out", str(cert), "-days", "2", "-extfile", str(extfile))
    return cert, key


def make_pki(d: Path) -> Pki:
    if shutil.which("openssl") is None:  # CI must run these tests: fail there, skip here
        (pytest.fail if os.environ.get("CI") else pytest.skip)(
            "the openssl command is not installed")
    d.mkdir(parents=True, exist_ok=True)
    ca, rogue = _ca(d, "ca"), _ca(d, "rogue-ca")
    server = _leaf(d, "server", ca, "subjectAltName=DNS:localhost,IP:127.0.0.1\n"
                                    "extendedKeyUsage=serverAuth")
    client = _leaf(d, "device", ca, "extendedKeyUsage=clientAuth")
    rogue_client = _leaf(d, "rogue-device", rogue, "extendedKeyUsage=clientAuth")
    next_server = _leaf(d, "next-server", rogue, "subjectAltName=DNS:localhost,IP:127.0.0.1\n"
                                                 "extendedKeyUsage=serverAuth")
    return Pki(ca[0], *server, *client, rogue[0], *rogue_client, *next_server)
