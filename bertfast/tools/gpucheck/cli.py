"""`bertfast gpucheck`: the GPU engine checked on a real GPU in one command.

Runs the selected stages (`stages.STAGES`) one after another, each in a child process of its own with a time budget
(a stage past it is killed and fails; a stage's failure never stops the next), writes each stage's result to
OUT/<stage>.json and, after every stage, OUT/summary.json (versions, GPU, per-stage status and seconds), so a run
cut short still leaves what it did. Exits 0 when every stage passed or was skipped with its reason, 1 when one
failed, 2 on bad usage or where there is no CUDA device (nothing is run then; the summary says so).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time

from bertfast.tools.gpucheck.stages import DEFAULT_STAGES, REPO, STAGES, add_stage_options, find_sanitizer

# Seconds each stage may take (capped by what --deadline leaves): --quick fits ~8 minutes on an H100, a full stage
# one device call (10 minutes) of its own.
QUICK_BUDGET_S = {"tests": 180, "parity": 120, "sweep": 60, "sanitizer": 100, "bench": 150, "gemm": 120}
FULL_BUDGET_S = {"tests": 300, "parity": 300, "sweep": 400, "sanitizer": 400, "bench": 560, "gemm": 400}
MIN_STAGE_S = 20  # a stage is not started with less than this left
LOG_TAIL = 6000  # characters of a stage's output kept in its JSON


def add_arguments(parser) -> None:
    parser.add_argument("--out", default="gpucheck-out", metavar="DIR",
                        help="folder for summary.json and one <stage>.json per stage (default gpucheck-out)")
    parser.add_argument("--stages", default=",".join(DEFAULT_STAGES),
                        help=f"comma list of {', '.join(STAGES)} (default: {','.join(DEFAULT_STAGES)})")
    parser.add_argument("--deadline", type=float, default=570.0,
                        help="seconds for the whole run; a stage gets at most what is left (default 570: one "
                             "10-minute device call with room for the copy back)")
    parser.add_argument("--budgets", default="", metavar="STAGE=S,...",
                        help="seconds for the named stages instead of their default budgets, e.g. parity=200,bench=120")
    add_stage_options(parser)


def parse_budgets(text: str, base: dict) -> dict:
    """`base` with the comma list of stage=seconds applied; ValueError for an unknown stage or a bad number."""
    budgets = dict(base)
    for item in filter(None, (t.strip() for t in text.split(","))):
        stage, _, value = item.partition("=")
        try:
            seconds = float(value)
        except ValueError:
            seconds = float("nan")
        if stage not in STAGES or not seconds > 0:
            raise ValueError(f"--budgets: {item!r} is not STAGE=SECONDS with a known stage and seconds > 0")
        budgets[stage] = seconds
    return budgets


def parse_stages(text: str) -> list[str]:
    """The comma list of stage names, in the order given; ValueError for an unknown or empty one."""
    names = list(dict.fromkeys(s.strip() for s in text.split(",") if s.strip()))
    unknown = [n for n in names if n not in STAGES]
    if unknown or not names:
        raise ValueError(f"--stages: unknown stage {', '.join(map(repr, unknown)) or 'list (empty)'}; "
                         f"known: {', '.join(STAGES)}")
    return names


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _command_output(cmd: list[str]) -> str | None:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30, cwd=REPO).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def environment() -> dict:
    """Versions, the GPU and the tools found: what the results were measured with."""
    import torch

    import bertfast

    env = {"python": platform.python_version(), "platform": platform.platform(), "bertfast": bertfast.__version__,
           "git_commit": _command_output(["git", "rev-parse", "HEAD"]), "torch": torch.__version__,
           "torch_cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
           "packages": {p: _version(p) for p in ("triton", "transformers", "onnxruntime", "onnxruntime-gpu",
                                                 "flash-attn", "numpy")},
           "nvidia_smi": _command_output(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                                          "--format=csv,noheader"]),
           "compute_sanitizer": find_sanitizer()}
    if env["cuda_available"]:
        p = torch.cuda.get_device_properties(0)
        env["gpu"] = {"name": p.name, "capability": f"{p.major}.{p.minor}",
                      "memory_gib": round(p.total_memory / 2**30, 1), "multiprocessors": p.multi_processor_count}
    return env


def _passthrough(args) -> list[str]:
    out = ["--quick"] if args.quick else []
    for name in ("config", "workloads", "providers", "dtypes", "repeats", "parity_dtypes"):
        value = getattr(args, name)
        if value is not None:
            out += [f"--{name.replace('_', '-')}", str(value)]
    return out


def run_stage(stage: str, args, out_dir: str, timeout: float, device: str | None = None) -> dict:
    """One stage in a child process (its own session, killed whole past `timeout`): its result with the device it
    ran on, seconds, exit code and the tail of its output, also written to out_dir/<stage>.json."""
    path = os.path.join(out_dir, f"{stage}.json")
    if os.path.exists(path):
        os.remove(path)
    cmd = [sys.executable, "-m", "bertfast.tools.gpucheck.stages", stage, path, *_passthrough(args)]
    # Compiled kernels, never the interpreter; autotune timings cached on disk so later stages reuse them.
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONUNBUFFERED="1", TRITON_CACHE_AUTOTUNING="1",
               PYTHONPATH=os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p))
    t0 = time.monotonic()
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)

        def tee():  # the device call shows the end of the output: stream it, and keep it for the JSON
            for line in proc.stdout:
                log.write(line)
                sys.stdout.write(f"[{stage}] {line}")
                sys.stdout.flush()

        reader = threading.Thread(target=tee, daemon=True)
        reader.start()
        timed_out = False
        try:
            code = proc.wait(timeout=max(1.0, timeout))
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(proc.pid, signal.SIGKILL)
            code = proc.wait()
        reader.join(10)
        log.seek(0)
        tail = log.read()[-LOG_TAIL:]
    result = None
    if os.path.exists(path):
        with open(path) as f:
            result = json.load(f)
    if timed_out:
        result = {**(result or {}), "status": "fail", "reason": f"timed out after {timeout:.0f} s (its budget)"}
    elif result is None:
        result = {"status": "error", "reason": f"the stage process exited with code {code} and wrote no result"}
    result.update(device=device, seconds=round(time.monotonic() - t0, 1), exit_code=code, log_tail=tail)
    with open(path, "w") as f:
        json.dump(result, f, indent=1, default=str)
    return result


def _write(path: str, summary: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(summary, f, indent=1, default=str)
    os.replace(tmp, path)


def run(args) -> int:
    try:
        stages = parse_stages(args.stages)
        budget = parse_budgets(args.budgets, QUICK_BUDGET_S if args.quick else FULL_BUDGET_S)
        if not args.deadline > 0:
            raise ValueError(f"--deadline must be > 0 seconds, got {args.deadline:g}")
    except ValueError as e:
        print(f"bertfast gpucheck: {e}", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    summary_path = os.path.join(args.out, "summary.json")
    started = time.monotonic()
    env = environment()
    summary = {"argv": sys.argv, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "quick": args.quick,
               "stages_selected": stages, "environment": env, "stages": {}, "status": "running"}
    if not env["cuda_available"]:
        why = (f"no CUDA device here (torch {env['torch']}, CUDA build {env['torch_cuda']}: "
               "torch.cuda.is_available() is False); every stage needs an NVIDIA GPU, so nothing was run")
        summary.update(status="no-cuda", reason=why,
                       stages={s: {"status": "skip", "reason": "no CUDA device"} for s in stages})
        _write(summary_path, summary)
        print(f"bertfast gpucheck: {why} (wrote {summary_path})", file=sys.stderr)
        return 2
    gpu = env["gpu"]
    print(f"bertfast gpucheck: {gpu['name']} (sm_{gpu['capability'].replace('.', '')}), torch {env['torch']}, "
          f"triton {env['packages']['triton']}; stages {', '.join(stages)}; results in {args.out}", flush=True)
    for stage in stages:
        left = args.deadline - (time.monotonic() - started)
        if left < MIN_STAGE_S:
            entry = {"status": "not-run", "reason": f"out of time: {left:.0f} s left of --deadline {args.deadline:g}"}
        else:
            result = run_stage(stage, args, args.out, min(budget[stage], left), device=gpu["name"])
            entry = {k: result.get(k) for k in ("status", "reason", "seconds", "exit_code")}
            entry.update({k: result[k] for k in ("counts",) if k in result})
        summary["stages"][stage] = entry
        _write(summary_path, summary)
        print(f"bertfast gpucheck: stage {stage}: {entry['status']}"
              + (f" ({entry['reason']})" if entry.get("reason") else "")
              + (f" in {entry['seconds']} s" if entry.get("seconds") is not None else ""), flush=True)
    passed = all(e["status"] in ("pass", "skip") for e in summary["stages"].values())
    summary.update(status="pass" if passed else "fail", seconds=round(time.monotonic() - started, 1))
    _write(summary_path, summary)
    print(f"bertfast gpucheck: {summary['status']} in {summary['seconds']} s; wrote {summary_path}", flush=True)
    return 0 if passed else 1
