"""Texts/s of ColBERT token vectors, end to end (tokenization included): PyLate's `models.ColBERT.encode` (torch,
fp32) against `bertfast.ColBERT.encode` (cpu backend, fp32 unless --dtypes says more), queries and documents, on a
random ColBERT checkpoint saved by PyLate (a BertModel with the default model's tokenizer, a Dense projection to 128,
PyLate's defaults: query_length 32 with [MASK] expansion not attended to, document_length 180, punctuation skiplist).

    python benchmarks/bench_colbert.py [--queries 256] [--documents 128] [--hidden 384] [--layers 6] [--rounds 3]
                                       [--dtypes fp32,bf16]

PyLate 1.6 builds models with sentence-transformers 5.3 only (it pins it); where the environment has a later one,
put 5.3 on the path for this script alone: pip install --no-deps --target /tmp/st53 sentence-transformers==5.3.0,
then PYTHONPATH=/tmp/st53 python benchmarks/bench_colbert.py. Every bertfast row is checked against PyLate on the
texts before it is timed (the same token count per text; fp32: within 1e-5 of the largest value, by
`bertfast.accuracy.rel_error`, else the run stops; bf16/int8: the error is printed). Rows are timed interleaved in
one process (`bertfast.tools.bench.measure.interleaved`): medians and the ratio to PyLate in the same run.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import sys
import tempfile
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # random_bert, beside this file

from random_bert import save_random_bert  # noqa: E402

WORDS = ("the a cat dog sat on mat quick brown fox jumps over lazy river mountain data engine vector search model "
         "token market bank rate bread recipe starter home kitchen city train station ticket weather forecast rain "
         "sunny, it's (really) well-known: yes.").split()


def checkpoint(path: str, hidden: int, layers: int):
    """A random ColBERT built and saved by PyLate at `path`; returns the loaded PyLate model."""
    from pylate import models

    base = save_random_bert(path + "-base", hidden, layers)
    models.ColBERT(base, device="cpu", embedding_size=128).save(path)
    return models.ColBERT(path, device="cpu")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--queries", type=int, default=256)
    p.add_argument("--documents", type=int, default=128)
    p.add_argument("--hidden", type=int, default=384)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--dtypes", default="fp32", help="bertfast rows: fp32, bf16, int8 (comma separated)")
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore")
    import numpy as np
    import torch

    import bertfast
    from bertfast.accuracy import rel_error
    from bertfast.tools.bench.measure import interleaved, quantile, timer

    rng = random.Random(0)
    sets = {"queries": [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 14))) for _ in range(args.queries)],
            "documents": [" ".join(rng.choice(WORDS) for _ in range(rng.randint(40, 150)))
                          for _ in range(args.documents)]}
    tmp = tempfile.mkdtemp(prefix="bench-colbert-")
    times, tokens = {}, {}
    try:
        theirs = checkpoint(os.path.join(tmp, "colbert"), args.hidden, args.layers)
        dtypes = {"fp32": None, "bf16": torch.bfloat16, "int8": "int8"}
        ours = {name: bertfast.ColBERT.from_pretrained(os.path.join(tmp, "colbert"), backend="cpu",
                                                       dtype=dtypes[name]) for name in args.dtypes.split(",")}
        for kind, texts in sets.items():
            q = kind == "queries"
            reference = theirs.encode(texts, is_query=q, batch_size=args.batch_size)
            tokens[kind] = sum(len(r) for r in reference) / len(texts)
            rows = {"pylate": lambda t=texts, q=q: theirs.encode(t, is_query=q, batch_size=args.batch_size)}
            for name, model in ours.items():
                out = model.encode(texts, is_query=q, batch_size=args.batch_size)
                if [o.shape for o in out] != [r.shape for r in reference]:
                    raise SystemExit(f"bertfast-{name}: token counts differ from PyLate's on the {kind}: no timing")
                err = rel_error(torch.from_numpy(np.concatenate(out)),
                                torch.from_numpy(np.concatenate(reference)).double())
                print(f"bertfast-{name} {kind}: max error {err:.2e} of the largest value against PyLate")
                if name == "fp32" and err > 1e-5:
                    raise SystemExit(f"bertfast-fp32 differs from PyLate by {err:.2e} > 1e-5 on the {kind}: no timing")
                rows[f"bertfast-{name}"] = (lambda m, t, q: lambda: m.encode(
                    t, is_query=q, batch_size=args.batch_size))(model, texts, q)
            times[kind] = interleaved({name: timer(fn) for name, fn in rows.items()}, args.rounds, warmup=1)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    cpu = bertfast.cpu_info()
    print(f"hidden {args.hidden}, {args.layers} layers, dim 128; CPU {cpu['cpu']}, tier {cpu['active']}, "
          f"{torch.get_num_threads()} threads")
    for kind, rows in times.items():
        n = len(sets[kind])
        print(f"{n} {kind}, {tokens[kind]:.1f} output vectors each on average")
        base = quantile(rows["pylate"], 0.5)
        for name, ts in rows.items():
            med = quantile(ts, 0.5)
            print(f"  {name:16s} {n / med:9.1f} texts/s  median {med * 1e3:8.1f} ms  "
                  f"[{min(ts) * 1e3:.1f}, {max(ts) * 1e3:.1f}]  x{base / med:.2f}")


if __name__ == "__main__":
    main()
