"""One build's outputs under the process's BERTFAST_ISA: MiniLM Encoder.encode on texts, random models' forward."""
import sys, random, hashlib, torch
out = sys.argv[1]
import bertfast
if hasattr(bertfast, "cap_libraries"):
    bertfast.cap_libraries()
random.seed(0)
words = "the quick brown fox jumps over a lazy dog while engines encode many short and some much longer texts".split()
texts = [" ".join(random.choice(words) for _ in range(random.choice([1, 3, 7, 20, 60, 150]))) for _ in range(70)]
res = {}
g = torch.Generator().manual_seed(1)
lengths = [1, 7, 33, 64, 129, 200, 17, 5, 90]
S = max(lengths)
ids = torch.randint(5, 1000, (len(lengths), S), generator=g)
mask = torch.zeros(len(lengths), S, dtype=torch.long)
for i, n in enumerate(lengths):
    mask[i, :n] = 1
for dtype in ("float32", "bfloat16", "int8"):
    enc = bertfast.Encoder.from_pretrained(bertfast.default_model_path(), dtype=dtype, backend="cpu")
    res[f"minilm-{dtype}"] = enc.encode(texts, batch_size=32)
    for name in ("bert", "bert768", "mpnet", "deberta", "modernbert"):
        m = bertfast.Encoder.from_pretrained(f"/tmp/cmp/models/{name}", dtype=dtype, backend="cpu")
        res[f"{name}-{dtype}"] = m(ids, mask).last_hidden_state
torch.save(res, out)
print(out, len(res))
