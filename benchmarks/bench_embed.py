"""Texts/s for embedding a corpus, end to end (tokenization included), on the default all-MiniLM-L6-v2:
`SentenceTransformer.encode` on torch (fp32) and on its ONNX backend (fp32, and int8 by ONNX Runtime's
dynamic quantization), `Encoder.encode` and `bertfast embed` (reading, tokenizing, embedding, writing
Parquet shards; its peak RSS in its own process) in each of --dtypes (fp32, int8, bf16).

    python benchmarks/bench_embed.py [--texts 20000] [--rows st,onnx,encode,embed] [--dtypes fp32,int8,bf16]
                                     [--rounds 1] [--json benchmarks/results/embed-cpu/embed-20k.json] [--profile]

The corpus is deterministic (`corpus`: 1-60 words from a fixed vocabulary). Every row's output is checked
against SentenceTransformer.encode (torch, fp32) on the first SAMPLE texts, by the rule for its kind
(`RULES`), before its number counts: in-process rows before they are timed (the check is their warm-up),
`bertfast embed` on the first rows its timed run wrote. A row that fails the check stops the run. The ONNX
rows need optimum-onnx[onnxruntime] (`pip install "sentence-transformers[onnx]"`); where it is missing or
does not import they are skipped with the reason printed (optimum-onnx 0.1.0 requires transformers < 4.58).

--rounds N runs every row N times in turn (SentenceTransformer's first in each round) and divides each row by that
round's SentenceTransformer rate: on a host whose speed drifts between minutes (a shared VM) a ratio within a round
holds where one run's rows, minutes apart, do not. The table then gives each row's median over the rounds and the
range of its ratios; the JSON keeps every round's rows.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import inspect
import json
import os
import random
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench_peak, beside this file
WORDS = ("the a cat dog sat on mat quick brown fox jumps over lazy river mountain data engine vector search "
         "model token cafe naive 42 3.14 well-known e-mail, (brackets) question? yes! market bank rate "
         "bread recipe starter home kitchen city train station ticket weather forecast rain sunny").split()
SAMPLE = 200  # texts every row is checked on
BATCH = 32  # SentenceTransformer.encode's default, for the in-process rows
ST_ROW = "SentenceTransformer.encode (torch)"  # every ratio's base

# One rule per kind of row, against SentenceTransformer.encode (torch, fp32) on the sample. A row doing the
# same fp32 arithmetic agrees to rounding; ONNX Runtime's fused fp32 kernels add up in another order; bf16
# and int8 change the arithmetic, so they are held to each vector's direction (mean cosine).
RULES = {"fp32": ("max abs", 1e-5), "fp32 onnx": ("max abs", 1e-4),
         "bf16": ("mean cosine", 0.999), "int8": ("mean cosine", 0.99)}

# ONNX Runtime's dynamic-quantization preset for the widest integer dot products this CPU has.
ORT_INT8_CONFIG = (("avx512_vnni", "avx512_vnni"), ("avx512f", "avx512"), ("avx2", "avx2"))

# The command in a fresh process, then its own peak RSS (VmHWM starts over at exec, unlike ru_maxrss,
# which a forked child inherits from this process).
EMBED_AND_REPORT_PEAK = ("import sys; from bertfast.tools.cli import main; code = main(sys.argv[1:]); "
                         "print(next(l for l in open('/proc/self/status') if l.startswith('VmHWM'))); "
                         "sys.exit(code)")


def corpus(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 60))) for _ in range(n)]


def check(name: str, kind: str, got, ref) -> dict:
    """Prints how `got` agrees with the reference under RULES[kind]; exits with the numbers if it does not."""
    import numpy as np

    metric, bound = RULES[kind]
    got = np.asarray(got, dtype=np.float32)
    if got.shape != ref.shape:
        raise SystemExit(f"{name}: output shape {got.shape}, the reference's {ref.shape}")
    if metric == "max abs":
        value, op = float(np.abs(got - ref).max()), "<="
        ok = value <= bound
    else:
        cos = (got * ref).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(ref, axis=1))
        value, op = float(cos.mean()), ">="
        ok = value >= bound  # False for NaN as well
    shown = f"{value:.2g}" if metric == "max abs" else f"{value:.5f}"
    print(f"check {name:<40} {kind:<9} {metric} {shown} (needs {op} {bound:g})", flush=True)
    if not ok:
        raise SystemExit(f"{name} ({kind}) is wrong: {metric} {shown} vs SentenceTransformer.encode (torch) "
                         f"on the first {len(ref)} texts, needs {op} {bound:g}")
    return {metric: value}


def in_process_row(name: str, dtype: str, kind: str, encode, texts: list[str], ref) -> dict:
    checked = check(name, kind, encode(texts[:len(ref)]), ref)
    start = time.perf_counter()
    encode(texts)
    rate = len(texts) / (time.perf_counter() - start)
    print(f"rate  {name:<40} {dtype:<9} {rate:.1f} texts/s", flush=True)
    return {"name": name, "dtype": dtype, "texts_per_s": rate, "peak_rss_mib": None, "check": checked}


def st_torch(path: str, texts: list[str], timed: bool):
    """The reference every row is checked against (whether or not its own row is timed), and that row."""
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(path, device="cpu")
    ref = st.encode(texts[:SAMPLE], batch_size=BATCH)
    if not timed:
        return ref, []
    return ref, [in_process_row(ST_ROW, "fp32", "fp32",
                                lambda t: st.encode(t, batch_size=BATCH), texts, ref)]


def onnx_missing() -> str | None:
    """Why sentence-transformers' ONNX backend cannot run here, or None when it can."""
    import sentence_transformers
    import transformers

    if "backend" not in inspect.signature(sentence_transformers.SentenceTransformer.__init__).parameters:
        return f"sentence-transformers {sentence_transformers.__version__} has no backend= (needs >= 3.2)"
    try:
        import optimum.onnxruntime  # noqa: F401  (what backend="onnx" loads)
    except ImportError as e:
        return (f"needs optimum-onnx[onnxruntime] (pip install 'sentence-transformers[onnx]') built for "
                f"transformers {transformers.__version__}; import optimum.onnxruntime failed: {e}")
    return None


