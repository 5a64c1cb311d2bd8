import sys, torch, numpy as np
def raw(x):
    x = torch.as_tensor(np.ascontiguousarray(x)) if isinstance(x, np.ndarray) else x.contiguous()
    return x.dtype, x.shape, x.view(torch.uint8).reshape(-1)
a, b = torch.load(sys.argv[1], weights_only=False), torch.load(sys.argv[2], weights_only=False)
bad = []
for k in a:
    da, sa, ra = raw(a[k]); db, sb, rb = raw(b[k])
    if da != db or sa != sb or not torch.equal(ra, rb):
        bad.append(k)
print(sys.argv[1].split('/')[-1], "vs", sys.argv[2].split('/')[-1], f"{len(a) - len(bad)}/{len(a)} byte-equal", bad)
