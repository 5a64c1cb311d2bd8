"""`bertfast kernels`: compile every Triton kernel ahead of time for GPU architectures, no GPU needed.

For each kernel variant (BERT-base constexprs: hidden 768, head dim 64, fp16 unless --dtype) and
each autotune config that survives its filter for that shape, the kernel goes through Triton's
whole pipeline (TTIR -> TTGIR -> LLVM -> PTX -> cubin) for each `--arch`; `ptxas -v` then reports
registers, spill bytes and the PTX is searched for Hopper's `wgmma` (`wgmma.mma_async`) and TMA
(`cp.async.bulk.tensor`) instructions. Exit status is 1 on any compile error or any spill, which is what CI checks.
A kernel module may name the oldest architecture its kernels are for (`AOT_MIN_ARCH = 90`), and a variant its own
(a fifth item, the arch as an int): below it the build is skipped and listed as such, not failed.

The kernels must be built as compiled (not interpreted) functions: under TRITON_INTERPRET=1 the
command re-runs itself in a subprocess with the interpreter off.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time

ARCHS = {"sm_80": 80, "sm_86": 86, "sm_89": 89, "sm_90": 90}
DTYPES = ("fp16", "bf16", "fp32")


def add_arguments(parser) -> None:
    parser.add_argument("--arch", default="sm_80,sm_90",
                        help=f"comma-separated GPU architectures (of {', '.join(ARCHS)}); default sm_80,sm_90")
    parser.add_argument("--json", metavar="F", default=None, help="also write the report as JSON to file F")
    parser.add_argument("--kernel", default=None,
                        help="comma-separated kernel names to build (default: all); see the table for names")
    parser.add_argument("--dtype", default="fp16", choices=DTYPES, help="element type of the build (default fp16)")
    parser.add_argument("--jobs", "-j", type=int, default=os.cpu_count() or 1,
                        help="parallel build processes (default: the number of CPUs)")
    parser.add_argument("--first-config", action="store_true",
                        help="build only the first surviving autotune config per kernel (faster)")


def kernel_modules() -> list:
    """The kernel modules that declare `aot_variants`, in build order."""
    from bertfast.kernels.triton import (attention, attention_tma, disentangled, embedding, fp8, layer, layernorm,
                                         linear, linear_tma, lora, qkv)

    return [embedding, qkv, disentangled, attention, attention_tma, linear, linear_tma, lora, layernorm, layer, fp8]


def variants(dtype: str = "fp16"):
    """All (name, jit_fn, {argument: representative value}, configs, min_arch) the ops declare for BERT-base: min_arch
    is the larger of the module's AOT_MIN_ARCH and the variant's own fifth item (0 when neither is given)."""
    import torch

    torch_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    for module in kernel_modules():
        module_min = int(getattr(module, "AOT_MIN_ARCH", 0))
        for variant in module.aot_variants(torch_dtype):
            name, fn, values, configs = variant[:4]
            yield name, fn, values, configs, max(module_min, int(variant[4]) if len(variant) > 4 else 0)


def _parse_ptxas(log: str) -> dict:
    regs = re.search(r"Used (\d+) registers", log)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    stack = re.search(r"(\d+) bytes stack frame", log)
    if regs is None or spill is None:
        raise RuntimeError(f"cannot parse ptxas output:\n{log}")
    return {"registers": int(regs.group(1)), "spill_stores": int(spill.group(1)),
            "spill_loads": int(spill.group(2)), "stack": int(stack.group(1)) if stack else 0}


def ptxas_report(ptx: str, capability: int) -> dict:
    """Run the ptxas Triton ships (`-v`) on `ptx`; returns registers and spill bytes."""
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "kernel.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        cmd = [get_ptxas(capability).path, "-v", f"--gpu-name={sm_arch_from_capability(capability)}",
               src, "-o", os.path.join(tmp, "kernel.cubin")]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"ptxas failed ({proc.returncode}): {proc.stderr.strip()}")
    return _parse_ptxas(proc.stderr + proc.stdout)


def specialize(fn, values: dict):
    """Signature, constexprs and attributes of `fn` for a launch with these argument values, derived
    the way Triton's JIT derives them at run time (ints equal to 1 become constexprs, ints and
    pointers divisible by 16 get the divisibility attribute unless `do_not_specialize`)."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    missing = [p.name for p in fn.params if p.name not in values]
    if missing:
        raise RuntimeError(f"no representative value for arguments {missing}")
    signature, constexprs, attrs = {}, {}, {}
    for i, p in enumerate(fn.params):
        value = values[p.name]
        if p.is_constexpr:
            signature[p.name], constexprs[p.name] = "constexpr", value
            continue
        ty, key = native_specialize_impl(BaseBackend, value, False, not p.do_not_specialize,
                                         not p.do_not_specialize_on_alignment)
        signature[p.name] = ty
        if ty == "constexpr":
            constexprs[p.name] = key
        elif isinstance(key, str):
            attrs[(i,)] = BaseBackend.parse_attr(key)
    return signature, constexprs, attrs