def onnx_rows(path: str, dtypes: list[str], texts: list[str], ref, tmp: str, cpu_flags) -> list[dict]:
    from sentence_transformers import SentenceTransformer, export_dynamic_quantized_onnx_model

    # A copy, so that the export and the quantized file land in a temporary directory, not site-packages.
    model_dir = shutil.copytree(path, os.path.join(tmp, "st-onnx"))
    st = SentenceTransformer(model_dir, device="cpu", backend="onnx")  # no onnx/model.onnx: exported on load
    rows = [in_process_row("SentenceTransformer.encode (onnx)", "fp32", "fp32 onnx",
                           lambda t: st.encode(t, batch_size=BATCH), texts, ref)]
    preset = next((p for flag, p in ORT_INT8_CONFIG if flag in cpu_flags), None)
    if "int8" in dtypes and preset is None:
        reason = f"no ONNX Runtime int8 preset here (needs one of {[f for f, _ in ORT_INT8_CONFIG]})"
        print(f"skip SentenceTransformer.encode (onnx int8): {reason}", flush=True)
        rows.append({"name": "SentenceTransformer.encode (onnx int8)", "dtype": "int8", "skipped": reason})
    elif "int8" in dtypes:
        export_dynamic_quantized_onnx_model(st, preset, model_dir, file_suffix=f"int8_{preset}")
        st = SentenceTransformer(model_dir, device="cpu", backend="onnx",
                                 model_kwargs={"file_name": f"onnx/model_int8_{preset}.onnx"})
        rows.append(in_process_row("SentenceTransformer.encode (onnx int8)", "int8", "int8",
                                   lambda t: st.encode(t, batch_size=BATCH), texts, ref))
        rows[-1]["ort_quantization"] = preset
    return rows


