"""Int8 GEMM building blocks at BERT-base shapes: our fused int8 linear against the libraries' GEMMs.

For each linear of a BERT-base layer (QKV 768->2304, attention out 768->768, FFN in 768->3072 + GELU, FFN
out 3072->768 + residual) and token counts M, one interleaved run times:
  fp32     torch.addmm (MKL sgemm)
  bf16     F.linear in bf16 (oneDNN, AMX-bf16 where present)
  int_mm   torch._int_mm int8 x int8 -> int32 (no epilogue)
  onednn   oneDNN's prepacked int8 GEMM alone (qlinear_pointwise: int32 sums * per-channel scale; "-" where this
           torch lacks it): the library the engine does not call (its blocking changes a row with M), as a peer
  quant    quant.quantize_rows (per-token asymmetric) alone
  linear   quant.linear end to end, the op the cpu backend runs at every M: the native fused kernel (quantize +
           the tier's int8 GEMM + epilogue in one call)
Medians of interleaved rounds, ms, and effective TOP/s (2 M N K / time).

    python benchmarks/bench_int8.py [--m 16,128,1024] [--rounds 20] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

from bertfast.backends.cpu import quant
from bertfast.tools.bench.measure import interleaved, timer

_M_HINT = 1024  # the M oneDNN tunes its packed layout for; any M runs


def onednn_int8(ql: quant.QuantLinear):
    """A function qx -> oneDNN's int8 GEMM on ql's weight, or None where this torch has no oneDNN int8 linear."""
    ops = getattr(torch.ops, "onednn", None)
    if not torch.backends.mkldnn.is_available() or not hasattr(ops, "qlinear_prepack"):
        return None
    packed = ops.qlinear_prepack(ql.q, [_M_HINT, ql.in_features])
    zero = torch.zeros(ql.out_features, dtype=torch.int64)
    return lambda qx: ops.qlinear_pointwise(qx, 1.0, 0, packed, ql.scale, zero, None, 1.0, 0, torch.float32,
                                            "none", [], "")

SHAPES = [("qkv", 768, 2304, "none", False), ("attn_out", 768, 768, "none", True),
          ("ffn_in", 768, 3072, "gelu", False), ("ffn_out", 3072, 768, "none", True)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", default="16,128,1024", help="comma list of token counts")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    ms = [int(v) for v in args.m.split(",")]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, native quant kernels: "
          f"{quant._C is not None}")
    head = ("shape", "M", "fp32", "bf16", "int_mm", "onednn", "quant", "linear", "linear TOP/s")
    print("  ".join(f"{h:>12}" for h in head))
    g = torch.Generator().manual_seed(0)
    for M in ms:
        for name, K, N, act, has_res in SHAPES:
            w = torch.randn(N, K, generator=g) * K ** -0.5
            x = torch.randn(M, K, generator=g)
            bias = torch.randn(N, generator=g) * 0.1
            res = torch.randn(M, N, generator=g) if has_res else None
            ql = quant.QuantLinear.from_float(w)
            w_t, w_bf, x_bf = w.t(), w.bfloat16(), x.bfloat16()
            qx, xs, zp = quant.quantize_rows(x)
            w_q_t = ql.q.t()
            library = onednn_int8(ql)

            fns = {
                "fp32": lambda: torch.addmm(bias, x, w_t),
                "bf16": lambda: F.linear(x_bf, w_bf),
                "int_mm": lambda: torch._int_mm(qx, w_q_t),
                "onednn": (lambda: library(qx)) if library is not None else None,
                "quant": lambda: quant.quantize_rows(x),
                "linear": lambda: quant.linear(x, ql, bias, act, res),
            }
            runs = {k: timer(f) for k, f in fns.items() if f is not None}
            times = interleaved(runs, args.rounds, warmup=1)
            med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
            tops = 2 * M * N * K / (med["linear"] * 1e-3) / 1e12
            cells = [name, str(M)] + [f"{med[k]:.3f}" if k in med else "-" for k in fns] + [f"{tops:.2f}"]
            print("  ".join(f"{c:>12}" for c in cells), flush=True)


if __name__ == "__main__":
    main()
