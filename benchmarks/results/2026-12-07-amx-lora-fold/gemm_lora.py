import time, statistics, torch, os
from bertfast.backends.cpu import linear as L, lora
torch.manual_seed(0)
def bench(M, N, K, segs, nf=8, r=16, rows_per=128):
    x = torch.randn(M, K).bfloat16()
    W = torch.randn(N, K).bfloat16() * 0.02
    P = L.PackedLinear(W); bias = torch.randn(N).bfloat16()
    facs = [lora.pack_factors(torch.randn(segs*r, K)*0.02, torch.block_diag(*[torch.randn(N//segs, r)*0.02 for _ in range(segs)]), segs, tiles=True, expand=True) for _ in range(nf)]
    index = ((torch.arange(M) // rows_per) % nf).to(torch.int32)
    term = lora.term(x, index, facs)
    f0 = lambda: L.linear(x, P, bias, "none", None, None)
    f1 = lambda: L.linear(x, P, bias, "none", None, term)
    f2 = lambda: lora.term(x, index, facs)
    ts = {0: [], 1: [], 2: []}
    for f in (f0, f1, f2): f()
    for _ in range(30):
        for k, f in ((0, f0), (1, f1), (2, f2)):
            t = time.perf_counter(); f(); ts[k].append(time.perf_counter() - t)
    m = {k: statistics.median(v) * 1e3 for k, v in ts.items()}
    print(f"M{M} N{N} K{K}: gemm {m[0]:.3f} ms  +fold {m[1]:.3f} (x{m[1]/m[0]:.3f})  shrink {m[2]:.3f} ms (x{(m[1]+m[2])/m[0]:.3f})")
for M in (1024, 128):
  for N, K, segs in ((2304, 768, 3), (768, 768, 1), (3072, 768, 1), (768, 3072, 1)):
    bench(M, N, K, segs)
print("---")
bench(1024, 2304, 768, 1)
bench(1024, 2304, 768, 3)
bench(1024, 2304, 768, 3, rows_per=1024)
bench(1024, 2304, 768, 3, nf=1)
