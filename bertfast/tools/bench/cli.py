"""`bertfast bench`: bertfast against the engines users would pick instead, in one run.

The command's face: `add_arguments(parser)` and `run(args)` (bertfast.tools.cli dispatches here).
It parses and checks the settings, loads the model (`source`), runs the grid (`runner`, or one child
per ISA tier with `--isa`: `tiers`), then prints the table and writes the JSON (`report`) and the
chart (`plot`). How it measures: docs/bench-method.md.
"""

from __future__ import annotations

import os
import sys
import time

import torch

from bertfast import default_model_path
from bertfast.backends import get_backend
from bertfast.backends.cpu import isa
from bertfast.tools.bench import plot, report, tiers
from bertfast.tools.bench.measure import cpu_ticks, steal_fraction
from bertfast.tools.bench.providers import (CUDA_PROVIDERS, DTYPES, FIXED_PROVIDERS, baseline_of,
                                            default_providers, factory_of)
from bertfast.tools.bench.runner import ISOLATIONS, SETTLE_S, run_bench
from bertfast.tools.bench.source import load_source
from bertfast.tools.workloads import CONFIGS, DEFAULT_WORKLOADS, QUICK_WORKLOADS, Workload


def add_arguments(parser) -> None:
    g = parser.add_mutually_exclusive_group()
    g.add_argument("--model", metavar="DIR", help="Hugging Face model directory (default: the embedded "
                   "all-MiniLM-L6-v2 checkpoint)")
    g.add_argument("--config", metavar="NAME[,NAME...]",
                   help="random weights of known shapes instead of a checkpoint, one table each: "
                   f"{', '.join(CONFIGS)}")
    parser.add_argument("--quick", action="store_true",
                        help=f"small grid ({', '.join(QUICK_WORKLOADS)}), up to 10 rounds, 20 s budget per workload")
    parser.add_argument("--workloads", help="comma list like b8xs128,b8xs128-uniform,b32xs128-short "
                        f"(default: {','.join(DEFAULT_WORKLOADS)})")
    parser.add_argument("--providers", help="comma list (default: every bertfast backend, "
                        f"{', '.join(FIXED_PROVIDERS)}; with --device cuda: {', '.join(CUDA_PROVIDERS)}); "
                        "'bertfast' means every bertfast row")
    parser.add_argument("--dtypes", default="fp32,bf16", help="comma list of fp32, bf16, fp16, or auto (what "
                        "dtype='auto' loads on this machine's tier) (default fp32,bf16)")
    parser.add_argument("--repeats", type=int, help="max timed rounds per workload and dtype (default 20, --quick 10)")
    parser.add_argument("--budget", type=float, help="seconds per workload and dtype that bound the "
                        "rounds, never below 3 (default 60, --quick 20)")
    parser.add_argument("--threads", type=int, help="intra-op threads for torch and ONNX Runtime")
    parser.add_argument("--settle-ms", type=float, default=SETTLE_S * 1e3,
                        help=f"idle ms, then one untimed call, before each timed call, so the providers do "
                        f"not slow each other down (default {SETTLE_S * 1e3:.0f}; 0: plain back-to-back rounds)")
    parser.add_argument("--isolation", choices=ISOLATIONS, default="process",
                        help="process (default): each provider is built and run in a worker process of its "
                        "own, as a user would serve it (libraries sharing a process slow each other's "
                        "thread pools); none: all in this process")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]")
    parser.add_argument("--isa", metavar="all|TIER,...", help="run the grid once per CPU ISA tier (portable, avx2, "
                        "avx512_vnni, amx; amx_emulated only by name), each in a child process with BERTFAST_ISA "
                        "set: one table per tier, one JSON with every tier's rows; tiers this CPU lacks are listed "
                        "as skipped")
    parser.add_argument("--seed", type=int, default=0, help="seed of the inputs and random weights")
    parser.add_argument("--json", metavar="F", help="write machine-readable results to F")
    parser.add_argument("--plot", metavar="F.png", help="write a speedup bar chart to F.png (needs matplotlib: "
                        f"pip install 'bertfast[{plot.EXTRA}]')")


def _split(text):
    return [t.strip() for t in text.split(",") if t.strip()]


def _parse(args):
    """Validated run settings from CLI args; raises ValueError with a message."""
    device = args.device
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: CUDA is not available here")
    if not (device == "cpu" or device.startswith("cuda")):
        raise ValueError(f"--device must be cpu or cuda[:N], got {device!r}")
    wl_names = _split(args.workloads) if args.workloads else list(QUICK_WORKLOADS if args.quick else DEFAULT_WORKLOADS)
    workloads = list(dict.fromkeys(Workload.parse(w) for w in wl_names))
    if not workloads:
        raise ValueError("--workloads is empty")
    dtypes = list(dict.fromkeys(auto_dtype_name(device) if d == "auto" else d for d in _split(args.dtypes)))
    for d in dtypes:
        if d not in DTYPES:
            raise ValueError(f"--dtypes: unknown dtype {d!r}; use {', '.join(DTYPES)}")
    if not dtypes:
        raise ValueError("--dtypes is empty")
    defaults, preskipped = default_providers(device)
    if args.providers:
        names = []
        for p in _split(args.providers):
            expanded = [n for n in defaults + list(preskipped) if n.startswith("bertfast-")] if p == "bertfast" else [p]
            for n in expanded:
                factory_of(n)  # raises ValueError for an unknown name
                if n not in names:
                    names.append(n)
        preskipped = {k: v for k, v in preskipped.items() if k not in _split(args.providers)}
        providers = names
    else:
        providers = defaults + list(preskipped)
    repeats = args.repeats if args.repeats is not None else (10 if args.quick else 20)
    budget = args.budget if args.budget is not None else (20.0 if args.quick else 60.0)
    if args.settle_ms < 0:
        raise ValueError(f"--settle-ms must be >= 0, got {args.settle_ms:g}")
    if repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {repeats}")
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")
    return device, workloads, dtypes, providers, preskipped, repeats, budget


