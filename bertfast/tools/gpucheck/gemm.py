"""The `gemm` stage of `bertfast gpucheck`: each fused GEMM of the triton backend (QKV, attention out + residual, FFN in
+ activation, FFN out + residual) against cuBLAS through torch (`addmm` + the unfused epilogue, `backends.gemm_choice`)
per (M bucket, N, K, dtype) on this GPU. Both outputs are checked against an fp32 product first (a wrong path is a
failure, not a timing); then the two are timed in interleaved rounds (`measure.interleaved`, CUDA events around the
replay of a CUDA graph holding a burst of calls: the kernels' time, as the engine's graphs see it, not the launches'). cuBLAS is chosen only where it wins by more than MARGIN, since the fused kernel keeps batch
invariance and the graph buckets' bits. On Hopper (sm_90) each tile of the TMA kernel (`kernels/triton/linear_tma.py`)
is timed beside them; as its choice holds for every M of a shape, a shape gets a "tma" entry only where one tile is no
slower than the Triton kernel at any measured M bucket (within MARGIN) and faster over them all by more than MARGIN.
The result holds the table to commit as `bertfast/backends/gemm_table.json`.
"""

from __future__ import annotations

import platform
import statistics

import torch

from bertfast.backends.cuda import gemm_choice
from bertfast.kernels import activation
from bertfast.tools.bench.measure import interleaved, time_call
from bertfast.accuracy import TABLE
from bertfast.tools.workloads import model_config

M_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
QUICK_M_BUCKETS = (16, 128, 1024, 4096, 16384)
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
MARGIN = 0.05  # cuBLAS must be this much faster to be chosen (a TMA tile: `tma_entry`)
SAMPLE_S = 5e-4  # each timed sample is a burst of calls at least this long
ROUNDS = 15


def shapes(config_name: str = "bert-base") -> list[tuple[str, int, int, str]]:
    """(op, N, K, activation) of one layer's fused GEMMs for a named config."""
    cfg = model_config(config_name)
    H, I = cfg.hidden_size, cfg.intermediate_size
    return [("qkv", 3 * H, H, "none"), ("linear_residual", H, H, "none"), (f"linear_{cfg.activation}", I, H,
            cfg.activation), ("linear_residual", H, I, "none")]


def tma_tiles(arch: str | None, n: int, k: int) -> list[str]:
    """The TMA kernel's tiles to time for an (N, K) on `arch`: all of them on a TMA arch where N and K suit TMA."""
    from bertfast.kernels.triton.linear_tma import ALIGN, TILES

    return list(TILES) if arch in gemm_choice.TMA_ARCHS and n % ALIGN == 0 and k % ALIGN == 0 else []


def _paths(op, x, w, b, act, residual, heads, tiles=()):
    """{name: callable} of one shape, each returning one tensor (QKV: the three planes stacked): "triton", "cublas",
    and "tma_<tile>" for each of `tiles`."""
    from bertfast.kernels.triton import linear, qkv

    if op == "qkv":
        paths = {"triton": lambda: torch.stack(qkv.qkv(x, w, b, heads)),
                 "cublas": lambda: torch.stack(gemm_choice.cublas_qkv(x, w, b, heads))}
        paths.update({f"tma_{t}": lambda t=t: torch.stack(gemm_choice.tma_qkv(x, w, b, heads, t)) for t in tiles})
        return paths
    paths = {"triton": lambda: linear.linear(x, w, b, activation=act, residual=residual),
             "cublas": lambda: gemm_choice.cublas_linear(x, w, b, act, residual)}
    paths.update({f"tma_{t}": lambda t=t: gemm_choice.tma_linear(x, w, b, act, residual, t) for t in tiles})
    return paths


