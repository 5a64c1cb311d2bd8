"""`bertfast bench --isa all|tier,...`: the bench grid once per CPU ISA tier, in one invocation.

Each tier runs as a child `bertfast bench` with the same arguments and BERTFAST_ISA set, because the
libraries read their caps once per process (docs/bench-method.md#tiers); the child prints its own
table and writes a JSON report that this process merges into one, every row tagged with its tier.
Tiers the CPU lacks are listed as skipped with the reason and never started.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

from bertfast.backends.cpu import isa


def parse_tiers(text: str) -> list[str]:
    """'all' or a comma list of caps (tier names, avx512_vnni-nobf16) -> caps, highest first. 'all' leaves out
    amx_emulated (a tier for tests: its timings are the emulation's). Raises ValueError for an unknown name."""
    names = [t.strip() for t in text.split(",") if t.strip()]
    if names == ["all"]:
        return [cap for cap in reversed(isa.CAPS) if cap != isa.EMULATED]
    unknown = [t for t in names if t not in isa.CAPS]
    if unknown or not names:
        raise ValueError(f"--isa: unknown tier(s) {', '.join(unknown) or '(none given)'}; use 'all' or a comma "
                         f"list of {', '.join(isa.CAPS)}")
    return sorted(dict.fromkeys(names), key=isa.CAPS.index, reverse=True)


def _per_tier(path: str | None, tier: str) -> str | None:
    if path is None:
        return None
    root, ext = os.path.splitext(path)
    return f"{root}-{tier}{ext}"


def child_argv(args, json_path: str) -> list[str]:
    """The `bertfast bench` command line of one tier's child: this run's settings, its own JSON (and plot)."""
    argv = [sys.executable, "-m", "bertfast", "bench", "--json", json_path]
    for flag, value in (("--model", args.model), ("--config", args.config), ("--workloads", args.workloads),
                        ("--providers", args.providers), ("--dtypes", args.dtypes), ("--repeats", args.repeats),
                        ("--budget", args.budget), ("--threads", args.threads), ("--settle-ms", args.settle_ms),
                        ("--isolation", args.isolation), ("--device", args.device), ("--seed", args.seed)):
        if value is not None:
            argv += [flag, str(value)]
    if args.quick:
        argv.append("--quick")
    return argv


def child_env(tier: str) -> dict[str, str]:
    """This process's environment with BERTFAST_ISA=tier, less the library variables bertfast set here
    for this process's own cap (a user's own settings stay)."""
    env = {k: v for k, v in os.environ.items() if k not in isa.APPLIED}
    env["BERTFAST_ISA"] = tier
    return env


def run(args) -> int:
    """Run the grid once per tier in `args.isa`; returns the exit code (the worst child's)."""
    try:
        tiers = parse_tiers(args.isa)
        if args.device != "cpu":
            raise ValueError(f"--isa caps CPU ISA tiers; it needs --device cpu, got {args.device!r}")
    except ValueError as e:
        print(f"bertfast bench: {e}", file=sys.stderr)
        return 2
    supported = isa.supported_caps()
    skipped = {t: r for t in tiers if (r := isa.unsupported(t, supported)) is not None}
    reports, failed, status = {}, {}, 0
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bertfast-bench-isa-") as tmp:
        for tier in tiers:
            if tier in skipped:
                print(f"\n=== ISA tier {tier}: skipped: {skipped[tier]}", flush=True)
                continue
            print(f"\n=== ISA tier {tier} (BERTFAST_ISA={tier}, a child process)", flush=True)
            path = os.path.join(tmp, f"{tier}.json")
            argv = child_argv(args, path)
            if args.plot:
                argv += ["--plot", _per_tier(args.plot, tier)]
            code = subprocess.run(argv, env=child_env(tier)).returncode
            status = max(status, code)
            try:
                with open(path) as f:
                    reports[tier] = json.load(f)
            except (OSError, ValueError):
                failed[tier] = f"the child exited with code {code} and wrote no report"
    print("\nISA tiers: " + "; ".join(
        [f"{t} ran" for t in reports] + [f"{t} skipped ({r})" for t, r in skipped.items()]
        + [f"{t} FAILED ({r})" for t, r in failed.items()]))
    if failed:
        status = max(status, 1)
    if args.json:
        rows = [{**row, "isa": tier} for tier, rep in reports.items() for row in rep["rows"]]
        report = {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "elapsed_s": time.perf_counter() - t0,
                  "isa_tiers": {"requested": tiers, "ran": list(reports), "skipped": skipped, "failed": failed},
                  "tiers": reports, "rows": rows}
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, default=str)
        print(f"wrote {args.json}", file=sys.stderr)
    return status
