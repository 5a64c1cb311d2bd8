"""Int8 dynamic quantization of the encoder's GEMMs (`dtype="int8"` on the cpu backend).

Weights are quantized once at load, symmetric per output channel, and packed (`QuantLinear`); activations
per token at run time, asymmetric; the GEMM accumulates in int32 and one epilogue produces fp32 again.
The invariant: activations between ops are fp32, only the four per-layer GEMMs' operands are ever int8.
The scheme, what stays fp32 and why, the measured choice of activation scales, and which GEMM runs on
which tier: docs/int8.md.
"""

from __future__ import annotations

import torch

from ...kernels import activation
from .ext import _C

QMAX = 127  # symmetric weight grid [-127, 127]: -128 is never produced, so -q is always representable
ACTIVATIONS = ("none",) + activation.LAYER_IDS

# ----------------------------------------------------------------------------------------------
# Quantize / dequantize


def _symmetric_scales(amax: torch.Tensor) -> torch.Tensor:
    # An all-zero row gets scale 1 (its codes are all 0 whatever the scale): never a division by 0.
    return torch.where(amax > 0, amax / QMAX, torch.ones_like(amax))


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel quantization of a linear weight.

    weight: (N, K) float. Returns (q (N, K) int8 contiguous in [-127, 127], scale (N,) float32) with
    weight ~= q * scale[:, None]. Computed in fp64 so the codes do not depend on the weight's dtype
    rounding of the division.
    """
    if weight.dim() != 2:
        raise ValueError(f"a linear weight must be (out_features, in_features), got {tuple(weight.shape)}")
    if not weight.is_floating_point():
        raise ValueError(f"quantize_weight expects a float weight, got {weight.dtype}")
    if not bool(torch.isfinite(weight).all()):
        raise ValueError("cannot quantize a weight holding NaN or Inf")
    w = weight.detach().to(torch.float64)
    scale = _symmetric_scales(w.abs().amax(dim=1)).to(torch.float32)
    q = torch.round(w / scale.to(torch.float64)[:, None]).clamp_(-QMAX, QMAX).to(torch.int8)
    return q.contiguous(), scale


def quantize_rows_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token (per-row) asymmetric quantization in torch ops: the definition `quantize_rows` keeps.

    x: (M, K) float. Returns (q (M, K) int8, scale (M,) float32, zero_point (M,) int32), all math in
    fp32: lo = min(min x, 0), hi = max(max x, 0), scale = (hi - lo) / 255 (1 for an all-zero row),
    inv = 1 / scale, zero_point = -128 - round(lo * inv), q = clamp(round(x * inv) + zero_point,
    -128, 127); x ~= (q - zero_point) * scale, and 0 is exact. Rounding is half to even. The native
    kernel computes the same fp32 operations, so its codes are bitwise equal to these.
    """
    x = x.to(torch.float32)
    lo = x.amin(dim=1).clamp(max=0.0)
    hi = x.amax(dim=1).clamp(min=0.0)
    span = hi - lo
    # amin/amax skip nothing: a row holding NaN gets scale NaN (Inf: scale Inf), codes 0 and zero
    # point 0, so the epilogue turns the whole output row non-finite instead of hiding it.
    scale = torch.where(span == 0, torch.ones_like(span), span / 255.0)
    inv = 1.0 / scale  # a multiply per element instead of a divide (the native pass does the same)
    finite = torch.isfinite(scale)
    zero_point = torch.where(finite, (-128.0 - torch.round(lo * inv)).clamp(-128, 127), 0.0)
    q = (torch.round(x * inv[:, None]) + zero_point[:, None]).clamp_(-128, 127)
    q = torch.where(finite[:, None], q, 0.0).to(torch.int8)
    return q, scale, zero_point.to(torch.int32)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token asymmetric int8 quantization of activations (one pass in the native extension).

    x: (M, K) float32, rows may be strided (a column slice). Returns (q (M, K) int8 contiguous,
    scale (M,) float32, zero_point (M,) int32); see `quantize_rows_reference` for the exact math.
    """
    if x.dim() != 2:
        raise ValueError(f"x must be (tokens, features), got shape {tuple(x.shape)}")
    if x.dtype != torch.float32:
        raise ValueError(f"int8 activation quantization expects float32 activations, got {x.dtype}")
    if _C is not None and x.device.type == "cpu":
        if x.stride(1) != 1:
            x = x.contiguous()
        return _C.quantize_rows(x)
    return quantize_rows_reference(x)


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor) -> torch.Tensor:
    """Inverse of `quantize_rows`: (q - zero_point[:, None]) * scale[:, None] -> (M, K) float32."""
    return (q.to(torch.float32) - zero_point.to(torch.float32)[:, None]) * scale.to(torch.float32)[:, None]


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q: (R, C) int8 with one scale per row, scale (R,) -> (R, C) float32 q * scale[:, None]."""
    if q.dim() != 2 or scale.shape != (q.shape[0],):
        raise ValueError(f"dequantize expects q (R, C) and scale (R,), got {tuple(q.shape)} and "
                         f"{tuple(scale.shape)}")
    return q.to(torch.float32) * scale.to(torch.float32)[:, None]


