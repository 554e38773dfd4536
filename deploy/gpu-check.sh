#!/usr/bin/env bash
# The one-command GPU check (docs/gpu.md): greedy identity on CUDA against the target alone,
# single-client and 1-64-client tokens/s, spec against baseline; writes JSON (--out FILE,
# default gpu-check.json). Uses the machine's own torch and transformers (4.5x or 5.x) and
# reaches no package registry. The engine also imports grpcio and protobuf (its errors carry
# gRPC codes): if the machine lacks them they are installed, with no index, from the pinned
# wheels that deploy/fetch-gpu-wheels.sh put in build/gpu-wheels/, into a throwaway venv that
# sees the system's packages. --cpu-smoke runs it on the CPU with a tiny model.
# Exits 1 if float32 identity fails; killed after 8 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python3}"
"$PY" -c 'import torch, transformers' 2>/dev/null || {
    echo "gpu-check: needs torch and transformers importable by $PY" >&2; exit 2; }
if ! "$PY" -c 'import grpc, grpc_status, google.protobuf, google.rpc' 2>/dev/null; then
    [ -d build/gpu-wheels ] || {
        echo "gpu-check: grpcio/protobuf missing and no build/gpu-wheels (run" \
             "deploy/fetch-gpu-wheels.sh where PyPI is reachable)" >&2; exit 2; }
    venv="$(mktemp -d)/venv"
    "$PY" -m venv --system-site-packages "$venv"
    "$venv/bin/python" -m pip install --quiet --no-index --find-links build/gpu-wheels \
        grpcio grpcio-status protobuf googleapis-common-protos typing-extensions
    PY="$venv/bin/python"
fi
exec timeout --signal=TERM 480 "$PY" -m cloud_verifier.bench.gpu_check "$@"
