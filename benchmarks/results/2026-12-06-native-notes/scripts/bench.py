import sys, time, json, statistics, torch
import bertfast
dtype = sys.argv[1]
enc = bertfast.Encoder.from_pretrained("/tmp/cmp/models/bertbase", dtype=dtype, backend="cpu")
g = torch.Generator().manual_seed(0)
res = {}
for name, (B, S) in {"b1xs16": (1, 16), "b8xs128": (8, 128)}.items():
    ids = torch.randint(5, 1000, (B, S), generator=g); mask = torch.ones(B, S, dtype=torch.long)
    for _ in range(3): enc(ids, mask)
    n = 30 if S == 16 else 6
    ts = []
    for _ in range(n):
        t = time.perf_counter(); enc(ids, mask); ts.append(time.perf_counter() - t)
    res[name] = statistics.median(ts) * 1e3
print(json.dumps(res))