def auto_dtype_name(device: str) -> str:
    """The DTYPES name of what dtype="auto" loads with backend "auto" on `device` (this process's tier)."""
    auto = get_backend("auto", device).precision(torch.device(device).type).auto
    return next(name for name, dtype in DTYPES.items() if dtype == auto)


def _config_names(args) -> list[str | None]:
    """--config's names (ValueError for an unknown one), or [None] for a checkpoint."""
    if not args.config:
        return [None]
    names = list(dict.fromkeys(_split(args.config)))
    unknown = [n for n in names if n not in CONFIGS]
    if unknown or not names:
        raise ValueError(f"--config: unknown config {', '.join(map(repr, unknown)) or 'list (empty)'}; "
                         f"known: {', '.join(CONFIGS)}")
    return names


def _load(args, device: str, config_name: str | None):
    """The model under test: a --config's random weights, --model's checkpoint, or the embedded default."""
    if config_name:
        return load_source(config_name=config_name, device=device, seed=args.seed)
    if args.model:
        return load_source(model_dir=args.model, device=device)
    return load_source(model_dir=default_model_path(), device=device, label="all-MiniLM-L6-v2 (embedded default)")


def _per_config(path: str | None, config_name: str | None, several: bool) -> str | None:
    """--json's or --plot's file; with several configs one file each, the config's name before the extension."""
    if not path or not several:
        return path
    stem, ext = os.path.splitext(path)
    return f"{stem}.{config_name}{ext or '.json'}"


def run(args) -> int:
    if args.plot:
        try:
            plot.require()  # before a run of minutes, not after it
        except plot.PlotUnavailable as e:
            print(f"bertfast bench: {e}", file=sys.stderr)
            return 2
    if getattr(args, "isa", None):
        return tiers.run(args)
    try:
        device, workloads, dtypes, providers, preskipped, repeats, budget = _parse(args)
        config_names = _config_names(args)
    except ValueError as e:
        print(f"bertfast bench: {e}", file=sys.stderr)
        return 2
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    status = 0
    for config_name in config_names:
        try:
            source = _load(args, device, config_name)
        except (ValueError, RuntimeError, OSError) as e:
            print(f"bertfast bench: cannot load the model: {e}", file=sys.stderr)
            return 2
        several = len(config_names) > 1
        code = _run_one(args, source, device, workloads, dtypes, providers, preskipped, repeats, budget,
                        _per_config(args.json, config_name, several), _per_config(args.plot, config_name, several))
        status = max(status, code)
    return status


def _run_one(args, source, device, workloads, dtypes, providers, preskipped, repeats, budget, json_path,
             plot_path) -> int:
    """One model's grid: run, print its table, write its JSON and chart; the exit status."""
    c = source.config
    print(f"bertfast bench: {source.label} (hidden {c.hidden_size}, {c.num_hidden_layers} layers, "
          f"{c.num_attention_heads} heads) on {device}, {torch.get_num_threads()} threads; "
          f"{len(workloads)} workloads x {len(dtypes)} dtypes x {len(providers)} providers",
          file=sys.stderr, flush=True)
    load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    ticks_before = cpu_ticks()
    t0 = time.perf_counter()
    rows = run_bench(source, workloads, dtypes, providers, repeats=repeats, budget_s=budget,
                     seed=args.seed, preskipped=preskipped, settle_s=args.settle_ms / 1e3,
                     isolation=args.isolation)
    elapsed = time.perf_counter() - t0
    steal = steal_fraction(ticks_before, cpu_ticks())
    env = report.environment(device)
    if device == "cpu":
        print(isa.describe(env["machine"]["cpu_info"]))
    baseline = baseline_of(source)
    print("\n" + report.caption(source.label, env, args.settle_ms, args.isolation, baseline))
    print(report.format_table(rows))
    for note in report.notes(load_before, env, steal):
        print(note)
    # Only bertfast's own rows fail the run: a peer that is wrong on this model is a finding, reported in its row.
    errors = [r for r in rows if r.status == "error"]
    ours = [r for r in errors if r.provider.startswith("bertfast")]
    if errors:
        print(f"\n{len(errors)} row(s) failed validation or crashed, {len(ours)} of them bertfast's: see ERROR lines",
              file=sys.stderr)
    status = 1 if ours else 0
    if json_path:
        settings = {"workloads": [w.name for w in workloads], "dtypes": dtypes, "providers": providers,
                    "repeats": repeats, "budget_s": budget, "settle_ms": args.settle_ms,
                    "isolation": args.isolation, "seed": args.seed}
        report.write_json(json_path, env=env, source=source, settings={**settings, "baseline": baseline},
                          elapsed_s=elapsed, load_before=load_before, steal=steal, rows=rows)
        print(f"wrote {json_path}", file=sys.stderr)
    if plot_path:
        try:
            plot.plot(rows, plot_path, f"bertfast bench: {source.label}, speedup vs {baseline}", baseline)
        except Exception as e:
            print(f"bertfast bench: could not write the plot {plot_path}: {type(e).__name__}: {e}",
                  file=sys.stderr)
            return 1
        print(f"wrote {plot_path}", file=sys.stderr)
    return status
