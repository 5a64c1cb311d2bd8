"""The stages of `bertfast gpucheck`, each run in a child process of its own (a CUDA error in one cannot poison the
next): `python -m bertfast.tools.gpucheck.stages STAGE RESULT.json [options]` runs one stage and writes its result,
a JSON object whose "status" is "pass", "fail" or "skip" (with a "reason"). The parent (`gpucheck.cli`) adds the
timing and the log. Stages: tests (pytest -m gpu), parity (`parity`), sweep (validate's op sweep on the triton
backend), sanitizer (compute-sanitizer memcheck and racecheck on small forwards), bench (`bertfast bench --device
cuda`), gemm (`gemm`: fused Triton GEMMs against cuBLAS per shape).
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

STAGES = ("tests", "parity", "sweep", "sanitizer", "bench", "gemm")
DEFAULT_STAGES = ("tests", "parity", "sweep", "sanitizer", "bench")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

# The bench grid: the workloads (ragged64 = lengths U[64, 512]); --quick keeps the launch-bound and the
# ragged cases, fp16, and the providers that build in seconds.
BENCH_WORKLOADS = "b1xs16,b1xs128,b8xs128,b32xs512,b32xs512-ragged64"
BENCH_QUICK_WORKLOADS = "b1xs16,b8xs128,b32xs512-ragged64"
BENCH_PROVIDERS = ("bertfast-triton,bertfast-triton-eager,bertfast-triton-fp8,hf-sdpa,hf-fa2,torch-varlen,"
                   "torch-compile,torch-compile-max,onnxruntime")
BENCH_QUICK_PROVIDERS = "bertfast-triton,bertfast-triton-eager,hf-sdpa"  # torch.compile takes minutes per shape


def gpu_test_files(tests_dir: str) -> list[str]:
    """The test modules that hold tests marked `gpu` (the other modules need not even import on the GPU machine)."""
    found = []
    for path in sorted(glob.glob(os.path.join(tests_dir, "test_*.py"))):
        with open(path, encoding="utf-8") as f:
            if "pytest.mark.gpu" in f.read():
                found.append(path)
    return found


def junit_counts(path: str) -> dict:
    """tests/failures/errors/skipped of a junit XML file, and the failing tests with the first line of why."""
    import xml.etree.ElementTree as ET

    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root)
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    failed = []
    for case in root.iter("testcase"):
        for bad in list(case.findall("failure")) + list(case.findall("error")):
            failed.append({"test": f"{case.get('classname')}::{case.get('name')}",
                           "message": (bad.get("message") or "")[:500]})
    return {**counts, "failed": failed}


def stage_tests(args) -> dict:
    tests_dir = os.path.join(REPO, "tests")
    if not os.path.isdir(tests_dir):
        return {"status": "skip", "reason": f"no tests/ directory at {REPO} (bertfast installed without its repo)"}
    files = gpu_test_files(tests_dir)
    if not files:
        return {"status": "skip", "reason": "no test module holds tests marked gpu"}
    with tempfile.TemporaryDirectory() as tmp:
        xml = os.path.join(tmp, "junit.xml")
        cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "-rfEs",
               f"--junitxml={xml}", *files]
        code = subprocess.call(cmd, cwd=REPO)
        counts = junit_counts(xml) if os.path.exists(xml) else {}
    ran = counts.get("tests", 0) - counts.get("skipped", 0)
    status = "pass" if code == 0 and ran > 0 else "fail"
    reason = "" if status == "pass" else (f"pytest exit code {code}" + ("; every test skipped" if not ran else ""))
    return {"status": status, "reason": reason, "files": [os.path.relpath(f, REPO) for f in files],
            "pytest_exit_code": code, **counts}


def stage_parity(args) -> dict:
    from bertfast.tools.gpucheck import parity

    dtypes = tuple(args.parity_dtypes.split(","))
    rows = parity.run_parity("cuda", "triton", dtypes, progress=lambda r: print(
        f"parity {r.family} {r.dtype} {r.mode} {r.batch}: {r.status} rel {r.rel_err} tol {r.tol} {r.note}",
        flush=True))
    summary = parity.summarize(rows)
    failed = summary["counts"]["FAIL"]
    return {"status": "fail" if failed else "pass", "reason": f"{failed} rows failed" if failed else "",
            **summary, "rows": [dataclasses.asdict(r) for r in rows]}


def stage_sweep(args) -> dict:
    from bertfast.backends import get_backend
    from bertfast.tools.validate.cli import format_table
    from bertfast.tools.validate.sweep import run_op_sweep

    import torch

    backend = get_backend("triton", "cuda")
    rows = run_op_sweep(backend, [torch.float32, torch.float16, torch.bfloat16], "cuda", quick=args.quick)
    print(format_table(rows), flush=True)
    counts = {s: sum(r.status == s for r in rows) for s in ("PASS", "FAIL", "SKIP")}
    return {"status": "fail" if counts["FAIL"] or not counts["PASS"] else "pass",
            "reason": f"{counts['FAIL']} checks failed" if counts["FAIL"] else "", "counts": counts,
            "failed": [dataclasses.asdict(r) for r in rows if r.status == "FAIL"],
            "rows": [dataclasses.asdict(r) for r in rows]}


def find_sanitizer() -> str | None:
    """compute-sanitizer on PATH, under CUDA_HOME, or in the usual install folders; None if none is found."""
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    homes = [os.environ.get(v) for v in ("CUDA_HOME", "CUDA_PATH")] + ["/usr/local/cuda"]
    candidates = [os.path.join(h, sub, "compute-sanitizer") for h in homes if h
                  for sub in ("bin", "compute-sanitizer")]
    candidates += sorted(glob.glob("/usr/local/cuda*/**/compute-sanitizer", recursive=True))
    candidates += sorted(glob.glob("/opt/nvidia/**/compute-sanitizer", recursive=True))
    return next((c for c in candidates if os.path.isfile(c) and os.access(c, os.X_OK)), None)


def sanitized_forward(families: list[str], dtype_name: str) -> None:
    """The program compute-sanitizer runs: one forward of each family's parity model and ragged batch, eager
    launches (every kernel launch a separate, checkable one)."""
    import torch

    from bertfast.encoder import Encoder
    from bertfast.tools.gpucheck import parity

    for family in families:
        model = parity.build_model(family).to("cuda")
        enc = Encoder.from_hf(model, backend="triton", dtype=parity.DTYPES[dtype_name], graphs=False)
        limit = enc.config.max_sequence_length
        inputs, _ = parity.make_inputs(model, parity.batch_lengths(limit)[0])
        out = enc(**inputs).last_hidden_state
        torch.cuda.synchronize()
        print(f"sanitized forward {family} {dtype_name}: finite={bool(torch.isfinite(out).all())}", flush=True)


SANITIZER_FAMILIES = ("bert", "mpnet", "modernbert")  # plain, relative bias, windows + rotary + gated
SANITIZER_TOOLS = ("memcheck", "racecheck")
_SUMMARY = re.compile(r"(ERROR SUMMARY: \d+ errors?|RACECHECK SUMMARY: [^\n]*)")


def stage_sanitizer(args) -> dict:
    exe = find_sanitizer()
    if exe is None:
        return {"status": "skip", "reason": "compute-sanitizer not found (PATH, CUDA_HOME, /usr/local/cuda*, "
                                            "/opt/nvidia)"}
    # Every allocation its own cudaMalloc, so an out-of-bounds access inside torch's cached blocks is seen too.
    env = dict(os.environ, PYTORCH_NO_CUDA_MEMORY_CACHING="1", TRITON_INTERPRET="0")
    program = [sys.executable, "-m", "bertfast.tools.gpucheck.stages", "sanitized-forward", "-",
               "--families", ",".join(SANITIZER_FAMILIES), "--dtype", "fp16"]
    results = {}
    for tool in SANITIZER_TOOLS:
        cmd = [exe, "--tool", tool, "--error-exitcode", "9", "--print-limit", "20", *program]
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
        text = proc.stdout + proc.stderr
        print(text[-20000:], flush=True)
        results[tool] = {"exit_code": proc.returncode, "summary": _SUMMARY.findall(text),
                         "clean": proc.returncode == 0, "tail": text[-3000:]}
    bad = [t for t, r in results.items() if not r["clean"]]
    return {"status": "fail" if bad else "pass", "reason": f"not clean: {', '.join(bad)}" if bad else "",
            "sanitizer": exe, "families": list(SANITIZER_FAMILIES), "dtype": "fp16", "tools": results}


def bench_settings(args) -> dict:
    """The bench grid of this run (the defaults, --quick's, or the options), checked: ValueError for a bad name."""
    from bertfast.tools.bench.providers import DTYPES, factory_of
    from bertfast.tools.workloads import Workload

    settings = {"config": args.config,
                "workloads": args.workloads or (BENCH_QUICK_WORKLOADS if args.quick else BENCH_WORKLOADS),
                "providers": args.providers or (BENCH_QUICK_PROVIDERS if args.quick else BENCH_PROVIDERS),
                "dtypes": args.dtypes or ("fp16" if args.quick else "fp16,bf16"),
                "repeats": args.repeats or (10 if args.quick else 30), "budget_s": 15.0 if args.quick else 30.0}
    for key in ("workloads", "providers", "dtypes"):
        settings[key] = [t.strip() for t in settings[key].split(",") if t.strip()]
    for w in settings["workloads"]:
        Workload.parse(w)
    for p in settings["providers"]:
        factory_of(p)
    bad = [d for d in settings["dtypes"] if d not in DTYPES]
    if bad:
        raise ValueError(f"unknown dtype {', '.join(bad)}; use {', '.join(DTYPES)}")
    return settings


def _bench_table(rows) -> list[dict]:
    return [{k: getattr(r, k) for k in ("workload", "dtype", "provider", "status", "ms_median", "ms_p90",
                                        "speedup_vs_hf_sdpa", "max_abs_err", "reason")} for r in rows]


def stage_bench(args, device: str = "cuda") -> dict:
    """`bertfast bench --device cuda` one workload at a time, all providers in this process, no settle pause (a GPU
    shares no thread pool); the result file is rewritten after each workload, so a stage cut at its budget keeps the
    workloads it finished. (device: "cpu" only for the tests' dry run.)"""
    from bertfast.tools.bench import report
    from bertfast.tools.bench.runner import run_bench
    from bertfast.tools.bench.source import load_source
    from bertfast.tools.workloads import Workload

    try:
        settings = bench_settings(args)
    except ValueError as e:
        return {"status": "fail", "reason": f"bad bench settings: {e}"}
    source = load_source(config_name=settings["config"], device=device)
    rows = []
    result = {"status": "running", "settings": settings, "environment": report.environment(device)}
    for name in settings["workloads"]:
        rows += run_bench(source, [Workload.parse(name)], settings["dtypes"], settings["providers"],
                          repeats=settings["repeats"], budget_s=settings["budget_s"], settle_s=0.0,
                          isolation="none", progress=sys.stderr)
        result.update(table=_bench_table(rows), rows=[dataclasses.asdict(r) for r in rows])
        if getattr(args, "result", "-") != "-":
            with open(args.result, "w") as f:
                json.dump(result, f, indent=1, default=str)
    print(report.format_table(rows), flush=True)
    errors = [r for r in rows if r.status == "error"]
    result.update(status="fail" if errors else "pass",
                  reason=f"{len(errors)} rows failed validation or crashed" if errors else "")
    return result


def stage_gemm(args) -> dict:
    from bertfast.tools.gpucheck import gemm

    return gemm.run_stage(quick=args.quick, config_name=args.config)


RUNNERS = {"tests": stage_tests, "parity": stage_parity, "sweep": stage_sweep, "sanitizer": stage_sanitizer,
           "bench": stage_bench, "gemm": stage_gemm}


def add_stage_options(parser) -> None:
    """The options the parent passes through to the stages (also `gpucheck`'s own)."""
    parser.add_argument("--quick", action="store_true", help="the smaller grids (op sweep, bench)")
    parser.add_argument("--config", default="bert-base", help="bench: random-weight model (default bert-base)")
    parser.add_argument("--workloads", help=f"bench: workloads (default {BENCH_WORKLOADS}; --quick "
                        f"{BENCH_QUICK_WORKLOADS})")
    parser.add_argument("--providers", help=f"bench: providers (default {BENCH_PROVIDERS}; --quick "
                        f"{BENCH_QUICK_PROVIDERS})")
    parser.add_argument("--dtypes", help="bench: dtypes (default fp16,bf16; --quick fp16)")
    parser.add_argument("--repeats", type=int, help="bench: timed rounds per row (default 30; --quick 10)")
    parser.add_argument("--parity-dtypes", default="fp32,fp16,bf16", help="parity: dtypes (default fp32,fp16,bf16)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bertfast.tools.gpucheck.stages")
    parser.add_argument("stage", choices=STAGES + ("sanitized-forward",))
    parser.add_argument("result", help="where to write the stage's JSON result ('-' for none)")
    parser.add_argument("--families", default=",".join(SANITIZER_FAMILIES))
    parser.add_argument("--dtype", default="fp16")
    add_stage_options(parser)
    args = parser.parse_args(argv)
    if args.stage == "sanitized-forward":
        sanitized_forward(args.families.split(","), args.dtype)
        return 0
    result = RUNNERS[args.stage](args)
    with open(args.result, "w") as f:
        json.dump(result, f, indent=1, default=str)
    return 0 if result["status"] in ("pass", "skip") else 1


if __name__ == "__main__":
    sys.exit(main())
