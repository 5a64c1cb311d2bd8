"""What the Triton kernels share: the interpreter mode seen at import, input checks that raise before any
launch, the autotune config lists (one config under the interpreter, where autotuning would only multiply
the slow interpretation), and the tiles two ops use (the GEMM tiles of linear and qkv, the LayerNorm row of
layernorm and embedding)."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def _interpreter_index_fix() -> bool:
    """Lets the interpreter of Triton 3.6 and earlier run loops with tensor bounds under NumPy >= 2.4.

    Such an interpreter turns a scalar tensor used as a Python index (`range(lo, seq_len, BLOCK)` with a loaded
    `seq_len`) into an int by `int(data)` on a one-element array, which NumPy 2.4 refuses ("only 0-dimensional
    arrays can be converted to Python scalars"): every kernel with a runtime loop bound failed. Triton fixed it
    upstream (triton-lang/triton#9171; 3.9's interpreter takes the element out first). Where the installed
    interpreter has the old conversion, its tensor patch is wrapped to install the fixed one after it (restored
    with the rest where the interpreter restores its patches). Returns whether it did."""
    import inspect

    from triton.runtime import interpreter

    patch = getattr(interpreter, "_patch_lang_tensor", None)
    try:
        source = inspect.getsource(patch) if patch is not None else ""
    except (OSError, TypeError):
        return False
    if "int(self.handle.data)" not in source:  # 3.9's reads int(self.handle.data.squeeze())
        return False

    def index(self):
        return int(self.handle.data.reshape(-1)[0])

    def patch_lang_tensor(tensor, *scope):  # Triton 3.6 passes a scope that restores what it set; earlier ones not
        patch(tensor, *scope)
        if scope:
            scope[0].set_attr(tensor, "__index__", index)
        else:
            tensor.__index__ = index

    interpreter._patch_lang_tensor = patch_lang_tensor
    return True


if INTERPRET:
    _interpreter_index_fix()

# Dtypes the kernels compute in. The interpreter holds bf16 as raw bits and cannot do arithmetic
# on it, so on CPU only fp32/fp16 are accepted.
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INTERPRETER_DTYPES = (torch.float32, torch.float16)


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def configs_for_mode(configs: list, interpreter_config) -> list:
    """The autotune list to declare: all `configs` when compiling, one config when interpreting."""
    return [interpreter_config] if INTERPRET else list(configs)


def check_device(op: str, *tensors: torch.Tensor) -> torch.device:
    """All tensors on one device that this build of the kernels can run on; returns it."""
    device = tensors[0].device
    for t in tensors[1:]:
        if t.device != device:
            raise ValueError(f"{op}: all tensors must be on one device, got {device} and {t.device}")
    if device.type == "cpu" and not INTERPRET:
        raise ValueError(
            f"{op}: CPU tensors need the Triton interpreter: set TRITON_INTERPRET=1 in the environment "
            "before bertfast.kernels.triton is first imported (the kernels here were built for GPU)"
        )
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"{op}: tensors on {device} are not supported (expected cuda, or cpu under "
                         "TRITON_INTERPRET=1)")
    return device


def check_float(op: str, name: str, t: torch.Tensor, ndim: int, dtype: torch.dtype | None = None) -> None:
    """`t` is a tensor of `ndim` dims in a kernel dtype (and equal to `dtype` when given)."""
    if not torch.is_tensor(t):
        raise ValueError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{op}: {name} must have {ndim} dims, got shape {tuple(t.shape)}")
    allowed = INTERPRETER_DTYPES if t.device.type == "cpu" else KERNEL_DTYPES
    if t.dtype not in allowed:
        names = ", ".join(str(d).replace("torch.", "") for d in allowed)
        where = " under the Triton interpreter (CPU)" if t.device.type == "cpu" else ""
        raise ValueError(f"{op}: {name} has dtype {t.dtype}; supported{where}: {names}")
    if dtype is not None and t.dtype != dtype:
        raise ValueError(f"{op}: {name} has dtype {t.dtype} but the input is {dtype}; all must match")


def check_shape(op: str, name: str, t: torch.Tensor, shape: tuple) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{op}: {name} has shape {tuple(t.shape)}, expected {tuple(shape)}")


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot input precision: exact ("ieee") for fp32, where tl.dot would otherwise use TF32."""
    return "ieee" if dtype == torch.float32 else "tf32"


# ---- the GEMM tile (linear, qkv) ----


@triton.jit
def _program_tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Map the 1-D program id to a (pid_m, pid_n) tile, GROUP_M row-tiles at a time so that
    programs running together share weight tiles in L2."""
    return _tile_of(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)


@triton.jit
def _tile_of(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """`_program_tile` of tile number `pid` (a persistent kernel's work item)."""
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    group_size = GROUP_M * num_pid_n
    first_m = (pid // group_size) * GROUP_M
    rows_in_group = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group_size) % rows_in_group
    pid_n = (pid % group_size) // rows_in_group
    return pid_m, pid_n


@triton.jit
def _gemm_tile(x_ptr, w_ptr, M, N, K, stride_xm, stride_xk, stride_wn, stride_wk, pid_m, pid_n,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               INPUT_PRECISION: tl.constexpr):
    """fp32 tile [BLOCK_M, BLOCK_N] of x[M, K] @ w[N, K].T, with its row and column offsets."""
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk
    w_ptrs = w_ptr + offs_k[:, None] * stride_wk + offs_n[None, :] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        mask_k = offs_k < K - k0
        x = tl.load(x_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        w = tl.load(w_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)  # [BLOCK_K, BLOCK_N]
        acc = tl.dot(x, w, acc, input_precision=INPUT_PRECISION)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk
    return acc, offs_m, offs_n


@triton.jit
def _gemm_pair_tile(x_ptr, w_ptr, K, stride_xm, stride_xk, stride_wn, stride_wk, offs_m, mask_m, rows_a, rows_b,
                    mask_n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    INPUT_PRECISION: tl.constexpr):
    """Two fp32 tiles [BLOCK_M, BLOCK_N], x @ w[rows_a].T and x @ w[rows_b].T, sharing each x tile: the gated
    linear (rows n and N + n) and the rotary QKV (the two halves of a head's channels) pair their columns so
    the epilogue holds both operands of its formula in the same register position."""
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk
    wa_ptrs = w_ptr + offs_k[:, None] * stride_wk + rows_a[None, :] * stride_wn
    wb_ptrs = w_ptr + offs_k[:, None] * stride_wk + rows_b[None, :] * stride_wn
    acc_a = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_b = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        mask_k = offs_k < K - k0
        x = tl.load(x_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        mask_w = mask_k[:, None] & mask_n[None, :]
        wa = tl.load(wa_ptrs, mask=mask_w, other=0.0)  # [BLOCK_K, BLOCK_N]
        wb = tl.load(wb_ptrs, mask=mask_w, other=0.0)  # [BLOCK_K, BLOCK_N]
        acc_a = tl.dot(x, wa, acc_a, input_precision=INPUT_PRECISION)
        acc_b = tl.dot(x, wb, acc_b, input_precision=INPUT_PRECISION)
        x_ptrs += BLOCK_K * stride_xk
        wa_ptrs += BLOCK_K * stride_wk
        wb_ptrs += BLOCK_K * stride_wk
    return acc_a, acc_b


def _fit_configs(configs, m: int, x: torch.Tensor, mma: list, fma: list, weight_tiles: int) -> list:
    """The configs of x's dtype family (`mma` for fp16/bf16, `fma` for fp32) that fit M = m tokens."""
    family = fma if x.dtype == torch.float32 else mma
    kept = []
    for c in configs:
        if not any(c is f for f in family):
            continue
        bm, bn, bk = c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"]
        # Row tiles far taller than the token count only compute padding (b1 x s16 has M = 16).
        if bm > max(64, next_pow2(m)):
            continue
        # Software pipelining keeps `num_stages` x and w tiles in shared memory (A100: 164 KB).
        if c.num_stages * (bm + weight_tiles * bn) * bk * x.element_size() > 160 * 1024:
            continue
        kept.append(c)
    return kept or [c for c in configs if any(c is f for f in family)][-1:] or [configs[-1]]


def _prune_configs(configs, named_args, **kwargs):
    """Keep the configs of this dtype's family that fit the problem (the autotuner's filter)."""
    return _fit_configs(configs, named_args["M"], named_args["x_ptr"], MMA_CONFIGS, FMA_CONFIGS, 1)


def _prune_pair_configs(configs, named_args, **kwargs):
    """`_prune_configs` for the two-accumulator kernels (gated linear, rotary QKV)."""
    return _fit_configs(configs, named_args["M"], named_args["x_ptr"], PAIR_MMA_CONFIGS, PAIR_FMA_CONFIGS, 2)


# fp16/bf16 (tensor cores). BERT GEMMs are M = tokens (16..16k) by N, K in {H, 3H, 4H} for
# H 384..1024: 128x128 tiles win from ~1k tokens on A100/H100, 64-row tiles keep small batches
# busy. 128x256 tiles spill once the GELU or residual epilogue holds the fp32 accumulator, and
# so do 128x128 tiles on 4 warps: `bertfast kernels` checks every config here.
MMA_CONFIGS = [
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 32, "GROUP_M": 8}, num_warps=8, num_stages=4),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8}, num_warps=4, num_stages=4),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8}, num_warps=4, num_stages=4),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8}, num_warps=4, num_stages=3),
    # Narrow tiles for a few tokens (b1 x s16: M = 16): a GEMM there streams its weights, and N / BLOCK_N programs
    # are all there is to stream them with (768 / 64 = 12 of an H100's 132 SMs).
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 32, "BLOCK_K": 64, "GROUP_M": 8}, num_warps=4, num_stages=4),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 16, "BLOCK_K": 64, "GROUP_M": 8}, num_warps=4, num_stages=5),
]
# fp32 with input_precision="ieee" runs on the FMA units, operands in registers: small K steps,
# or the kernel spills heavily.
FMA_CONFIGS = [
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 16, "GROUP_M": 8}, num_warps=8, num_stages=2),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": 8}, num_warps=4, num_stages=2),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 16, "GROUP_M": 8}, num_warps=4, num_stages=2),
    triton.Config({"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": 8}, num_warps=4, num_stages=2),
]
_CONFIGS = MMA_CONFIGS + FMA_CONFIGS
# Under the interpreter fewer, larger programs are faster (numpy does the tile work).
_INTERPRETER_CONFIG = triton.Config({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 4},
                                    num_warps=4, num_stages=1)
