"""The AMX GEMMs against oneDNN's at BERT-base shapes: our bf16 and int8 linears under each AMX kernel (streaming,
blocked: csrc/cpu/gemm/amx_gemm.h) and torch's bf16 GEMMs (oneDNN on AMX), GFLOP/s per token count.

    taskset -c 0,1 python benchmarks/bench_amx_gemm.py --threads 2 --out amx_gemm.json

For each linear of a BERT-base layer (qkv 768->2304, attn_out 768->768 + residual, ffn_in 768->3072 + GELU,
ffn_out 3072->768 + residual) and M in --m, one interleaved run (bertfast.tools.bench.measure) times:
  bf16-stream, bf16-blocked   _C.linear on a PackedLinear (bias and the layer's epilogue fused), the kernel forced
                              with _C.testing.set_amx_gemm (outside the timed call); bf16-staged: the blocked kernel
                              with its A rows staged in tile order (amx_gemm.h, AmxBlocking::stage); with --blocking
                              SxR[s],..., also bf16-blocked-SxR[s]: the blocked kernel with K blocks of S tile steps
                              and work items of at most R rows, A staged with the suffix s
                              (_C.testing.set_amx_blocking; the default: _C.testing.amx_blocking())
  int8-stream, int8-blocked,  quant.linear on a QuantLinear: the native call the int8 engine runs (quantize_rows,
  int8-staged                 the AMX-int8 GEMM, the dequantizing epilogue); int8-blocked-SxR[s] as for bf16
  F.linear, addmm             torch.nn.functional.linear and torch.addmm in bf16 with the bias (oneDNN; no GELU or
                              residual)
Every output is checked before timing: stream and blocked equal bit for bit, bf16 within 2e-2 of an fp32
reference, int8 within 1e-4 of quant.linear_reference; a failing row is an error, not a number. Prints ms and
GFLOP/s (2 M N K / median), writes the rows and the CPU to --out. The process runs on `--threads` OpenMP threads;
pin it to as many cores with taskset. Where the extension's tier is neither amx nor amx_emulated it prints why and
exits 0. Under amx_emulated (BERTFAST_ISA=amx_emulated) the tiles are emulated and the numbers mean nothing: use
--quick there, to check the script runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # runnable from a source checkout

import bertfast  # noqa: E402

bertfast.cap_libraries()  # F.linear's oneDNN under BERTFAST_ISA's cap too, before torch runs a GEMM
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

SHAPES = [("qkv", 768, 2304, "none", False), ("attn_out", 768, 768, "none", True),
          ("ffn_in", 768, 3072, "gelu", False), ("ffn_out", 3072, 768, "none", True)]
PROVIDERS = ("bf16-stream", "bf16-blocked", "bf16-staged", "int8-stream", "int8-blocked", "int8-staged", "F.linear",
             "addmm")


def contenders(M: int, K: int, N: int, act: str, has_res: bool, seed: int, blockings=()):
    """The providers' calls on one shape, and their outputs' errors (None where valid)."""
    from bertfast.backends.cpu import quant
    from bertfast.backends.cpu.ext import _C
    from bertfast.backends.cpu.linear import PackedLinear, linear
    from bertfast.tools.bench.measure import time_once

    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g) * K**-0.5
    bias, res = torch.randn(N, generator=g) * 0.1, torch.randn(M, N, generator=g) if has_res else None
    x_bf, w_bf, bias_bf, res_bf = x.bfloat16(), w.bfloat16(), bias.bfloat16(), res.bfloat16() if has_res else None
    pl, ql, w_bf_t = PackedLinear(w_bf), quant.QuantLinear.from_float(w), w_bf.t()
    fns = {
        "bf16": lambda: linear(x_bf, pl, bias_bf, act, res_bf),
        "int8": lambda: quant.linear(x, ql, bias, act, res),
        "F.linear": lambda: F.linear(x_bf, w_bf, bias_bf),
        "addmm": lambda: torch.addmm(bias_bf, x_bf, w_bf_t),
    }

    default_blocking = _C.testing.amx_blocking()

    def forced(mode, fn, blocking=default_blocking):
        def run():
            _C.testing.set_amx_gemm(mode)
            _C.testing.set_amx_blocking(*blocking)
            return time_once(fn)
        return run

    errors = {}
    plain = F.linear(x_bf.float(), w_bf.float(), bias_bf.float())  # what F.linear and addmm compute
    ref = F.gelu(plain) if act == "gelu" else plain
    ref = ref + res_bf.float() if has_res else ref
    for dtype in ("bf16", "int8"):
        outs = {}
        for mode in ("stream", "blocked"):
            _C.testing.set_amx_gemm(mode)
            outs[mode] = fns[dtype]()
        if not torch.equal(outs["stream"], outs["blocked"]):
            errors[f"{dtype}-stream"] = errors[f"{dtype}-blocked"] = "stream and blocked outputs differ"
            continue
        if dtype == "bf16":
            err = float((outs["blocked"].float() - ref).abs().max())
            bound = 2e-2 * max(1.0, float(ref.abs().max()))
        else:
            err = float((outs["blocked"].double() - quant.linear_reference(x, ql, bias, act, res)).abs().max())
            bound = 1e-4 * max(1.0, float(ref.abs().max()))
        if not err <= bound:
            errors[f"{dtype}-stream"] = errors[f"{dtype}-blocked"] = f"max error {err:.3g} > {bound:.3g}"
    for name in ("F.linear", "addmm"):
        err = float((fns[name]().float() - plain).abs().max())
        if not err <= 2e-2 * max(1.0, float(plain.abs().max())):
            errors[name] = f"max error {err:.3g}"
    staged = (*default_blocking[:2], True)
    runs = {"F.linear": lambda: time_once(fns["F.linear"]), "addmm": lambda: time_once(fns["addmm"])}
    variants = [("stream", "stream", default_blocking), ("blocked", "blocked", default_blocking),
                ("staged", "blocked", staged)]
    variants += [(blocking_name(b), "blocked", b) for b in blockings]
    for dtype in ("bf16", "int8"):  # every blocking gives the default's bits (tests/test_amx_gemm.py)
        for name, mode, blocking in variants:
            runs[f"{dtype}-{name}"] = forced(mode, fns[dtype], blocking)
            if f"{dtype}-blocked" in errors:
                errors[f"{dtype}-{name}"] = errors[f"{dtype}-blocked"]
    return {k: v for k, v in runs.items() if k not in errors}, errors


def blocking_name(blocking) -> str:
    steps, rows, stage = blocking
    return f"blocked-{steps}x{rows}{'s' if stage else ''}"


def parse_blocking(text: str) -> tuple[int, int, bool]:
    """'SxR' or 'SxRs' -> (steps, rows, stage)."""
    stage = text.endswith("s")
    steps, rows = (int(v) for v in text.rstrip("s").split("x"))
    return steps, rows, stage


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", default="16,128,512,1024,4096", help="comma list of token counts")
    ap.add_argument("--threads", type=int, default=2, help="OpenMP threads (pin as many cores with taskset)")
    ap.add_argument("--rounds", type=int, default=15, help="interleaved rounds per shape at most")
    ap.add_argument("--budget", type=float, default=35.0,
                    help="seconds of timed rounds in all, about (validation and warm-up come on top)")
    ap.add_argument("--quick", action="store_true", help="M = 16, 128, 2 rounds: checks the script runs")
    ap.add_argument("--blocking", default="", metavar="SxR[s],...",
                    help="also time the blocked kernels with K blocks of S tile steps and items of at most R rows "
                         "(suffix s: A staged in tile order)")
    ap.add_argument("--out", metavar="PATH", help="write the rows and the CPU here (JSON)")
    args = ap.parse_args(argv)
    from bertfast.backends.cpu import isa
    from bertfast.backends.cpu.ext import _C
    from bertfast.tools.bench.measure import interleaved

    tier = _C.isa() if _C is not None else None
    if tier not in ("amx", isa.EMULATED):
        why = f"the extension's tier is {tier}, without AMX tiles: nothing to measure"
        print(f"bench_amx_gemm: skipped: {why}")
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"skipped": why, "cpu_info": isa.cpu_info()}, f, indent=1)
        return 0
    torch.set_num_threads(args.threads)
    ms = [16, 128] if args.quick else [int(v) for v in args.m.split(",")]
    rounds = 2 if args.quick else args.rounds
    blockings = [parse_blocking(b) for b in args.blocking.split(",") if b]
    providers = PROVIDERS + tuple(f"{d}-{blocking_name(b)}" for b in blockings for d in ("bf16", "int8"))
    info = isa.cpu_info()
    print(f"cpu {info['cpu']}, tier {tier}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
          f"AMX GEMM default {_C.testing.amx_gemm()}, blocking (steps, rows, stage) {_C.testing.amx_blocking()}")
    if tier == isa.EMULATED:
        print("amx_emulated: the tiles are emulated, the times mean nothing")
    print(f"{'shape':>9} {'M':>5} " + " ".join(f"{h:>13}" for h in providers) + "   (ms / GFLOP/s)")
    default, blocking, rows = _C.testing.amx_gemm(), _C.testing.amx_blocking(), []
    per_shape = args.budget / (len(ms) * len(SHAPES))
    try:
        for M in ms:
            for si, (name, K, N, act, has_res) in enumerate(SHAPES):
                runs, errors = contenders(M, K, N, act, has_res, M * 10 + si, blockings)
                t0 = time.perf_counter()
                interleaved(runs, 1)  # warm-up, and the length of a round
                n = max(2, min(rounds, int(per_shape / max(time.perf_counter() - t0, 1e-6))))
                times = interleaved(runs, n)
                cells = []
                for p in providers:
                    row = {"shape": name, "M": M, "N": N, "K": K, "provider": p}
                    if p in errors:
                        row["error"] = errors[p]
                        cells.append("error")
                    else:
                        med = statistics.median(times[p])
                        row.update(median_ms=med * 1e3, min_ms=min(times[p]) * 1e3, max_ms=max(times[p]) * 1e3,
                                   rounds=n, gflops=2 * M * N * K / med / 1e9)
                        cells.append(f"{med * 1e3:.3f}/{row['gflops']:.0f}")
                    rows.append(row)
                print(f"{name:>9} {M:>5} " + " ".join(f"{c:>13}" for c in cells), flush=True)
                for p, e in errors.items():
                    print(f"  error {p}: {e}")
    finally:
        _C.testing.set_amx_gemm(default)
        _C.testing.set_amx_blocking(*blocking)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"cpu_info": info, "tier": tier, "threads": torch.get_num_threads(), "torch": torch.__version__,
                       "blocking": blocking, "amx_gemm": default, "rows": rows}, f, indent=1)
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