def _graphed(fn, reps):
    """A timer of one call of `fn`: `reps` calls captured in one CUDA graph, replayed, the time divided by `reps`.
    Launched one by one, a GEMM of a few microseconds would time its launch, not the kernel (as the engine's graphs
    do not)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # a warm-up call off the capture stream, as torch's graph notes advise
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    return lambda: time_call(graph.replay, device="cuda")[0] / reps


def measure(op: str, m: int, n: int, k: int, act: str, dtype: torch.dtype, seed: int = 0, tiles=()) -> dict:
    """One shape: every path (Triton, cuBLAS, the TMA kernel's `tiles`) validated against an fp32 product, then timed;
    the table entry with its times (`<path>_us`) and the M bucket's choice between Triton and cuBLAS."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to("cuda", dtype)
    w = (torch.randn(n, k, generator=g) * k ** -0.5).to("cuda", dtype)
    b = (torch.randn(n, generator=g) * 0.1).to("cuda", dtype)
    residual = torch.randn(m, n, generator=g).to("cuda", dtype) if op == "linear_residual" else None
    heads = max(1, n // 3 // 64)
    ref = x.float() @ w.float().t() + b.float()
    ref = activation.apply(ref, act) + (residual.float() if residual is not None else 0)
    entry = {"op": op, "m_bucket": m, "n": n, "k": k, "dtype": [k_ for k_, v in DTYPES.items() if v == dtype][0]}
    paths = _paths(op, x, w, b, act, residual, heads, tiles)
    scale = ref.abs().max().item()
    for name, fn in paths.items():
        try:
            got = fn()
        except Exception as e:  # a path that cannot run this shape is a failure to report, not a crash of the stage
            return {**entry, "choice": "triton", "error": f"{name}: {type(e).__name__}: {e}"}
        out = got.float().reshape(ref.shape[0], -1) if op != "qkv" else got.float().permute(1, 0, 2, 3).reshape(m, n)
        entry[f"{name}_rel_err"] = (out - ref).abs().max().item() / scale
        if name.startswith("tma_"):  # a TMA choice holds for every M: its first row alone must be the same bits
            alone = _paths(op, x[:1], w, b, act, None if residual is None else residual[:1], heads,
                           [name[4:]])[name]()
            entry[f"{name}_invariant"] = torch.equal(alone, got[:, :1] if op == "qkv" else got[:1])
    if not all(entry[f"{p}_rel_err"] <= TABLE[dtype] for p in paths):
        return {**entry, "choice": "triton", "error": f"a path is off the fp32 product by more than {TABLE[dtype]}"}
    if not all(entry.get(f"{p}_invariant", True) for p in paths):
        return {**entry, "choice": "triton", "error": "a TMA tile's row alone differs from the same row in the batch"}
    for fn in paths.values():  # autotune, compile, cuBLAS heuristics
        fn()
    single = time_call(paths["triton"], device="cuda")[0]  # launch-bound at small M: reps errs high, never low
    reps = max(4, min(200, int(SAMPLE_S / max(single, 1e-6))))
    times = interleaved({name: _graphed(fn, reps) for name, fn in paths.items()}, ROUNDS, warmup=1)
    us = {name: statistics.median(t) * 1e6 for name, t in times.items()}
    choice = "cublas" if us["cublas"] < us["triton"] * (1 - MARGIN) else "triton"
    return {**entry, **{f"{name}_us": round(t, 2) for name, t in us.items()}, "reps": reps, "choice": choice}


def tma_entry(rows: list[dict], tiles) -> dict | None:
    """The "tma" table entry of one (op, N, K, dtype) from its measured M buckets `rows`, or None: the tile with the
    least total time among those no slower than the Triton kernel at any bucket (within MARGIN) and faster in total by
    more than MARGIN. It holds for every M, so it must not lose at any measured one."""
    if not tiles or not rows or any("error" in r for r in rows):
        return None
    triton_total = sum(r["triton_us"] for r in rows)
    best = None
    for tile in tiles:
        times = [r[f"tma_{tile}_us"] for r in rows]
        total = sum(times)
        if all(t <= r["triton_us"] * (1 + MARGIN) for t, r in zip(times, rows)) and \
                total < triton_total * (1 - MARGIN) and (best is None or total < best[1]):
            best = (tile, total)
    if best is None:
        return None
    first = rows[0]
    return {"op": first["op"], "m_bucket": gemm_choice.ALL_M, "n": first["n"], "k": first["k"], "dtype": first["dtype"],
            "arch": first["arch"], "choice": "tma", "tile": best[0], "m_buckets": [r["m_bucket"] for r in rows],
            "triton_us": round(triton_total, 2), "tma_us": round(best[1], 2)}


def run_stage(quick: bool = False, config_name: str = "bert-base") -> dict:
    """Every shape of `config_name` x M bucket x dtype: the stage result, its `table` ready to commit."""
    arch = gemm_choice.arch_of("cuda")
    entries, tma_entries = [], []
    for dtype in DTYPES.values():
        for op, n, k, act in shapes(config_name):
            tiles = tma_tiles(arch, n, k)
            rows = []
            for m in QUICK_M_BUCKETS if quick else M_BUCKETS:
                entry = {**measure(op, m, n, k, act, dtype, tiles=tiles), "arch": arch}
                rows.append(entry)
                tma = "".join(f", tma {t} {entry.get(f'tma_{t}_us')} us" for t in tiles)
                print(f"gemm {entry['dtype']} {op} M={m} N={n} K={k}: triton {entry.get('triton_us')} us, cublas "
                      f"{entry.get('cublas_us')} us{tma} -> {entry['choice']} {entry.get('error', '')}", flush=True)
            entries += rows
            chosen = tma_entry(rows, tiles)
            if chosen is not None:
                tma_entries.append(chosen)
                print(f"gemm {chosen['dtype']} {op} N={n} K={k}: tma {chosen['tile']} at every M ({chosen['tma_us']} "
                      f"us over the buckets against triton's {chosen['triton_us']} us)", flush=True)
    errors = [e for e in entries if "error" in e]
    table = {"version": 1, "measured_on": {"gpu": torch.cuda.get_device_name(), "arch": arch,
                                           "torch": torch.__version__, "python": platform.python_version(),
                                           "config": config_name, "margin": MARGIN},
             "command": f"python -m bertfast gpucheck --stages gemm{' --quick' if quick else ''}",
             "entries": [{k: e[k] for k in ("op", "m_bucket", "n", "k", "dtype", "arch", "choice", "triton_us",
                                            "cublas_us")} for e in entries if "error" not in e] + tma_entries}
    return {"status": "fail" if errors else "pass",
            "reason": f"{len(errors)} shapes failed validation" if errors else "",
            "cublas_choices": sum(e["choice"] == "cublas" for e in entries), "tma_choices": len(tma_entries),
            "entries": entries, "table": table}
