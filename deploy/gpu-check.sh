#!/usr/bin/env bash
# The one-command GPU check (docs/gpu.md), for both engines of the verifier, one after the
# other, each in its own process (cloud_verifier/bench/gpu_check.py): the built-in engine
# (greedy identity on CUDA against the target alone, single-client and 1-64-client tokens/s,
# spec against baseline), then vLLM (`--engine vllm`: the same rounds through the verifier's
# VllmEngine, identity against vLLM's own greedy generation, the same figures). Writes one
# JSON with both reports (--out FILE, default gpu-check.json) and each engine's log beside it
# (FILE less .json, plus -builtin.log, -vllm.log); --engines builtin (or vllm) runs one.
#
# Reaches no package registry. The built-in half uses the machine's own torch and
# transformers (4.5x or 5.x); the engine also imports grpcio and protobuf (its errors carry
# gRPC codes): if the machine lacks them they are installed, with no index, from the pinned
# wheels that deploy/fetch-gpu-wheels.sh put in build/gpu-wheels/ (GPU_WHEELS_DIR), into a
# throwaway venv that sees the system's packages. The vLLM half runs on VLLM_PYTHON if set,
# else on that Python if it imports vllm, else in a second such venv with vLLM installed, with
# no index, from build/gpu-wheels/vllm/ (fetch-gpu-wheels.sh --vllm); when none has a vLLM
# that starts, the built-in half's results stand and the report gives vLLM's reason.
#
# --cpu-smoke runs both on the CPU (the built-in engine on a tiny random model, vLLM on the
# prepared SmolLM2). Exit status: 0 every engine passed, 1 a check failed, 3 an engine could
# not run (vLLM missing, say) and nothing failed, 2 a usage or setup error. Each engine is
# killed after GPU_CHECK_BUILTIN_S (300) or GPU_CHECK_VLLM_S (240) seconds, so that the whole
# check fits in the ten minutes a lent device machine gives one command.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
SYSTEM_PY="${PYTHON:-python3}"
PY="$SYSTEM_PY"
WHEELS="${GPU_WHEELS_DIR:-build/gpu-wheels}"
GRPC=(grpcio grpcio-status protobuf googleapis-common-protos typing-extensions)
usage() {
    echo "usage: $0 [--out FILE] [--engines builtin,vllm] [--model DIR] [--cpu-smoke]" \
         "[--tensor-parallel-size N]" >&2
    exit 2
}
out=gpu-check.json
engines=(builtin vllm)
args=()
while [ $# -gt 0 ]; do
    case "$1" in
        --out) [ $# -ge 2 ] || usage; out="$2"; shift 2 ;;
        --engines) [ $# -ge 2 ] || usage; IFS=, read -r -a engines <<< "$2"; shift 2 ;;
        -h|--help) usage ;;
        *) args+=("$1"); shift ;;
    esac
done
for e in "${engines[@]}"; do
    case "$e" in builtin|vllm) ;; *) usage ;; esac
done
"$PY" -c 'import torch, transformers' 2>/dev/null || {
    echo "gpu-check: needs torch and transformers importable by $PY" >&2; exit 2; }
work="$(mktemp -d)"

# A venv over the system's packages, with PACKAGES installed from WHEEL_DIRS only.
offline_venv() {  # offline_venv DIR "WHEEL_DIR..." PACKAGE...
    local dir="$1" links=()
    for d in $2; do links+=(--find-links "$d"); done
    shift 2
    "$SYSTEM_PY" -m venv --system-site-packages "$dir"
    "$dir/bin/python" -m pip install --quiet --no-index "${links[@]}" "$@"
}

if ! "$PY" -c 'import grpc, grpc_status, google.protobuf, google.rpc' 2>/dev/null; then
    [ -d "$WHEELS" ] || {
        echo "gpu-check: grpcio/protobuf missing and no $WHEELS (run" \
             "deploy/fetch-gpu-wheels.sh where PyPI is reachable)" >&2; exit 2; }
    offline_venv "$work/venv" "$WHEELS" "${GRPC[@]}"
    PY="$work/venv/bin/python"
fi

# Prints the Python for the vLLM half. What goes wrong on the way is logged, not fatal: the
# vLLM half then reports the ImportError, with this log's tail.
vllm_python() {
    if [ -n "${VLLM_PYTHON:-}" ]; then echo "$VLLM_PYTHON"; return; fi
    if "$PY" -c 'import vllm' 2>/dev/null; then echo "$PY"; return; fi
    if [ -d "$WHEELS/vllm" ]; then
        echo "gpu-check: installing vLLM from $WHEELS/vllm (no index)" >&2
        if offline_venv "$work/venv-vllm" "$WHEELS/vllm $WHEELS" vllm "${GRPC[@]}" >&2; then
            echo "$work/venv-vllm/bin/python"; return
        fi
        echo "gpu-check: the offline install of vLLM failed" >&2
    else
        echo "gpu-check: $PY has no vllm, VLLM_PYTHON is unset and there is no" \
             "$WHEELS/vllm (deploy/fetch-gpu-wheels.sh --vllm)" >&2
    fi
    echo "$PY"
}

stem="${out%.json}"
for e in "${engines[@]}"; do
    : > "$work/$e.log"
    py="$PY"
    limit="${GPU_CHECK_BUILTIN_S:-300}"
    if [ "$e" = vllm ]; then
        py="$(vllm_python 2>>"$work/$e.log")"
        cat "$work/$e.log" >&2
        limit="${GPU_CHECK_VLLM_S:-240}"
    fi
    # Not set -e here: an engine that fails or is killed is a result, and the next one runs.
    set +e
    timeout --signal=TERM --kill-after=15 "$limit" "$py" -m cloud_verifier.bench.gpu_check \
        --engine "$e" --out "$work/$e.json" ${args[@]+"${args[@]}"} 2>&1 | tee -a "$work/$e.log"
    echo "${PIPESTATUS[0]}" > "$work/$e.rc"
    set -e
    cp "$work/$e.log" "$stem-$e.log"
done
exec "$PY" -m cloud_verifier.bench.gpu_check --combine "$work" --engines "${engines[@]}" \
    --out "$out"
