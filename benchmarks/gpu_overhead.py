"""Where a small forward's time goes on a GPU: the host stages of one `Encoder` call, the graph's own GPU time, and
torch.profiler's table. For the launch-bound rows of the GPU bench (b1 x s16), where the engine's time is mostly
not the kernels'.

    python3 benchmarks/gpu_overhead.py --out DIR [--workloads b1xs16,b8xs128] [--dtype fp16] [--calls 200]

Writes DIR/overhead.json (per workload: the median microseconds of each host stage, each followed by a device
sync, and of the whole call; the median GPU time of the captured graph's replay, timed with CUDA events) and
DIR/profile.txt (torch.profiler's table of 50 calls of the first workload, by self CPU time). Needs CUDA, but for
`--host-only`: the stages that run on the host whatever the device (inputs to the host, check_inputs, pack, the host
side of the one copy to the device), timed on this CPU, each a median of --calls.
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

from bertfast import Encoder  # noqa: E402
from bertfast.encoder import check_inputs, to_host  # noqa: E402
from bertfast.engine import to_device  # noqa: E402
from bertfast.padding import pad  # noqa: E402
from bertfast.tools import workloads  # noqa: E402
from bertfast.tools.workloads import Workload  # noqa: E402

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def _median_us(fn, calls: int) -> float:
    times = []
    for _ in range(calls):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


@torch.inference_mode()  # as Engine.forward: the graphs' static buffers are inference tensors
def stages(enc: Encoder, inputs: dict, calls: int) -> dict:
    """Median microseconds of each stage of `enc(**inputs)` as `Encoder.forward` runs them on a GPU (synced after
    each): the inputs to the host, checked and packed there, moved in one transfer, the layer stack, pad, pooler."""
    eng = enc.engine
    has_pooler = eng.weights.pooler_weight is not None
    host = to_host(inputs["input_ids"], inputs["attention_mask"], inputs.get("token_type_ids"))

    def check():
        return check_inputs(enc.config, *host, None, has_pooler, "cpu")

    ids, mask, types, positions = check()
    B, S = ids.shape
    packed, host_indices = eng.pack(ids, mask, types, positions)
    tokens, indices = to_device(packed, host_indices, enc.device)
    states = eng.run(tokens, False)
    last = pad(states[-1], indices, B, S)
    out = {
        "inputs to host": _median_us(lambda: to_host(inputs["input_ids"], inputs["attention_mask"],
                                                     inputs.get("token_type_ids")), calls),
        "check_inputs (host)": _median_us(check, calls),
        "pack (host)": _median_us(lambda: eng.pack(ids, mask, types, positions), calls),
        "to device": _median_us(lambda: to_device(packed, host_indices, enc.device), calls),
        "run (graph replay + fill)": _median_us(lambda: eng.run(tokens, False), calls),
        "pad": _median_us(lambda: pad(states[-1], indices, B, S), calls),
        "whole call": _median_us(lambda: enc(**inputs), calls),
    }
    if has_pooler:
        out["pooler"] = _median_us(lambda: eng.backend.linear(last[:, 0].contiguous(), eng.weights.pooler_weight,
                                                              eng.weights.pooler_bias, "tanh"), calls)
    return out


@torch.inference_mode()
def host_only(args) -> int:
    """The host stages of a call, on this CPU (the torch backend's engine: the stages do not depend on it)."""
    import platform

    model = workloads.random_hf_model(args.config, 0, attn_implementation="eager")
    enc = Encoder.from_hf(model, backend="torch", dtype=torch.float32)
    eng = enc.engine
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    result = {"cpu": cpu, "torch": torch.__version__, "config": args.config, "calls": args.calls, "workloads": {}}
    for name in args.workloads.split(","):
        inputs = Workload.parse(name).make_batch(workloads.model_config(args.config), seed=0).inputs()
        host = to_host(inputs["input_ids"], inputs["attention_mask"], inputs.get("token_type_ids"))
        checked = check_inputs(enc.config, *host, None, eng.weights.pooler_weight is not None, "cpu")
        packed, indices = eng.pack(*checked)

        def median_us(fn):
            times = []
            for _ in range(args.calls):
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e6)
            return round(statistics.median(times), 1)

        row = {"inputs to host": median_us(lambda: to_host(inputs["input_ids"], inputs["attention_mask"],
                                                             inputs.get("token_type_ids"))),
               "check_inputs (host)": median_us(lambda: check_inputs(enc.config, *host, None, True, "cpu")),
               "pack (host)": median_us(lambda: eng.pack(*checked)),
               "to device (host side: one buffer)": median_us(lambda: to_device(packed, indices, "cpu"))}
        row["sum"] = round(sum(row.values()), 1)
        result["workloads"][name] = row
        print(name, json.dumps(row), flush=True)
    with open(os.path.join(args.out, "host_overhead.json"), "w") as f:
        json.dump(result, f, indent=1)
    return 0


def graph_gpu_us(enc: Encoder, inputs: dict, calls: int) -> float | None:
    """Median GPU microseconds of one replay of the graph this input's bucket captured (CUDA events)."""
    runner = enc.engine.run
    entries = getattr(runner, "_entries", {})
    graphs = [e.graph for e in entries.values() if e.graph is not None]
    if len(graphs) != 1:
        return None
    graph, times = graphs[0], []
    for _ in range(calls):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--workloads", default="b1xs16,b8xs128")
    parser.add_argument("--dtype", default="fp16", choices=tuple(DTYPES))
    parser.add_argument("--config", default="bert-base")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--host-only", action="store_true", help="time only the host stages, on this CPU")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() and not args.host_only:
        print("gpu_overhead: needs a CUDA device (or --host-only)", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    if args.host_only:
        return host_only(args)
    model = workloads.random_hf_model(args.config, 0, attn_implementation="eager")
    result = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "config": args.config,
              "dtype": args.dtype, "calls": args.calls, "workloads": {}}
    profiled = False
    for name in args.workloads.split(","):
        w = Workload.parse(name)
        enc = Encoder.from_hf(model.to("cuda"), backend="triton", dtype=DTYPES[args.dtype])  # one graph per bucket
        inputs = w.make_batch(workloads.model_config(args.config), seed=0).to("cuda").inputs()
        for _ in range(3):
            enc(**inputs)
        torch.cuda.synchronize()
        row = {"host_us": stages(enc, inputs, args.calls), "graph_gpu_us": graph_gpu_us(enc, inputs, args.calls)}
        result["workloads"][name] = row
        print(name, json.dumps(row), flush=True)
        if not profiled:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(50):
                    enc(**inputs)
                torch.cuda.synchronize()
            table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40)
            # The graph's kernels, seen one by one: the same forward launched eagerly.
            eager = Encoder.from_hf(model, backend="triton", dtype=DTYPES[args.dtype], graphs=False)
            for _ in range(3):
                eager(**inputs)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as kprof:
                for _ in range(20):
                    eager(**inputs)
                torch.cuda.synchronize()
            kernels = kprof.key_averages().table(sort_by="self_device_time_total", row_limit=30)
            with open(os.path.join(args.out, "profile.txt"), "w") as f:
                f.write(f"{name} {args.dtype} {result['device']}: 50 calls with graphs, by host time\n{table}\n\n"
                        f"{name} {args.dtype}: 20 eager calls, by GPU time\n{kernels}\n")
            profiled = True
    with open(os.path.join(args.out, "overhead.json"), "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
