#!/usr/bin/env bash
# Fetches, on a machine with PyPI, the pinned wheels the verifier's engine imports beyond
# torch and transformers (its domain errors carry gRPC status codes), for CPython 3.10-3.13 on
# x86_64 Linux, into build/gpu-wheels/ (about 30 MB, git-ignored). deploy/gpu-check.sh
# installs them, without any index, on a GPU machine that lacks them.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
OUT=build/gpu-wheels
PINS=(grpcio==1.85.3 grpcio-status==1.85.1 protobuf==7.36.2 googleapis-common-protos==1.76.0
      typing-extensions==4.16.0)
mkdir -p "$OUT"
for v in 3.10 3.11 3.12 3.13; do
    "$PY" -m pip download --quiet --no-deps --only-binary=:all: --dest "$OUT" \
        --python-version "$v" --implementation cp \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 "${PINS[@]}"
done
ls -l "$OUT"
