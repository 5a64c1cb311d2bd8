"""LoRA terms of a packed batch whose rows use different adapters, SGMV-style (segmented gather matrix-vector, as
Punica and S-LoRA name it): two launches per slot whatever the number of adapters.

- shrink: s[t, :r] = x[t] A^T of token t's own adapter, (T, R) float32;
- expand: out[t] = s[t, :r] B^T of that adapter (the scale folded into B), (T, N) float32, zero for base rows: the
  `addend` the linear and QKV kernels add in their epilogue before the activation.

The rows come as tiles: runs of at most BLOCK_M consecutive tokens of one adapter (`tiles`: (row0, rows, adapter)
per tile). Each tile reads its adapter's factors through a table of pointers (`table`: a_ptr, b_ptr, rank per
adapter), so a forward mixing any number of adapters is still two launches per slot and no factor is copied.

Batch invariance by construction: fixed tiles (no autotuning, nothing keyed on T or on the other adapters), each
value an fp32 ("ieee") dot over K in BLOCK_K steps, then over the adapter's own rank in 16s; a row's place in its
tile never changes an element's arithmetic. Ranks are padded to 16 with zero rows of A and zero columns of B, which
add exact zeros.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._common import check_device, check_float

# One tile for every launch: BLOCK_M tokens; the shrink reads K in BLOCK_K steps, the expand writes BLOCK_N outputs;
# both step through the rank 16 at a time (the smallest tl.dot width).
BLOCK_M, BLOCK_K, BLOCK_N, BLOCK_R, NUM_WARPS = 32, 32, 64, 16, 4


@dataclass(frozen=True)
class Factors:
    """One adapter's factors of one slot on the triton backend: at = A^T (K, r16) and bt = B^T (r16, N), float32
    contiguous, rank r rounded up to 16 with zeros (a zero column of A^T gives s a zero that meets a zero row of
    B^T)."""
    at: torch.Tensor
    bt: torch.Tensor

    @property
    def rank(self) -> int:
        return self.at.shape[1]


def pack_factors(A: torch.Tensor, B: torch.Tensor) -> Factors:
    """A (r, K), B (N, r) (the scale folded into B) -> `Factors` on their device."""
    r, K = A.shape
    if B.dim() != 2 or B.shape[1] != r:
        raise ValueError(f"lora: B must be (N, r = {r}), got {tuple(B.shape)}")
    r16 = -(-r // BLOCK_R) * BLOCK_R
    at = torch.zeros(K, r16, dtype=torch.float32, device=A.device)
    at[:, :r] = A.T.float()
    bt = torch.zeros(r16, B.shape[0], dtype=torch.float32, device=B.device)
    bt[:r] = B.T.float()
    return Factors(at, bt)


def tiles(spans: list[tuple[int, int, int]], device) -> torch.Tensor:
    """(adapter, start, stop) runs of consecutive tokens -> the tile table (n, 3) int32, rows (row0, rows, adapter):
    each run cut into BLOCK_M-token tiles from its start. The adapter -1 (base rows) stays -1."""
    out = [(t0, min(BLOCK_M, stop - t0), p) for p, start, stop in spans for t0 in range(start, stop, BLOCK_M)]
    return torch.tensor(out, dtype=torch.int32).reshape(-1, 3).to(device)


def table(factors: list[Factors | None]) -> torch.Tensor:
    """The pointer table of a call's adapters, (n + 1, 3) int64 rows (at_ptr, bt_ptr, rank16), rank 0 for an adapter
    without the slot (None) and in the last row, the base rows' (tile adapter -1)."""
    rows = [(0, 0, 0) if f is None else (f.at.data_ptr(), f.bt.data_ptr(), f.rank) for f in factors] + [(0, 0, 0)]
    return torch.tensor(rows, dtype=torch.int64)


@triton.jit
def _tile(tiles_ptr, table_ptr, n_adapters):
    """A tile's first token, token count and its adapter's row of the pointer table (the base rows': the last)."""
    t = tl.program_id(0)
    row0 = tl.load(tiles_ptr + 3 * t)
    rows = tl.load(tiles_ptr + 3 * t + 1)
    p = tl.load(tiles_ptr + 3 * t + 2)
    p = tl.where(p < 0, n_adapters, p).to(tl.int64)
    return row0.to(tl.int64), rows, table_ptr + 3 * p


