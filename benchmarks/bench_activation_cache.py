"""The native ops' activation cache on and off (docs/threads.md#memory-the-activation-cache): one forward's wall
time, CPU time (user + system: the page faults' kernel time is in it) and minor page faults, each setting in its own
process, alternating, on a random model of `bertfast.tools.workloads`.

    python3 benchmarks/bench_activation_cache.py [--model bert-base] [--dtype fp32] [--workload b32xs128] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

CHILD = """
import json, resource, sys, time, torch, bertfast
from bertfast.tools import workloads as W
name, dtype, wl, reps = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
enc = bertfast.Encoder.from_hf(W.random_hf_model(name), backend="cpu", dtype=dtype)
batch = W.Workload.parse(wl).make_batch(W.model_config(name)).inputs()
with torch.inference_mode():
    for _ in range(2):
        enc(**batch)
    walls, cpus, faults = [], [], []
    for _ in range(reps):
        time.sleep(0.1)
        f0, c0, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.process_time(), time.perf_counter()
        enc(**batch)
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
med = lambda v: sorted(v)[len(v) // 2]  # noqa: E731
print(json.dumps(dict(wall_ms=med(walls) * 1e3, cpu_ms=med(cpus) * 1e3, faults=med(faults))))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="bert-base")
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--workload", default="b32xs128")
    ap.add_argument("--rounds", type=int, default=3, help="processes per setting, alternating")
    ap.add_argument("--reps", type=int, default=3, help="timed forwards per process (median)")
    args = ap.parse_args()
    import bertfast

    print(f"cpu: {bertfast.cpu_info()}; {args.model} {args.dtype} {args.workload}, "
          f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}")
    print(f"{'cache':>6} {'wall ms':>9} {'cpu ms':>9} {'faults':>9}")
    for _ in range(args.rounds):
        for cache in ("0", "1024"):
            env = dict(os.environ, BERTFAST_ACTIVATION_CACHE_MB=cache)
            run = subprocess.run([sys.executable, "-c", CHILD, args.model, args.dtype, args.workload, str(args.reps)],
                                 env=env, capture_output=True, text=True, check=True)
            r = json.loads(run.stdout.strip().splitlines()[-1])
            print(f"{'on' if cache != '0' else 'off':>6} {r['wall_ms']:9.1f} {r['cpu_ms']:9.1f} {r['faults']:9.0f}")


if __name__ == "__main__":
    main()
