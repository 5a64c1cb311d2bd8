"""Benchmark of the native CPU backend against Hugging Face BertModel (SDPA), interleaved, one run.

    python benchmarks/bench_cpu.py [--reps 15] [--dtypes fp32,bf16] [--workloads b1xs16,b8xs128,b8xs128-ragged]

BERT-base config, random weights, the same weights and inputs for every provider, timed by bertfast's
one interleaved timer (docs/bench-method.md#other-scripts); the table shows medians, the spread
(p25-p75) and the speedup of bertfast over hf-sdpa. Every provider's output is checked against Hugging
Face fp32 before timing (a wrong row is an error, not a number). Then the GEMM rows:
the extension's GEMM streaming BERT-base's packed weights at small M (GB/s) against torch's F.linear at
the same M, and at 576 and 1024 rows its fp32 blocked regime against torch.addmm (MKL sgemm), GFLOP/s
and the paired time ratio.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys

import torch

# Runnable from a source checkout without installing: the repository root holds the package.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bertfast.tools.bench.measure import interleaved, timer  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
WORKLOADS = ("b1xs16", "b8xs128", "b8xs128-ragged")


def make_inputs(workload: str, vocab: int, seed: int = 0):
    """(input_ids, attention_mask) of a workload (bertfast.tools.workloads: 'ragged' lengths are the evenly
    spaced quantiles of uniform [16, 128], i.e. the distribution's mean fill)."""
    from bertfast.tools.workloads import Workload, make_batch

    wl = Workload.parse(workload)
    batch = make_batch(wl.batch, wl.seqlen, wl.lengths, vocab_size=vocab, seed=seed)
    return batch.input_ids, batch.attention_mask


def setup(provider: str, hf_fp32, dtype: torch.dtype):
    """A callable (ids, mask) -> last_hidden_state for one provider on the shared weights."""
    import transformers

    from bertfast import Encoder

    if provider == "bertfast":
        enc = Encoder.from_hf(hf_fp32, backend="cpu", dtype=dtype)
        return lambda ids, mask: enc(ids, attention_mask=mask).last_hidden_state
    if provider == "hf-sdpa":
        cfg = hf_fp32.config
        cfg._attn_implementation = "sdpa"
        model = transformers.BertModel(cfg).eval()
        model.load_state_dict(hf_fp32.state_dict())
        model = model.to(dtype)

        def run(ids, mask):
            with torch.inference_mode():
                return model(ids, attention_mask=mask).last_hidden_state

        return run
    raise ValueError(f"unknown provider {provider!r}")


def time_interleaved(fns: dict, args, reps: int, warmup: int = 2):
    """Seconds per call of each fn(*args): bertfast's one interleaved timer (docs/bench-method.md#other-scripts)."""
    return interleaved({name: timer(functools.partial(fn, *args)) for name, fn in fns.items()}, reps, warmup=warmup)


def quartiles(ts):
    q = statistics.quantiles(ts, n=4)
    return q[0], statistics.median(ts), q[2]


def bench_models(args):
    import transformers

    from bertfast.accuracy import rel_error, tolerance

    torch.manual_seed(0)
    cfg = transformers.BertConfig(attn_implementation="sdpa")  # BERT-base: 12 x 768, 12 heads, 3072
    hf_fp32 = transformers.BertModel(cfg).eval()
    rows = []
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, transformers {transformers.__version__}")
    print(f"{'workload':<16}{'dtype':<6}{'provider':<10}{'median ms':>10}{'p25-p75 ms':>16}{'tokens/s':>10}"
          f"{'speedup':>9}{'rel err':>10}")
    for dname in args.dtypes:
        dtype = DTYPES[dname]
        providers = {p: setup(p, hf_fp32, dtype) for p in ("bertfast", "hf-sdpa")}
        for workload in args.workloads:
            ids, mask = make_inputs(workload, cfg.vocab_size)
            real = mask.bool()
            with torch.inference_mode():
                expected = hf_fp32(ids, attention_mask=mask).last_hidden_state
            errors = {}
            for name, fn in providers.items():
                out = fn(ids, mask).float()
                errors[name] = rel_error(out, expected, mask)
            # bf16 may err like Hugging Face's own bf16 run (x2, no floor), or 1e-2; fp32 must agree closely.
            limit = (1e-4 if dtype == torch.float32
                     else max(tolerance(errors["hf-sdpa"], dtype, floor=0.0, cap=False), 1e-2))
            if errors["bertfast"] > limit:
                raise SystemExit(f"{workload} {dname}: bertfast output is wrong (rel err {errors['bertfast']:.3g})")
            times = time_interleaved(providers, (ids, mask), args.reps)
            base = statistics.median(times["hf-sdpa"])
            for name, ts in times.items():
                lo, med, hi = quartiles(ts)
                tok = int(real.sum()) / med
                speedup = base / med
                rows.append((workload, dname, name, med, speedup))
                print(f"{workload:<16}{dname:<6}{name:<10}{med * 1e3:>10.1f}{f'{lo * 1e3:.1f}-{hi * 1e3:.1f}':>16}"
                      f"{tok:>10.0f}{speedup:>8.2f}x{errors[name]:>10.1e}")
            sys.stdout.flush()
    return rows


def bench_gemm(args):
    """Small-M GEMM over BERT-base's 48 linear weights (340 MB fp32): GB/s streamed, vs F.linear."""
    import torch.nn.functional as F

    from bertfast import _C

    shapes = [(2304, 768), (768, 768), (3072, 768), (768, 3072)] * 12
    print(f"\nsmall-M GEMM over BERT-base encoder weights (isa {_C.isa()}, avx512-bf16 {_C.has_avx512_bf16()})")
    print(f"{'dtype':<6}{'M':>4}{'ours ms':>9}{'ours GB/s':>11}{'torch ms':>10}{'torch GB/s':>12}")
    for dname in args.dtypes:
        dtype = DTYPES[dname]
        g = torch.Generator().manual_seed(0)
        weights = [(torch.randn(n, k, generator=g).to(dtype), torch.randn(n, generator=g).to(dtype))
                   for n, k in shapes]
        packed = [_C.pack_linear(w) for w, _ in weights]
        nbytes = sum(w.numel() * w.element_size() for w, _ in weights)
        for m in (1, 16, 32):
            xs = {k: torch.randn(m, k, generator=g).to(dtype) for k in (768, 3072)}

            def ours():
                for (w, b), p in zip(weights, packed):
                    _C.linear(xs[w.shape[1]], p, w.shape[0], b)

            def theirs():
                for w, b in weights:
                    F.linear(xs[w.shape[1]], w, b)

            times = time_interleaved({"ours": ours, "torch": theirs}, (), max(5, args.reps // 2), warmup=1)
            t_ours, t_torch = statistics.median(times["ours"]), statistics.median(times["torch"])
            print(f"{dname:<6}{m:>4}{t_ours * 1e3:>9.1f}{nbytes / t_ours / 1e9:>11.1f}{t_torch * 1e3:>10.1f}"
                  f"{nbytes / t_torch / 1e9:>12.1f}")

    print("\nlarge-M GEMM, BERT-base's four shapes: the extension's fp32 GEMM (blocked regime) vs torch.addmm")
    print(f"{'dtype':<6}{'M':>6}{'ours GFLOP/s':>14}{'addmm GFLOP/s':>15}{'time ours/addmm':>17}")
    for dname in args.dtypes:
        dtype = DTYPES[dname]
        for m in (576, 1024):
            mats = [(torch.randn(m, k).to(dtype), torch.randn(n, k).to(dtype), torch.randn(n).to(dtype))
                    for n, k in shapes[:4]]
            flops = sum(2 * m * w.shape[0] * w.shape[1] for _, w, _ in mats)
            fns = {"addmm": lambda: [torch.addmm(b, x, w.t()) for x, w, b in mats]}
            # fp32: the blocked regimes (AVX-512, portable); bf16 at large M runs on oneDNN or torch, not ours
            if dtype == torch.float32 and _C.isa() in ("avx512_vnni", "amx", "portable"):
                packed = [_C.pack_linear(w) for _, w, _ in mats]
                fns["ours"] = lambda: [_C.linear(x, p, w.shape[0], b) for (x, w, b), p in zip(mats, packed)]
            times = time_interleaved(fns, (), 9, warmup=1)
            t_addmm = statistics.median(times["addmm"])
            if "ours" in times:
                t_ours = statistics.median(times["ours"])
                ratio = statistics.median(a / b for a, b in zip(times["ours"], times["addmm"]))
                print(f"{dname:<6}{m:>6}{flops / t_ours / 1e9:>14.0f}{flops / t_addmm / 1e9:>15.0f}{ratio:>17.3f}")
            else:
                print(f"{dname:<6}{m:>6}{'-':>14}{flops / t_addmm / 1e9:>15.0f}{'-':>17}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--no-gemm", action="store_true", help="skip the GEMM rows")
    args = parser.parse_args(argv)
    args.dtypes = [d for d in args.dtypes.split(",") if d]
    args.workloads = [w for w in args.workloads.split(",") if w]
    for d in args.dtypes:
        if d not in DTYPES:
            parser.error(f"unknown dtype {d!r} (choose from {', '.join(DTYPES)})")
    for w in args.workloads:
        if w not in WORKLOADS:
            parser.error(f"unknown workload {w!r} (choose from {', '.join(WORKLOADS)})")
    bench_models(args)
    if not args.no_gemm:
        bench_gemm(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
