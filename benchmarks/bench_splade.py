"""Texts/s of SPLADE sparse embeddings, end to end (tokenization included): sentence-transformers'
`SparseEncoder.encode` (torch, fp32) against `bertfast.SparseEncoder.encode` (cpu backend, fp32 unless --dtypes says
more), on a random SPLADE checkpoint saved by sentence-transformers (BertForMaskedLM with BERT's 30522-token
vocabulary, SpladePooling max / relu; the default model's tokenizer) and ~40-token texts.

    python benchmarks/bench_splade.py [--texts 256] [--hidden 256] [--layers 4] [--rounds 3] [--dtypes fp32,bf16]

Every bertfast row is checked against sentence-transformers on the texts before it is timed (fp32: values within
1e-5 of the largest, by `bertfast.accuracy.rel_error`; bf16/int8: the error is printed); a failed fp32 check stops
the run. Rows are timed interleaved in one process (`bertfast.tools.bench.measure.interleaved`): medians and the
ratio to sentence-transformers in the same run.
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
         "sunny").split()


def checkpoint(path: str, hidden: int, layers: int) -> str:
    """A random SparseEncoder directory (Transformer fill-mask + SpladePooling) as sentence-transformers saves it."""
    from sentence_transformers import SparseEncoder
    from sentence_transformers.base.modules import Transformer
    from sentence_transformers.sparse_encoder.modules import SpladePooling

    mlm = save_random_bert(path + "-mlm", hidden, layers, head="mlm")
    SparseEncoder(modules=[Transformer(mlm, transformer_task="fill-mask"), SpladePooling("max")],
                  device="cpu").save(path)
    return path


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--texts", type=int, default=256)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--dtypes", default="fp32", help="bertfast rows: fp32, bf16, int8 (comma separated)")
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore")
    import torch
    from sentence_transformers import SparseEncoder as StSparseEncoder

    import bertfast
    from bertfast.accuracy import rel_error
    from bertfast.tools.bench.measure import interleaved, quantile, timer

    rng = random.Random(0)
    texts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(22, 36))) for _ in range(args.texts)]
    tmp = tempfile.mkdtemp(prefix="bench-splade-")
    try:
        path = checkpoint(os.path.join(tmp, "splade"), args.hidden, args.layers)
        theirs = StSparseEncoder(path, device="cpu")
        reference = theirs.encode(texts, batch_size=args.batch_size).to_dense().double()
        tokens = sum(len(e.ids) for e in theirs.tokenizer.backend_tokenizer.encode_batch(texts)) / len(texts)
        rows = {"sentence-transformers": lambda: theirs.encode(texts, batch_size=args.batch_size)}
        dtypes = {"fp32": None, "bf16": torch.bfloat16, "int8": "int8"}
        for name in args.dtypes.split(","):
            ours = bertfast.SparseEncoder.from_pretrained(path, backend="cpu", dtype=dtypes[name])
            err = rel_error(ours.encode(texts, batch_size=args.batch_size).to_dense(), reference)
            print(f"bertfast-{name}: max error {err:.2e} of the largest value against sentence-transformers")
            if name == "fp32" and err > 1e-5:
                raise SystemExit(f"bertfast-fp32 differs from sentence-transformers by {err:.2e} > 1e-5: no timing")
            rows[f"bertfast-{name}"] = (lambda m: lambda: m.encode(texts, batch_size=args.batch_size))(ours)
        times = interleaved({name: timer(fn) for name, fn in rows.items()}, args.rounds, warmup=1)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    cpu = bertfast.cpu_info()
    print(f"{args.texts} texts of {tokens:.1f} tokens on average, hidden {args.hidden}, {args.layers} layers, "
          f"vocab 30522; CPU {cpu['cpu']}, tier {cpu['active']}, {torch.get_num_threads()} threads")
    base = quantile(times["sentence-transformers"], 0.5)
    for name, ts in times.items():
        med = quantile(ts, 0.5)
        print(f"{name:24s} {args.texts / med:9.1f} texts/s  median {med * 1e3:8.1f} ms  "
              f"[{min(ts) * 1e3:.1f}, {max(ts) * 1e3:.1f}]  x{base / med:.2f}")


if __name__ == "__main__":
    main()