# ----------------------------------------------------------------------------------------------
# The packed weight and the GEMM


class QuantLinear:
    """A linear weight quantized once at load (symmetric, per output channel) and packed.

    q: (N, K) int8; scale: (N,) float32; colsum: (N,) float32 scale[n] * sum_k q[n, k] (the
    zero-point correction of asymmetric activations); packed: q in the extension's GEMM layout, which runs
    every token count (None without the extension: then `torch._int_mm` on q's transpose).
    """

    __slots__ = ("q", "scale", "colsum", "packed", "out_features", "in_features")

    def __init__(self, q: torch.Tensor, scale: torch.Tensor):
        if q.dtype != torch.int8 or q.dim() != 2:
            raise ValueError(f"QuantLinear needs a (N, K) int8 weight, got {q.dtype} {tuple(q.shape)}")
        if scale.dtype != torch.float32 or scale.shape != (q.shape[0],):
            raise ValueError(f"QuantLinear needs (N,) float32 scales, got {scale.dtype} {tuple(scale.shape)}")
        self.q, self.scale = q.contiguous(), scale.contiguous()
        self.out_features, self.in_features = q.shape
        self.colsum = (self.q.sum(dim=1, dtype=torch.int64).to(torch.float64) * self.scale.double()).float()
        # The extension's layout ([N/16][K/4][16][4]), when it is built.
        self.packed = _C.pack_int8(self.q) if _C is not None else None

    @classmethod
    def from_float(cls, weight: torch.Tensor) -> "QuantLinear":
        """Quantize a float (N, K) weight (see `quantize_weight`) and pack it."""
        q, scale = quantize_weight(weight)
        return cls(q, scale)

    @property
    def dtype(self) -> torch.dtype:
        return torch.int8

    @property
    def shape(self):
        return self.q.shape

    def dequantize(self) -> torch.Tensor:
        """The float32 (N, K) weight this QuantLinear stands for."""
        return dequantize(self.q, self.scale)

    def __repr__(self):
        gemm = "native" if self.packed is not None else "_int_mm"
        return f"QuantLinear(out_features={self.out_features}, in_features={self.in_features}, gemm={gemm})"


_int_mm_exact: bool | None = None


def int_mm_is_exact() -> bool:
    """Whether `torch._int_mm` sums exactly in this process, checked once on two probes against float64: under
    BERTFAST_ISA=avx2 (oneDNN capped at AVX2) torch 2.13's CPU `_int_mm` returned sums off by up to ~5e4 on an AMD
    Zen 5, where uncapped it is exact."""
    global _int_mm_exact
    if _int_mm_exact is None:
        g = torch.Generator().manual_seed(0)
        probes = [(torch.randint(-128, 128, (m, k), dtype=torch.int8, generator=g),
                   torch.randint(-128, 128, (k, n), dtype=torch.int8, generator=g)) for m, k, n in ((17, 80, 48),
                                                                                                  (64, 768, 256))]
        _int_mm_exact = all(torch.equal(torch._int_mm(a, b), (a.double() @ b.double()).to(torch.int32))
                            for a, b in probes)
    return _int_mm_exact


def int8_gemm(qx: torch.Tensor, weight: QuantLinear) -> torch.Tensor:
    """(M, K) int8 x (N, K) int8 weight -> (M, N) float32 = (int32 sum_k qx qw) * weight.scale[n], through
    `torch._int_mm` (the path without the extension), or float64 products where that is not exact here (the same
    sums: exact in float64 while |sum| < 2^53). The per-row activation scale is not applied here."""
    if int_mm_is_exact():
        acc = torch._int_mm(qx, weight.q.t())
    else:
        acc = qx.double() @ weight.q.t().double()
    return acc.to(torch.float32).mul_(weight.scale)




