#!/usr/bin/env bash
# Installs Infinity (PyPI: infinity-emb), the peer server of `benchmarks/bench_serve.py --peer`, in a venv of
# its own, so its older pins (numpy<2, transformers<5, ...) never touch the environment bertfast runs in.
# The venv sees the base interpreter's packages (--system-site-packages) and torch is pinned to the base's
# build: pip reuses the installed CPU torch instead of downloading a multi-GB CUDA one. Only the server and
# torch extras are installed: no optimum/ONNX, vision, audio or GPU bits (with transformers 4.57, optimum's
# BetterTransformer would refuse to load anyway; Infinity's torch engine runs sentence-transformers).
#
#   bash benchmarks/peer_infinity.sh [VENV_DIR]      # default ~/.venvs/bertfast-peer-infinity
#   python benchmarks/bench_serve.py --concurrency 1,32 --peer infinity=VENV_DIR/bin/infinity_emb
#
# Prints the infinity_emb executable's path last. Running it again refreshes the venv to the pins.
set -euo pipefail

venv=${1:-$HOME/.venvs/bertfast-peer-infinity}
python=${PYTHON:-python3}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

# Without an installed torch the pin below could not be met locally and pip would fetch torch from PyPI.
torch_version=$("$python" -c 'import torch; print(torch.__version__)') \
    || { echo "peer_infinity.sh: $python has no torch; install the CPU build first" >&2; exit 1; }
case "$torch_version" in
    *+cpu) ;;
    *) echo "peer_infinity.sh: warning: torch $torch_version is not a +cpu build" >&2 ;;
esac

"$python" -m venv --system-site-packages "$venv"
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
cat "$here/peer_infinity_constraints.txt" > "$constraints"
echo "torch==${torch_version%%+*}" >> "$constraints"   # matches the installed local build (2.13.0+cpu)

pip=("$venv/bin/python" -m pip --disable-pip-version-check)
# Dry run first: stop before anything is downloaded if the resolver wants a torch or CUDA wheel after all.
plan=$("${pip[@]}" install --dry-run -c "$constraints" 'infinity-emb[server,torch]' | grep '^Would install' || true)
if grep -qiE '(^| )(torch|triton|nvidia-[a-z0-9_-]+)-[0-9]' <<<"$plan"; then
    echo "peer_infinity.sh: pip would install a torch/CUDA wheel, refusing: $plan" >&2
    exit 1
fi
"${pip[@]}" install -c "$constraints" 'infinity-emb[server,torch]'

# The venv must run the base's torch, not a copy of its own.
"$venv/bin/python" -c "import torch, infinity_emb; assert torch.__version__ == '$torch_version', torch.__version__"
echo "$venv/bin/infinity_emb"