@triton.jit(do_not_specialize=["n_adapters", "K"])
def _shrink_kernel(
    x_ptr, tiles_ptr, table_ptr, s_ptr, n_adapters, K,
    stride_xm, stride_xk, stride_sm,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
):
    row0, rows, entry = _tile(tiles_ptr, table_ptr, n_adapters)
    rank = tl.multiple_of(tl.load(entry + 2).to(tl.int32), BLOCK_R)
    at_ptr = tl.multiple_of(tl.load(entry).to(tl.pointer_type(tl.float32)), 16)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    offs_r = tl.arange(0, BLOCK_R)
    mask_m = offs_m < rows
    x_rows = x_ptr + (row0 + offs_m)[:, None] * stride_xm
    for r0 in range(0, rank, BLOCK_R):  # base tiles: rank 0, nothing read or written
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            mask_k = offs_k < K - k0
            x = tl.load(x_rows + (k0 + offs_k)[None, :] * stride_xk, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            a = tl.load(at_ptr + (k0 + offs_k).to(tl.int64)[:, None] * rank + (r0 + offs_r)[None, :],
                        mask=mask_k[:, None], other=0.0)
            acc = tl.dot(x.to(tl.float32), a, acc, input_precision="ieee")
        tl.store(s_ptr + (row0 + offs_m)[:, None] * stride_sm + (r0 + offs_r)[None, :], acc, mask=mask_m[:, None])


@triton.jit(do_not_specialize=["n_adapters", "N"])
def _expand_kernel(
    s_ptr, tiles_ptr, table_ptr, out_ptr, n_adapters, N,
    stride_sm, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):
    row0, rows, entry = _tile(tiles_ptr, table_ptr, n_adapters)
    rank = tl.load(entry + 2).to(tl.int32)
    bt_ptr = tl.multiple_of(tl.load(entry + 1).to(tl.pointer_type(tl.float32)), 16)
    pid_n = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, BLOCK_R)
    mask_m = offs_m < rows
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(0, rank, BLOCK_R):  # base tiles: rank 0, their rows stay zero
        s = tl.load(s_ptr + (row0 + offs_m)[:, None] * stride_sm + (r0 + offs_r)[None, :], mask=mask_m[:, None],
                    other=0.0)
        b = tl.load(bt_ptr + (r0 + offs_r).to(tl.int64)[:, None] * N + offs_n[None, :], mask=mask_n[None, :],
                    other=0.0)
        acc = tl.dot(s, b, acc, input_precision="ieee")
    tl.store(out_ptr + (row0 + offs_m)[:, None] * stride_om + offs_n[None, :], acc,
             mask=mask_m[:, None] & mask_n[None, :])


def lora_terms(x: torch.Tensor, tile_table: torch.Tensor, pointer_table: torch.Tensor,
               factors: list[Factors | None], N: int) -> torch.Tensor:
    """Every row's LoRA term: x (T, K) in a kernel dtype, any strides; tile_table from `tiles` covering each of the
    T rows exactly once; pointer_table from `table(factors)` on x's device; factors: the call's adapters (None: one
    without the slot), each with A^T (K, r16) and B^T (r16, N). Returns (T, N) float32 contiguous: (x A^T) B^T of the
    row's adapter, zeros for base rows."""
    op = "lora_terms"
    check_float(op, "x", x, 2)
    T, K = x.shape
    if pointer_table.shape != (len(factors) + 1, 3):
        raise ValueError(f"{op}: the pointer table must be (adapters + 1 = {len(factors) + 1}, 3), got "
                         f"{tuple(pointer_table.shape)}")
    factors = [f for f in factors if f is not None]
    n_adapters = pointer_table.shape[0] - 1
    for f in factors:
        if f.at.shape[0] != K or f.bt.shape[1] != N:
            raise ValueError(f"{op}: factors for K={f.at.shape[0]}, N={f.bt.shape[1]}, got x of K={K} and N={N}")
    check_device(op, x, tile_table, pointer_table, *(t for f in factors for t in (f.at, f.bt)))
    out = torch.empty(T, N, dtype=torch.float32, device=x.device)
    n_tiles = tile_table.shape[0]
    if T == 0 or N == 0 or n_tiles == 0:
        return out.zero_()
    width = max([f.rank for f in factors], default=0)
    s = torch.empty(T, max(width, 1), dtype=torch.float32, device=x.device)
    _shrink_kernel[(n_tiles,)](
        x, tile_table, pointer_table, s, n_adapters, K, x.stride(0), x.stride(1), s.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_K=BLOCK_K, BLOCK_R=BLOCK_R, num_warps=NUM_WARPS)
    _expand_kernel[(n_tiles, triton.cdiv(N, BLOCK_N))](
        s, tile_table, pointer_table, out, n_adapters, N, s.stride(0), out.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_R=BLOCK_R, num_warps=NUM_WARPS)
    return out


def aot_variants(dtype: torch.dtype = torch.float16, tokens: int = 1024, hidden: int = 768):
    """BERT-base's FFN input slot (K 768, N 3072) for `bertfast kernels`: yields (name, jit_fn, {argument:
    representative value}, configs)."""
    t = torch.empty(16, dtype=dtype)  # stands for any 16-byte aligned buffer of this dtype
    i32, f32 = torch.empty(16, dtype=torch.int32), torch.empty(16, dtype=torch.float32)
    common = {"tiles_ptr": i32, "table_ptr": torch.empty(16, dtype=torch.int64), "n_adapters": 8,
              "BLOCK_M": BLOCK_M, "BLOCK_R": BLOCK_R}
    config = triton.Config({}, num_warps=NUM_WARPS, num_stages=1)
    yield ("lora_shrink", _shrink_kernel, {**common, "x_ptr": t, "s_ptr": f32, "K": hidden, "stride_xm": hidden,
                                           "stride_xk": 1, "stride_sm": 16, "BLOCK_K": BLOCK_K}, [config])
    yield ("lora_expand", _expand_kernel, {**common, "s_ptr": f32, "out_ptr": f32, "N": 4 * hidden,
                                           "stride_sm": 16, "stride_om": 4 * hidden, "BLOCK_N": BLOCK_N}, [config])
