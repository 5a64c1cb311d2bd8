"""Texts/s for embedding a corpus, end to end (tokenization included), on the default all-MiniLM-L6-v2:
`SentenceTransformer.encode` (torch), `Encoder.encode` and `bertfast embed` (reading, tokenizing,
embedding, writing Parquet shards; its peak RSS in its own process), fp32 and int8.

    python benchmarks/bench_embed.py [--texts 20000] [--rows st,encode,embed] [--dtypes fp32,int8]

The corpus is deterministic (`corpus`: 1-60 words from a fixed vocabulary). Each row is validated before
it is timed: Encoder.encode in fp32 must match SentenceTransformer.encode within 1e-5 on a sample.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import resource
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORDS = ("the a cat dog sat on mat quick brown fox jumps over lazy river mountain data engine vector search "
         "model token cafe naive 42 3.14 well-known e-mail, (brackets) question? yes! market bank rate "
         "bread recipe starter home kitchen city train station ticket weather forecast rain sunny").split()


# The command in a fresh process, then its own peak RSS (VmHWM starts over at exec, unlike ru_maxrss,
# which a forked child inherits from this process).
EMBED_AND_REPORT_PEAK = ("import sys; from bertfast.tools.cli import main; code = main(sys.argv[1:]); "
                         "print(next(l for l in open('/proc/self/status') if l.startswith('VmHWM'))); "
                         "sys.exit(code)")


def corpus(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 60))) for _ in range(n)]


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--texts", type=int, default=20000)
    parser.add_argument("--rows", default="st,encode,embed")
    parser.add_argument("--dtypes", default="fp32,int8")
    args = parser.parse_args()
    import numpy as np
    import torch

    import bertfast

    path = bertfast.default_model_path()
    texts = corpus(args.texts)
    rows, dtypes = args.rows.split(","), args.dtypes.split(",")
    info = bertfast.cpu_info()
    print(f"cpu: {info['cpu']}, tier {info['active']}, torch threads {torch.get_num_threads()}, "
          f"{len(texts)} texts, {sum(len(t.split()) for t in texts) / len(texts):.1f} words/text")
    results = []
    sample = texts[:200]
    if "st" in rows:
        from sentence_transformers import SentenceTransformer

        st = SentenceTransformer(path, device="cpu")
        ref = st.encode(sample)
        _, seconds = timed(lambda: st.encode(texts, batch_size=32))
        results.append(("SentenceTransformer.encode (torch)", "fp32", len(texts) / seconds))
        del st
    if "encode" in rows:
        for dtype in dtypes:
            enc = bertfast.Encoder.from_pretrained(path, dtype=None if dtype == "fp32" else dtype)
            got = enc.encode(sample, convert_to_numpy=True)
            if dtype == "fp32" and "st" in rows:
                err = float(np.abs(got - ref).max())
                assert err <= 1e-5, f"Encoder.encode differs from SentenceTransformer.encode by {err}"
            _, seconds = timed(lambda: enc.encode(texts, batch_size=32))
            results.append(("Encoder.encode", dtype, len(texts) / seconds))
    if "embed" in rows:
        with tempfile.TemporaryDirectory() as tmp:
            src = os.path.join(tmp, "corpus.txt")
            with open(src, "w", encoding="utf-8") as f:
                f.writelines(t + "\n" for t in texts)
            for dtype in dtypes:
                out = os.path.join(tmp, f"out-{dtype}")
                cmd = [sys.executable, "-c", EMBED_AND_REPORT_PEAK, "embed", src, out]
                cmd += [] if dtype == "fp32" else ["--dtype", dtype]
                proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT,
                                      env={**os.environ, "PYTHONPATH": ROOT})
                if proc.returncode:
                    raise SystemExit(proc.stderr)
                rate = float(re.search(r"\(([\d.]+) texts/s", proc.stdout).group(1))
                peak = int(re.search(r"VmHWM:\s+(\d+) kB", proc.stdout).group(1)) / 1024
                results.append((f"bertfast embed (peak RSS {peak:.0f} MiB)", dtype, rate))
    base = next((r[2] for r in results if r[0].startswith("Sentence")), None)
    print(f"\n{'row':<48} {'dtype':<6} {'texts/s':>9} {'vs ST':>7}")
    for name, dtype, rate in results:
        ratio = f"x{rate / base:.2f}" if base else "-"
        print(f"{name:<48} {dtype:<6} {rate:>9.1f} {ratio:>7}")
    print(f"\nthis process: peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
