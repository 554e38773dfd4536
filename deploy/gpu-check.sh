#!/usr/bin/env bash
# The one-command GPU check (docs/gpu.md): greedy identity on CUDA against the target alone,
# single-client and 1-64-client tokens/s, spec against baseline; writes JSON (--out FILE,
# default gpu-check.json). Needs only the machine's own torch and transformers (4.5x or
# 5.x); reaches no package registry. --cpu-smoke runs it on the CPU with a tiny model.
# Exits 1 if float32 identity or spec/baseline token equality fails; killed after 8 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python3}"
"$PY" -c 'import torch, transformers' 2>/dev/null || {
    echo "gpu-check: needs torch and transformers importable by $PY" >&2; exit 2; }
exec timeout --signal=TERM 480 "$PY" -m cloud_verifier.bench.gpu_check "$@"