def compile_one(fn, values: dict, config, capability: int) -> dict:
    """Compile one kernel launch (representative argument values + autotune config) for a GPU
    `capability` (e.g. 90) and report its resources."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature, constexprs, attrs = specialize(fn, {**values, **config.kwargs})
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    t0 = time.perf_counter()
    options = {"num_warps": config.num_warps, "num_stages": config.num_stages}
    if config.maxnreg is not None:
        options["maxnreg"] = config.maxnreg
    compiled = triton.compile(src, target=GPUTarget("cuda", capability, 32), options=options)
    seconds = time.perf_counter() - t0
    ptx = compiled.asm["ptx"]
    report = ptxas_report(ptx, capability)
    report.update({"shared_bytes": int(compiled.metadata.shared), "compile_s": round(seconds, 2),
                   "uses_dot": "tt.dot" in compiled.asm["ttir"], "wgmma": "wgmma.mma_async" in ptx,
                   "tma": "cp.async.bulk.tensor" in ptx, "warps": int(compiled.metadata.num_warps)})
    return report


_SHORT = {"BLOCK_M": "M", "BLOCK_N": "N", "BLOCK_K": "K", "GROUP_M": "G"}


def _config_text(config) -> str:
    parts = [f"{_SHORT.get(k, k)}{v}" for k, v in config.kwargs.items() if k != "WARP_SPECIALIZE"]
    if config.kwargs.get("WARP_SPECIALIZE"):
        parts.append("ws")
    parts += [f"w{config.num_warps}", f"s{config.num_stages}"]
    if config.maxnreg is not None:
        parts.append(f"r{config.maxnreg}")
    return " ".join(parts)


def _build(job) -> dict:
    """Worker: build variant `index`, config `config_index` for `arch` (runs in a subprocess)."""
    dtype, index, config_index, arch = job
    name, fn, values, configs, _ = list(variants(dtype))[index]
    config = configs[config_index]
    row = {"kernel": name, "arch": arch, "dtype": dtype, "config": _config_text(config)}
    try:
        row.update(compile_one(fn, values, config, ARCHS[arch]))
        row["error"] = None
    except Exception as e:  # a compile failure is a result to report, not a crash
        text = str(e).strip()
        row["error"] = f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"
    return row


def plan(archs: list[str], dtype: str, only: set[str] | None, first_config: bool):
    """The builds to run, (dtype, variant index, config index, arch), and those skipped below their variant's min
    arch, {kernel, arch, reason}."""
    work, skipped = [], []
    for index, (name, _, _, configs, min_arch) in enumerate(variants(dtype)):
        if only is not None and name not in only:
            continue
        for arch in archs:
            if ARCHS[arch] < min_arch:
                skipped.append({"kernel": name, "arch": arch, "reason": f"needs sm_{min_arch} or later"})
                continue
            work += [(dtype, index, config_index, arch) for config_index in range(1 if first_config else len(configs))]
    work.sort(key=lambda job: (job[1], job[2], archs.index(job[3])))  # kernel, config, arch: the table's order
    return work, skipped


def build_report(archs: list[str], dtype: str, only: set[str] | None, first_config: bool,
                 jobs: int = 1) -> tuple[list[dict], list[dict]]:
    """Build every selected (kernel, config, arch) at or above its min arch; rows in a fixed order, printed as they
    come, and the skipped (kernel, arch) pairs."""
    work, skipped = plan(archs, dtype, only, first_config)
    for s in skipped:
        print(f"{s['kernel']:<{_KERNEL_W}} {s['arch']:<6} skipped: {s['reason']}", flush=True)
    if jobs <= 1 or len(work) <= 1:
        rows = []
        for job in work:
            rows.append(_build(job))
            _print_row(rows[-1])
        return rows, skipped
    import concurrent.futures
    import multiprocessing

    # Builds are independent and CPU-bound (LLVM, ptxas): one process each; "spawn" because the
    # parent holds Triton and torch state that should not be forked.
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
        rows = []
        for row in pool.map(_build, work):
            rows.append(row)
            _print_row(row)
    return rows, skipped


_KERNEL_W, _CONFIG_W = 22, 26
_HEADER = (f"{'kernel':<{_KERNEL_W}} {'arch':<6} {'config':<{_CONFIG_W}} {'regs':>5} {'spill':>7} {'smem KB':>8} "
           f"{'wgmma':>6} {'TMA':>4} {'build s':>8}")


def _print_row(row: dict) -> None:
    head = f"{row['kernel']:<{_KERNEL_W}} {row['arch']:<6} {row['config']:<{_CONFIG_W}}"
    if row["error"]:
        print(f"{head} ERROR {row['error']}", flush=True)
        return
    spill = row["spill_stores"] + row["spill_loads"]
    # wgmma is Hopper's tensor-core path; exact fp32 ("ieee") dots run on FMA units by design. TMA is a Hopper
    # copy engine: "-" below sm_90, where no kernel can use it.
    hopper = ARCHS[row["arch"]] >= 90
    wgmma = ("yes" if row["wgmma"] else "no") if hopper and row["uses_dot"] else "-"
    tma = ("yes" if row["tma"] else "no") if hopper else "-"
    print(f"{head} {row['registers']:>5} {spill:>7} {row['shared_bytes'] / 1024:>8.1f} {wgmma:>6} {tma:>4} "
          f"{row['compile_s']:>8.1f}", flush=True)


def _rerun_without_interpreter(args) -> int:
    argv = [sys.executable, "-m", "bertfast", "kernels", "--arch", args.arch, "--dtype", args.dtype]
    if args.json:
        argv += ["--json", args.json]
    if args.kernel:
        argv += ["--kernel", args.kernel]
    if args.first_config:
        argv.append("--first-config")
    argv += ["--jobs", str(args.jobs)]
    env = dict(os.environ, TRITON_INTERPRET="0")
    return subprocess.run(argv, env=env).returncode


def run(args) -> int:
    archs = [a.strip() for a in args.arch.split(",") if a.strip()]
    unknown = [a for a in archs if a not in ARCHS]
    if not archs or unknown:
        print(f"bertfast kernels: unknown arch {', '.join(unknown) or '(none)'}; known: {', '.join(ARCHS)}",
              file=sys.stderr)
        return 2
    ops_module = sys.modules.get("bertfast.kernels.triton")
    if os.environ.get("TRITON_INTERPRET", "0") == "1" or (ops_module is not None and ops_module.INTERPRET):
        return _rerun_without_interpreter(args)
    # Triton 3.9 warns when FP fusion is left implicit; fusion (FMA) is what the kernels are built with.
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    only = None
    if args.kernel:
        only = {k.strip() for k in args.kernel.split(",") if k.strip()}
        known = {v[0] for v in variants(args.dtype)}
        if only - known:
            print(f"bertfast kernels: unknown kernel {', '.join(sorted(only - known))}; known: "
                  f"{', '.join(sorted(known))}", file=sys.stderr)
            return 2
    print(f"Triton AOT build, {args.dtype}, BERT-base constexprs (hidden 768, head dim 64), archs {', '.join(archs)}")
    print(_HEADER)
    rows, skipped = build_report(archs, args.dtype, only, args.first_config, max(1, args.jobs))
    errors = [r for r in rows if r["error"]]
    spills = [r for r in rows if not r["error"] and r["spill_stores"] + r["spill_loads"] > 0]
    print(f"{len(rows)} builds, {len(errors)} errors, {len(spills)} with spills, {len(skipped)} skipped below their "
          "min arch")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"dtype": args.dtype, "archs": archs, "builds": rows, "skipped": skipped}, f, indent=1)
    return 1 if errors or spills else 0