CONFIGS = configs_for_mode(_CONFIGS, _INTERPRETER_CONFIG)

# Two accumulators (`_gemm_pair_tile`: gated linear, rotary QKV) hold twice the fp32 registers of one, and a
# BLOCK_N of pairs covers 2 x BLOCK_N weight rows: the single-accumulator tiles halved along N.
PAIR_MMA_CONFIGS = [
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": 8}, num_warps=8, num_stages=4),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8}, num_warps=4, num_stages=3),
    # 3 stages of this tile spill a few bytes on sm_80 (ptxas, at ~100 registers).
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 32, "BLOCK_K": 64, "GROUP_M": 8}, num_warps=4, num_stages=2),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 16, "BLOCK_K": 64, "GROUP_M": 8}, num_warps=4, num_stages=4),
]
PAIR_FMA_CONFIGS = [
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 16, "GROUP_M": 8}, num_warps=8, num_stages=2),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 32, "BLOCK_K": 16, "GROUP_M": 8}, num_warps=4, num_stages=2),
    # K steps of 16: with 32, ptxas on sm_80 holds ~250 registers even for a 32 x 32 tile.
    triton.Config({"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 16, "GROUP_M": 8}, num_warps=4, num_stages=2),
]
_PAIR_CONFIGS = PAIR_MMA_CONFIGS + PAIR_FMA_CONFIGS
PAIR_CONFIGS = configs_for_mode(_PAIR_CONFIGS, _INTERPRETER_CONFIG)


# ---- the LayerNorm row (layernorm, embedding) ----


@triton.jit
def _layernorm_row(x, w_ptr, b_ptr, offs, mask, N, eps):
    """x: fp32 [BLOCK_N], 0 where ~mask. Returns LayerNorm(x) * w + b in fp32."""
    mean = tl.sum(x, 0) / N
    xc = tl.where(mask, x - mean, 0.0)
    var = tl.sum(xc * xc, 0) / N
    rstd = 1.0 / tl.sqrt(var + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    return xc * rstd * w + b


# One row per program, 4 warps: the persistent layer (`layer.py`) normalizes its rows with the same warps, so that a
# row's sums are reduced in the same order on either path (a config chosen by timing could differ between them).
ROW_CONFIGS = [triton.Config({}, num_warps=4, num_stages=1)]