def _epilogue_torch(out, weight, x_scale, x_zero_point, bias, act, residual, addend=None):
    # out = x_scale[m] * (out - zp[m] * colsum[n]) + bias, as torch ops (several memory passes).
    out.addr_(x_zero_point.to(torch.float32), weight.colsum, alpha=-1.0)
    out.mul_(x_scale[:, None])
    if bias is not None:
        out.add_(bias)
    if addend is not None:
        out.add_(addend)
    out = activation.apply_(out, act)
    if residual is not None:
        out.add_(residual)
    return out


def linear(x: torch.Tensor, weight: QuantLinear, bias: torch.Tensor | None = None, act: str = "none",
           residual: torch.Tensor | None = None, addend: torch.Tensor | None = None) -> torch.Tensor:
    """act(x @ W.T + bias + addend) + residual with W int8 per channel and x quantized per token at run time.

    x: (M, K) float32 (row stride may be > K); weight: QuantLinear (N, K); bias: (N,) float32 or None;
    act: one of ACTIVATIONS; residual: (M, N) float32 or None; addend (LoRA terms, before the activation): a
    `_C.LoraTerm` (`lora.term`) on the native path, an (M, N) float32 delta on the torch one, or None.
    Returns (M, N) float32, contiguous.
    """
    if not isinstance(weight, QuantLinear):
        raise ValueError(f"weight must be a QuantLinear, got {type(weight).__name__}")
    if x.dim() != 2 or x.shape[1] != weight.in_features:
        raise ValueError(f"x must be (M, {weight.in_features}), got {tuple(x.shape)}")
    if x.dtype != torch.float32:
        raise ValueError(f"int8 linear takes float32 activations, got {x.dtype}")
    activation.check(act, ACTIVATIONS)
    M, N = x.shape[0], weight.out_features
    if bias is not None and (bias.shape != (N,) or bias.dtype != torch.float32):
        raise ValueError(f"bias must be ({N},) float32, got {bias.dtype} {tuple(bias.shape)}")
    if residual is not None and (residual.shape != (M, N) or residual.dtype != torch.float32):
        raise ValueError(f"residual must be ({M}, {N}) float32, got {residual.dtype} {tuple(residual.shape)}")
    if M == 0:
        return x.new_zeros(0, N)
    if weight.packed is not None:
        # one native call at every token count: quantize, GEMM, epilogue (exact int32 sums, one epilogue)
        if x.stride(1) != 1:
            x = x.contiguous()
        if residual is not None and residual.stride(1) != 1:
            residual = residual.contiguous()
        return _C.quant_linear(x, weight.packed, weight.scale, weight.colsum, bias, act, residual, lora=addend)
    qx, x_scale, x_zero_point = quantize_rows(x)
    return _epilogue_torch(int8_gemm(qx, weight), weight, x_scale, x_zero_point, bias, act, residual, addend)


def linear_reference(x: torch.Tensor, weight: QuantLinear, bias=None, act: str = "none", residual=None,
                     dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The same quantized math as `linear`, in `dtype` (fp64: the oracle for tests and validate).

    x is quantized exactly as `linear` quantizes it (`quantize_rows_reference`); the integer GEMM on
    the zero-point-centred codes, the scales, bias, activation and residual are then evaluated in
    `dtype`, so `linear` must match this up to summation order and fp32 rounding.
    """
    qx, x_scale, x_zero_point = quantize_rows_reference(x)
    centred = qx.to(dtype) - x_zero_point.to(dtype)[:, None]
    acc = centred @ weight.q.to(dtype).t()  # exact in fp64: |acc| < 255 * 127 * K << 2^53
    out = acc * x_scale.to(dtype)[:, None] * weight.scale.to(dtype)[None, :]
    if bias is not None:
        out = out + bias.to(dtype)
    if act != "none":
        out = activation.apply(out, act)
    if residual is not None:
        out = out + residual.to(dtype)
    return out


__all__ = ["QMAX", "ACTIVATIONS", "QuantLinear", "quantize_weight", "quantize_rows", "quantize_rows_reference",
           "dequantize", "dequantize_rows", "int8_gemm", "linear", "linear_reference"]
