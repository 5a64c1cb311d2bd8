#!/usr/bin/env bash
# The GPU check in one command, for a machine with an NVIDIA GPU (e.g. a `device` run, which writes under $OUT):
#   bash benchmarks/gpu_check.sh [gpucheck options]        e.g. --quick, --stages bench --dtypes bf16
# Results: OUT/summary.json and OUT/<stage>.json (OUT: $OUT, else ./gpucheck-out).
#
# No install step: the GPU machine's python3 already has a CUDA torch, triton and transformers (and no network, so
# `install.sh` could not fetch the test extras). bertfast runs from this checkout (PYTHONPATH) without its native CPU
# extension, which only the cpu backend needs; TRITON_INTERPRET=0 so the kernels are compiled, never interpreted.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT_DIR=${OUT:-gpucheck-out}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
"$PY" -c 'import torch, triton, transformers; print("[gpu_check] torch", torch.__version__, "cuda", torch.version.cuda,
"available", torch.cuda.is_available(), "| triton", triton.__version__, "| transformers", transformers.__version__)' \
    || { echo "[gpu_check] python3 lacks torch, triton or transformers: install them first" >&2; exit 2; }
exec "$PY" -m bertfast gpucheck --out "$OUT_DIR" "$@"
