"""What `bertfast bench` prints and writes: the results table, the notes on a noisy machine, and the
JSON report (machine, library versions, settings, every row). Reading the numbers:
docs/bench-method.md (#interleaving for the columns, #noise for the notes).
"""

from __future__ import annotations

import importlib
import json
import os
import platform
import time
from dataclasses import asdict

import torch

from bertfast import __version__
from bertfast.backends.cpu import isa
from bertfast.tools.bench.providers import BASELINE
from bertfast.tools.bench.runner import ATOL, Row


def environment(device: str) -> dict:
    """Machine, library versions and thread counts, for the JSON report."""
    cpu, flags = isa.proc_cpuinfo()
    cpu = cpu or platform.processor()
    mem_gb = None
    try:
        with open("/proc/meminfo") as f:
            mem_gb = round(int(f.readline().split()[1]) / 2**20, 1)
    except (OSError, ValueError, IndexError):
        pass
    versions = {"python": platform.python_version(), "bertfast": __version__, "torch": torch.__version__}
    for mod in ("transformers", "onnxruntime", "onnx", "triton", "numpy", "matplotlib"):
        try:
            versions[mod] = importlib.import_module(mod).__version__
        except Exception:
            versions[mod] = None
    machine = {
        "platform": platform.platform(), "cpu": cpu, "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "isa": sorted(flags & {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_int8", "amx_tile"}),
        "cpu_info": isa.cpu_info(),  # the ISA tier the kernels ran (and the libraries' caps)
        "memory_gb": mem_gb, "torch_threads": torch.get_num_threads(), "device": device,
        "load_average_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
    }
    if device.startswith("cuda"):
        machine["gpu"] = torch.cuda.get_device_name(device)
    return {"machine": machine, "versions": versions}


def caption(label: str, env: dict, settle_ms: float, isolation: str, baseline: str = BASELINE) -> str:
    """The line above the table: what was run where, and how to read the columns."""
    where = "each provider in its own process" if isolation == "process" else "all providers in one process"
    return (f"{label} on {env['machine']['cpu'] or env['machine']['device']}, {env['machine']['torch_threads']} "
            f"threads, torch {env['versions']['torch']}; median/p90 of interleaved rounds; tokens/s counts real "
            f"tokens; {settle_ms:g} ms idle and an untimed call before each timed one; {where}; "
            f"'vs sdpa' = {baseline} median / row median (same dtype); max err = max abs difference from the "
            f"fp32 HF model on real positions")


def _fmt(x, spec, missing="-"):
    return missing if x is None else format(x, spec)


def format_table(rows: list[Row]) -> str:
    """The printed results table (one line per row; skipped and error rows carry their reason)."""
    header = ("workload", "provider", "dtype", "ms med", "ms p90", "tokens/s", "vs sdpa", "max err",
              "peak MB", "setup s")
    lines = []
    for r in rows:
        if r.status != "ok":
            lines.append((r.workload, r.provider, r.dtype, f"{r.status.upper()}: {r.reason}"))
            continue
        setup_s = (r.build_s or 0.0) + (r.warmup_s or 0.0)
        lines.append((r.workload, r.provider, r.dtype, _fmt(r.ms_median, ".2f"), _fmt(r.ms_p90, ".2f"),
                      _fmt(r.tokens_per_s, ",.0f"),
                      _fmt(r.speedup_vs_hf_sdpa, ".2f") + ("x" if r.speedup_vs_hf_sdpa else ""),
                      _fmt(r.max_abs_err, ".1e"), _fmt(r.peak_mem_mb, ".0f"), f"{setup_s:.1f}"))
    full = [ln for ln in lines if len(ln) == len(header)]
    widths = [max([len(header[i])] + [len(ln[i]) for ln in full]) for i in range(len(header))]
    for i in range(3):
        widths[i] = max([widths[i]] + [len(ln[i]) for ln in lines])

    def render(cells):
        out = []
        for i, c in enumerate(cells):
            if len(cells) < len(header) and i == 3:
                out.append(c)
                break
            out.append(c.ljust(widths[i]) if i < 3 else c.rjust(widths[i]))
        return "  ".join(out).rstrip()

    sep = "  ".join("-" * w for w in widths)
    return "\n".join([render(header), sep] + [render(ln) for ln in lines])


def notes(load_before: float | None, env: dict, steal: float | None) -> list[str]:
    """Warnings that the run's timings are inflated: a busy machine (load average over the cores) or a
    hypervisor that stole over 5% of the CPU time (docs/bench-method.md#noise)."""
    out = []
    loads = [x for x in (load_before, env["machine"]["load_average_1m"]) if x is not None]
    cores = env["machine"]["cpu_affinity"] or env["machine"]["cpu_count"] or 1
    if loads and max(loads) > cores:
        out.append(f"note: the machine was busy (1-min load average up to {max(loads):.1f} on {cores} cores): "
                   "absolute times are inflated and noisy; compare ratios within this run")
    if steal is not None and steal > 0.05:
        out.append(f"note: the hypervisor took {steal:.0%} of this machine's CPU time during the run (steal): "
                   "timings are inflated, multi-threaded runtimes unevenly; rerun on a quieter host before "
                   "drawing conclusions")
    return out


def write_json(path: str, *, env: dict, source, settings: dict, elapsed_s: float, load_before: float | None,
               steal: float | None, rows: list[Row]) -> None:
    """The machine-readable report: environment, model, settings, timing conditions and every row."""
    report = {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **env,
              "model": {"label": source.label, "dir": source.model_dir, "config": asdict(source.config)},
              "settings": {"baseline": BASELINE, **settings,
                           "tolerance_atol": {str(k).replace("torch.", ""): v for k, v in ATOL.items()}},
              "elapsed_s": elapsed_s, "load_average_1m_at_start": load_before, "steal_fraction": steal,
              "rows": [asdict(r) for r in rows]}
    with open(path, "w") as f:
        json.dump(report, f, indent=1, default=str)
