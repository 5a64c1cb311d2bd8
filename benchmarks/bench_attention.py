"""The native attention kernel on each ISA cap of this CPU, interleaved, at the shapes the engine runs it:

    python benchmarks/bench_attention.py [--caps amx,avx512_vnni] [--shapes minilm,bert-base] [--threads 1,2]
                                         [--dtypes fp32,bf16-products,bf16] [--rounds 15] [--json PATH]

Shapes: `minilm`, 24 sequences of 24-56 tokens (bench_embed's corpus: ~40), 12 heads of 32; `short`, 64 of 12
tokens, 12 heads of 32; `bert-base`, 8 x 128, 12 heads of 64; `ragged`, 8 of 16-128 tokens, 12 heads of 64. q, k
and v are views of one packed (T, 3, heads, d) tensor, as the QKV GEMM writes them. Dtypes: `fp32` (fp32 products),
`bf16-products` (fp32 inputs, products on bf16 operands: int8's attention), `bf16` (bf16 inputs and output).

Each contender is one cap; a timed call is a burst of calls of ~5 ms (same count for every cap of a row), the caps
interleaved (bertfast.tools.bench.measure). Prints microseconds a call (median) and GFLOP/s (4 L^2 d a head and
sequence), with each cap's largest difference from the first cap's output (bits differ between kernels; a large
one is a wrong kernel, not a timing). What it is for: the AMX tier's attention against the AVX-512 ones on short
rows (MiniLM: 20-23% of `bertfast embed`'s time on an AMX host, 8.5% on Zen 5's vdpbf16ps kernel).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bertfast.tools.bench.measure import interleaved  # noqa: E402

SHAPES = {  # name: (lengths, heads, head_dim)
    "minilm": ([24 + (32 * i) // 23 for i in range(24)], 12, 32),
    "short": ([12] * 64, 12, 32),
    "bert-base": ([128] * 8, 12, 64),
    "ragged": ([16 + (112 * i) // 7 for i in range(8)], 12, 64),
}
DTYPES = ("fp32", "bf16-products", "bf16")


def inputs(shape: str, dtype: str, seed: int = 0):
    lengths, heads, d = SHAPES[shape]
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(sum(lengths), 3, heads, d, generator=g)
    if dtype == "bf16":
        qkv = qkv.to(torch.bfloat16)
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
    flops = sum(4 * n * n * d * heads for n in lengths)
    return (qkv[:, 0], qkv[:, 1], qkv[:, 2], cu, max(lengths), d ** -0.5), dtype == "bf16-products", flops


def row(shape: str, dtype: str, threads: int, caps: list[str], rounds: int) -> list[dict]:
    from bertfast import _C
    from bertfast.backends.cpu import isa

    args, bf16_products, flops = inputs(shape, dtype)

    def call():
        return _C.attention(*args, bf16_products=bf16_products)

    _C.set_num_threads(threads)
    outputs, calls = {}, None
    for cap in caps:  # each cap's output once, and the burst length from the first cap's speed
        with isa.on_cap(cap):
            outputs[cap] = call().float()
            if calls is None:
                start, n = time.perf_counter(), 0
                while time.perf_counter() - start < 0.005 or n < 3:
                    call()
                    n += 1
                calls = n

    def burst(cap):
        def timed():
            with isa.on_cap(cap):
                start = time.perf_counter()
                for _ in range(calls):
                    call()
                return (time.perf_counter() - start) / calls
        return timed

    times = interleaved({cap: burst(cap) for cap in caps}, rounds, warmup=1)
    first = outputs[caps[0]]
    out = []
    for cap in caps:
        med = statistics.median(times[cap])
        out.append({"shape": shape, "dtype": dtype, "threads": threads, "cap": cap, "us": med * 1e6,
                    "gflops": flops / med / 1e9, "calls_per_burst": calls,
                    "max_abs_diff_vs_first": float((outputs[cap] - first).abs().max())})
    return out


def main() -> int:
    from bertfast import _C
    from bertfast.backends.cpu import isa

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--caps", default=None, help="default: every cap this CPU runs but amx_emulated (slow)")
    parser.add_argument("--shapes", default="minilm,short,bert-base,ragged")
    parser.add_argument("--dtypes", default="fp32,bf16-products,bf16")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    caps = args.caps.split(",") if args.caps else [c for c in reversed(isa.supported_caps()) if c != isa.EMULATED]
    shapes, dtypes = args.shapes.split(","), args.dtypes.split(",")
    for value, known, what in ((caps, isa.CAPS, "cap"), (shapes, SHAPES, "shape"), (dtypes, DTYPES, "dtype")):
        if set(value) - set(known):
            parser.error(f"unknown {what} {sorted(set(value) - set(known))}: use some of {list(known)}")
    for cap in caps:
        reason = isa.unsupported(cap)
        if reason:
            parser.error(reason)
    threads_before = _C.num_threads()
    info = isa.cpu_info()
    print(f"cpu {info['cpu']}, caps {', '.join(caps)}; microseconds a call (median of {args.rounds} interleaved "
          f"bursts), GFLOP/s, max |out - {caps[0]}'s|", flush=True)
    rows = []
    try:
        for shape in shapes:
            for dtype in dtypes:
                for threads in (int(t) for t in args.threads.split(",")):
                    got = row(shape, dtype, threads, caps, args.rounds)
                    rows += got
                    cells = "  ".join(f"{r['cap']} {r['us']:8.1f} us {r['gflops']:6.1f} "
                                      f"({r['max_abs_diff_vs_first']:.1e})" for r in got)
                    print(f"{shape:<9} {dtype:<13} {threads}t  {cells}", flush=True)
    finally:
        _C.set_num_threads(threads_before)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": info, "rounds": args.rounds, "rows": rows}, f, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
