#!/usr/bin/env bash
# Fetches, on a machine with PyPI, the pinned wheels the verifier's engine imports beyond
# torch and transformers (its domain errors carry gRPC status codes), for CPython 3.10-3.13 on
# x86_64 Linux, into build/gpu-wheels/ (about 30 MB, git-ignored; GPU_WHEELS_DIR overrides).
# deploy/gpu-check.sh installs them, without any index, on a GPU machine that lacks them.
#
# --vllm: also vLLM's CUDA build (the version pyproject's `vllm` extra allows) with all that it
# needs, for one CPython (VLLM_PY_VERSION, default 3.12, the lent GPU machines'), into
# build/gpu-wheels/vllm/, for gpu-check.sh's vLLM half on a GPU machine without an index.
# Dependencies included: vLLM 0.32.0 pins torch 2.13.0 (a machine with another torch cannot
# use its own) and CUDA 13 kernel packages, so this is gigabytes, not megabytes (vLLM's own
# wheel is 326.5 MB), far over what a lent device machine takes along (docs/gpu.md).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
OUT="${GPU_WHEELS_DIR:-build/gpu-wheels}"
PINS=(grpcio==1.85.3 grpcio-status==1.85.1 protobuf==7.36.2 googleapis-common-protos==1.76.0
      typing-extensions==4.16.0)
VLLM_PIN=vllm==0.32.0
with_vllm=0
for arg in "$@"; do
    case "$arg" in
        --vllm) with_vllm=1 ;;
        *) echo "usage: $0 [--vllm]" >&2; exit 2 ;;
    esac
done
mkdir -p "$OUT"
for v in 3.10 3.11 3.12 3.13; do
    "$PY" -m pip download --quiet --no-deps --only-binary=:all: --dest "$OUT" \
        --python-version "$v" --implementation cp \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 "${PINS[@]}"
done
if [ "$with_vllm" = 1 ]; then
    # pip takes a foreign platform's tags literally (manylinux_2_28 does not imply 2_17), and
    # vLLM's dependencies are built against glibc 2.17 to 2.39: name every one.
    platforms=(--platform manylinux2014_x86_64 --platform linux_x86_64)
    for n in $(seq 17 39); do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
    mkdir -p "$OUT/vllm"
    "$PY" -m pip download --quiet --only-binary=:all: --dest "$OUT/vllm" \
        --python-version "${VLLM_PY_VERSION:-3.12}" --implementation cp "${platforms[@]}" \
        "$VLLM_PIN" "${PINS[@]}"
fi
ls -l "$OUT"