def child_env() -> dict:
    """The environment of a `bertfast embed` child: this checkout first on PYTHONPATH, the caller's entries after."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (ROOT, os.environ.get("PYTHONPATH"))))}


def embed_row(dtype: str, src: str, out: str, ref) -> dict:
    """`bertfast embed` in its own process; checked on the first rows of the Parquet shards it wrote."""
    import numpy as np
    import pyarrow.parquet as pq

    cmd = [sys.executable, "-c", EMBED_AND_REPORT_PEAK, "embed", src, out, "--dtype", dtype]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=child_env())
    if proc.returncode:
        raise SystemExit(f"bertfast embed --dtype {dtype} failed (exit {proc.returncode}):\n{proc.stderr}")
    rate = float(re.search(r"\(([\d.]+) texts/s", proc.stdout).group(1))
    peak = int(re.search(r"VmHWM:\s+(\d+) kB", proc.stdout).group(1)) / 1024
    first = pq.read_table(os.path.join(out, "part-00000.parquet")).slice(0, len(ref))  # shard 0: input order
    if first.column("id").to_pylist() != list(range(len(ref))):
        raise SystemExit(f"bertfast embed --dtype {dtype}: shard 0 does not start with rows 0..{len(ref) - 1}")
    got = first.column("embedding").combine_chunks().flatten().to_numpy().reshape(len(ref), -1)
    checked = check("bertfast embed", dtype, np.asarray(got), ref)
    print(f"rate  {'bertfast embed':<40} {dtype:<9} {rate:.1f} texts/s", flush=True)
    return {"name": "bertfast embed", "dtype": dtype, "texts_per_s": rate, "peak_rss_mib": peak, "check": checked}


# The instruction each dtype's GEMMs are built from, per tier (benchmarks/bench_peak.py's rows): their ceiling. The
# avx2 tier's int8 runs AVX-VNNI's vpdpbusd on ymm where the CPU has it ("avx2+vnni"), vpmaddwd otherwise; bf16
# without native dot products (avx2, or AVX-512 without AVX-512 BF16) is widened to fp32 FMAs. The amx tier's bf16
# and int8 GEMMs run on tiles (tdpbf16ps, tdpbssd).
CEILING_INSTRUCTIONS = {("fp32", "avx2"): "fp32 FMA ymm", ("fp32", None): "fp32 FMA zmm",
                        ("int8", "avx2"): "int16 madd ymm", ("int8", "avx2+vnni"): "int8 VNNI ymm",
                        ("int8", "amx"): "int8 AMX tile", ("int8", None): "int8 VNNI zmm",
                        ("bf16", "amx"): "bf16 AMX tile", ("bf16", None): "bf16 dot zmm"}


def gemm_ceiling(peak_rows: list[dict], dtype: str, info: dict) -> float | None:
    """GFLOP/s of the fastest all-thread row of the instruction `dtype`'s GEMMs use on the active tier (None if
    missing); info: `bertfast.cpu_info()` (the active tier, AVX-VNNI, native bf16)."""
    tier = info["active"]
    if dtype == "bf16" and not info.get("native_bf16", True):
        dtype = "fp32"
    if dtype == "int8" and tier == "avx2" and "avx_vnni" in info.get("flags", ()):
        tier = "avx2+vnni"
    name = CEILING_INSTRUCTIONS.get((dtype, tier), CEILING_INSTRUCTIONS.get((dtype, None)))
    rates = [r["ops_per_s"] for r in peak_rows if not r.get("missing") and r["instruction"].startswith(name)]
    return max(rates) / 1e9 if rates else None


def profile_row(dtype: str, src: str, out: str, info: dict, peak_rows: list[dict]) -> dict:
    """`bertfast embed --profile` in its own process (a run of its own: the timed rows run unprofiled); its
    breakdown printed with each GEMM's rate against this CPU's ceiling for the dtype."""
    from bertfast.profiling import format_table

    path = out + "-profile.json"
    cmd = [sys.executable, "-m", "bertfast", "embed", src, out, "--dtype", dtype, "--profile", path]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=child_env())
    if proc.returncode:
        raise SystemExit(f"bertfast embed --profile --dtype {dtype} failed (exit {proc.returncode}):\n{proc.stderr}")
    with open(path) as f:
        prof = json.load(f)
    ceiling = gemm_ceiling(peak_rows, dtype, info)
    print("\n" + format_table(prof, {"gemm": ceiling} if ceiling else None), flush=True)
    return {"dtype": dtype, "gemm_ceiling_gflops": ceiling, **prof}


def version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--texts", type=int, default=20000)
    parser.add_argument("--rows", default="st,onnx,encode,embed")
    parser.add_argument("--dtypes", default="fp32,int8,bf16")
    parser.add_argument("--rounds", type=int, default=1, help="every row this many times in turn (ratios per round)")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the rows and the machine here")
    parser.add_argument("--profile", action="store_true", help="then one `bertfast embed --profile` run per dtype: "
                        "where its time goes, each GEMM against this CPU's ceiling (benchmarks/bench_peak.py)")
    args = parser.parse_args()
    rows, dtypes = args.rows.split(","), args.dtypes.split(",")
    for value, known in ((rows, {"st", "onnx", "encode", "embed"}), (dtypes, {"fp32", "int8", "bf16"})):
        if set(value) - known:
            parser.error(f"unknown {sorted(set(value) - known)}: use some of {sorted(known)}")
    if args.texts < SAMPLE:
        parser.error(f"--texts must be >= {SAMPLE} (the rows are checked on the first {SAMPLE})")
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    import torch

    import bertfast

    path = bertfast.default_model_path()
    texts = corpus(args.texts)
    info = bertfast.cpu_info()
    print(f"cpu: {info['cpu']}, tier {info['active']}, torch threads {torch.get_num_threads()}, "
          f"load {os.getloadavg()[0]:.1f}; corpus {len(texts)} texts, "
          f"{sum(len(t.split()) for t in texts) / len(texts):.1f} words/text", flush=True)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(args.rounds):
            if args.rounds > 1:
                print(f"round {rnd + 1} of {args.rounds}", flush=True)
            round_tmp = os.path.join(tmp, f"round-{rnd}")
            os.makedirs(round_tmp)
            round_rows = one_round(path, texts, rows, dtypes, round_tmp, info)
            base = next((r["texts_per_s"] for r in round_rows if r["name"] == ST_ROW), None)
            for r in round_rows:
                r["round"] = rnd
                if "skipped" not in r:
                    r["ratio_vs_st_torch"] = r["texts_per_s"] / base if base else None
            results += round_rows
        profiles = []
        if args.profile:
            import bench_peak

            src = os.path.join(tmp, "corpus.txt")
            with open(src, "w", encoding="utf-8") as f:
                f.writelines(t + "\n" for t in texts)
            peak_rows = bench_peak.measure_best(0.3, 3)
            profiles = [profile_row(dtype, src, os.path.join(tmp, f"prof-{dtype}"), info, peak_rows)
                        for dtype in dtypes]
    print_table(results, args.rounds)
    own_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"\nthis process: peak RSS {own_peak:.0f} MiB")
    if args.json:
        from bertfast.tools.bench.report import environment

        env = environment("cpu")  # machine (cpu_info: the ISA tier the kernels ran), library versions
        env["versions"].update({d: version(d) for d in ("sentence-transformers", "optimum-onnx", "pyarrow")})
        report = {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **env,
                  "settings": {"texts": len(texts), "rows": rows, "dtypes": dtypes, "rounds": args.rounds,
                               "sample": SAMPLE, "batch_size": BATCH, "rules": RULES, "model_dir": path},
                  "rows": results, "profiles": profiles, "peak_rss_mib_this_process": own_peak}
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {args.json}")
    return 0


def one_round(path: str, texts: list[str], rows: list[str], dtypes: list[str], tmp: str, info: dict) -> list[dict]:
    """Every row once, each checked on the reference (SentenceTransformer's, timed as its row where asked)."""
    import bertfast

    ref, results = st_torch(path, texts, timed="st" in rows)
    if "onnx" in rows:
        reason = onnx_missing()
        if reason:
            print(f"skip SentenceTransformer.encode (onnx, onnx int8): {reason}", flush=True)
            skipped = [("onnx", "fp32")] + ([("onnx int8", "int8")] if "int8" in dtypes else [])
            results += [{"name": f"SentenceTransformer.encode ({label})", "dtype": dtype, "skipped": reason}
                        for label, dtype in skipped]
        else:
            results += onnx_rows(path, dtypes, texts, ref, tmp, info["flags"])
    if "encode" in rows:
        for dtype in dtypes:
            enc = bertfast.Encoder.from_pretrained(path, dtype=dtype)
            results.append(in_process_row("Encoder.encode", dtype, dtype, lambda t: enc.encode(
                t, batch_size=BATCH, convert_to_numpy=True), texts, ref))
            del enc
    if "embed" in rows:
        src = os.path.join(tmp, "corpus.txt")
        with open(src, "w", encoding="utf-8") as f:
            f.writelines(t + "\n" for t in texts)
        for dtype in dtypes:
            results.append(embed_row(dtype, src, os.path.join(tmp, f"out-{dtype}"), ref))
    return results


def print_table(results: list[dict], rounds: int) -> None:
    """Each row's texts/s (its median over the rounds) and its ratio to SentenceTransformer's (median, range)."""
    print(f"\n{'row':<48} {'dtype':<6} {'texts/s':>9} {'vs ST':>7} {'range':>13} {'peak RSS':>9}")
    keys = list(dict.fromkeys((r["name"], r["dtype"]) for r in results))
    for name, dtype in keys:
        runs = [r for r in results if (r["name"], r["dtype"]) == (name, dtype)]
        if any("skipped" in r for r in runs):
            print(f"{name:<48} {dtype:<6} skipped (reason above)")
            continue
        ratios = sorted(r["ratio_vs_st_torch"] for r in runs if r["ratio_vs_st_torch"] is not None)
        ratio = f"x{statistics.median(ratios):.2f}" if ratios else "-"
        spread = f"x{ratios[0]:.2f}-x{ratios[-1]:.2f}" if len(ratios) > 1 else ""
        peaks = [r["peak_rss_mib"] for r in runs if r["peak_rss_mib"]]
        peak = f"{max(peaks):.0f} MiB" if peaks else "-"
        rate = statistics.median(r["texts_per_s"] for r in runs)
        print(f"{name:<48} {dtype:<6} {rate:>9.1f} {ratio:>7} {spread:>13} {peak:>9}")
    if rounds > 1:
        print(f"(median of {rounds} rounds; range: the lowest and highest ratio of a round)")


if __name__ == "__main__":
    sys.exit(main())
