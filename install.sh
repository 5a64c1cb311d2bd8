#!/usr/bin/env bash
# Installs bertfast and its dependencies into the current Python environment.
#   bash install.sh          runtime dependencies + the package (builds the native CPU extension)
#   bash install.sh --demo   also the embedded default model and transformers (for `bertfast demo`)
#   bash install.sh --test   also the test/benchmark extras (transformers, onnxruntime, ...) and PyLate's side folder
# torch is chosen first: the CPU wheel when no NVIDIA GPU is present (never a multi-GB CUDA build),
# a CUDA build when one is.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
PIP="$PY -m pip install --disable-pip-version-check -q"
TORCH_VERSION=${BERTFAST_TORCH_VERSION:-2.13.0}

have_torch=$($PY -c 'import torch; print(torch.__version__)' 2>/dev/null || true)
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    if ! $PY -c 'import torch, sys; sys.exit(0 if torch.version.cuda else 1)' 2>/dev/null; then
        echo "[install] NVIDIA GPU found: installing CUDA torch==$TORCH_VERSION"
        $PIP "torch==$TORCH_VERSION"
    fi
elif [[ "$have_torch" != *cpu* && "$have_torch" != "$TORCH_VERSION"* ]] || [[ -z "$have_torch" ]]; then
    echo "[install] no NVIDIA GPU: installing the CPU build of torch==$TORCH_VERSION"
    # A local CPU wheel (pip's find-links) or the PyTorch CPU index; never PyPI's CUDA build.
    $PIP "torch==$TORCH_VERSION+cpu" 2>/dev/null \
        || $PIP "torch==$TORCH_VERSION" --index-url https://download.pytorch.org/whl/cpu
fi

$PIP setuptools wheel pybind11 numpy
extras=""
case "${1:-}" in
    --test) extras="[test]" ;;
    --demo) extras="[demo]" ;;
    "") ;;
    *) echo "usage: bash install.sh [--demo|--test]" >&2; exit 2 ;;
esac
echo "[install] building bertfast$extras (native CPU extension: a minute or two)"
$PIP --no-build-isolation -e ".$extras"
if [[ "$extras" == "[test]" ]]; then
    # PyLate 1.6 pins sentence-transformers 5.3.0 and the test extra asks >= 6.2: the two alone go to a side folder
    # that only tests/test_colbert.py's PyLate child puts first on its path (tests/helpers/pylate_side.py); the rest
    # (torch, transformers, ...) is this environment's: PyLate's metadata asks transformers <= 5.3.0 and runs with
    # 5.25 (the comparison is the check); its other pins (ujson, fastkmeans, fast-plaid) are for indexes, not imported.
    echo "[install] PyLate 1.6.0 and sentence-transformers 5.3.0 into .side/pylate (the ColBERT comparison's child)"
    rm -rf .side/pylate.new
    $PIP --no-deps --target .side/pylate.new "pylate==1.6.0" "sentence-transformers==5.3.0"
    rm -rf .side/pylate && mv .side/pylate.new .side/pylate
fi
$PY -c 'import bertfast, torch; print("[install] bertfast", bertfast.__version__, "torch", torch.__version__, "backends", bertfast.available_backends())'
