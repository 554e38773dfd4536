"""``edgespec-healthcheck``: exit 0 when a verifier reports SERVING through grpc.health.v1.

Used as the container HEALTHCHECK; a draining or unreachable verifier exits 1. Against a
TLS port give ``--tls-ca`` (and, for mutual TLS, ``--tls-cert``/``--tls-key``); health needs
no API key.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import sys
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from shared.pb import verifier_pb2 as pb

# The edgespec service, as the verifier registers its health.
SERVICE = pb.DESCRIPTOR.services_by_name["VerifierService"].full_name


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="edgespec-healthcheck", description=__doc__)
    p.add_argument("--version", action="version",
                   version=f"edgespec {importlib.metadata.version('edgespec')}")
    p.add_argument("--address", default="127.0.0.1:50051")
    p.add_argument("--timeout", type=float, default=3.0)
    p.add_argument("--tls-ca", type=Path, default=None,
                   help="PEM CA of the verifier's certificate: check over TLS")
    p.add_argument("--tls-cert", type=Path, default=None, help="client certificate (mTLS)")
    p.add_argument("--tls-key", type=Path, default=None, help="key of --tls-cert")
    args = p.parse_args(argv)
    if (args.tls_cert is None) != (args.tls_key is None):
        p.error("--tls-cert and --tls-key go together")
    if args.tls_ca is None and args.tls_cert is None:
        channel = grpc.insecure_channel(args.address)
    else:
        def read(path: Path | None) -> bytes | None:
            return None if path is None else path.read_bytes()

        channel = grpc.secure_channel(args.address, grpc.ssl_channel_credentials(
            read(args.tls_ca), read(args.tls_key), read(args.tls_cert)))
    with channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=SERVICE), timeout=args.timeout)
        except grpc.RpcError as err:
            print(f"unhealthy: {err.code().name}: {err.details()}", file=sys.stderr)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(status)
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


if __name__ == "__main__":
    raise SystemExit(main())
