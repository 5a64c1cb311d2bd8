"""fp8 (e4m3) kernels (bertfast.kernels.triton.fp8) under the Triton interpreter: the row quantizer against torch's
float8_e4m3fn conversion, bit for bit; the GEMM's epilogues against a torch emulation of the same quantized math;
batch invariance; the refusal below sm_89.

What runs where: Triton 3.9's interpreter casts to float8e4nv wrongly (ties away from zero, subnormals truncated,
wrap past 448; e.g. 336.0 -> 352, 470.0 -> -256), so the quantize kernel computes each code with integer arithmetic on
the fp32 bits (the same code compiles for the GPU) and these tests run that code. The GEMM's tl.dot on float8e4nv
operands runs in the interpreter as numpy's fp32 matmul of the codes decoded to fp16 (exact: every e4m3 value is an
fp16 value; all 254 finite codes checked), so the emulation's fp64 product of the same codes differs from the kernel
only by fp32 accumulation and the epilogue's fp32 rounding. The GPU's fp8 MMA (sm_89 mma, sm_90 wgmma promoted to
fp32 every BLOCK_K) is not exercised here.
"""

from __future__ import annotations

import pytest
import torch

from bertfast.kernels import activation
from bertfast.kernels.triton import fp8

from .conftest import NoLaunch, rand

E4M3 = torch.float8_e4m3fn


def quantize_reference(x: torch.Tensor):
    """Codes and scales of `fp8.quantize_rows` by torch: fp32 math, torch's float8_e4m3fn conversion (RNE)."""
    xf = x.float()
    amax = xf.abs().amax(1)
    safe = torch.where(amax > 0, amax, torch.full_like(amax, 448.0))
    # IEEE divisions, as the kernel's div_rn: torch's `448 / t` is reciprocal(t) * 448, an ulp off at times.
    rcp = torch.full_like(safe, 448.0).div(safe)
    codes = (xf * rcp[:, None]).clamp(-448.0, 448.0).to(E4M3)
    return codes, safe.div(torch.full_like(safe, 448.0))


def emulate(x, w: fp8.Fp8Weight, bias=None, act="none", residual=None):
    """The kernel's math in fp64 on the same codes: (codes_x @ codes_w.T) * sx * sw + bias, act, + residual; and
    the magnitude sum(|products|) * sx * sw that bounds the kernel's fp32 accumulation error."""
    cx, sx = quantize_reference(x)
    scale = sx.double()[:, None] * w.scales.double()[None, :]
    y = (cx.double() @ w.codes.double().T) * scale
    mag = (cx.double().abs() @ w.codes.double().abs().T) * scale
    if bias is not None:
        y = y + bias.double()
    y = activation.apply(y, act)
    if residual is not None:
        y = y + residual.double()
    return y, mag


def fp16_ulp(v: torch.Tensor) -> torch.Tensor:
    return torch.exp2(torch.floor(torch.log2(v.abs().clamp_min(2.0 ** -14))) - 10)


def assert_emulated(ours, emu, mag, K, what, act="none"):
    """ours (fp16) within 2 fp16 ulps of the emulation plus the fp32 accumulation's bound, K * 2^-24 * sum |terms|
    (times the activation's largest slope, 1.2 for GELU)."""
    assert ours.dtype == torch.float16 and torch.isfinite(ours).all(), what
    slope = 1.2 if act != "none" else 1.0
    bound = 2 * fp16_ulp(emu) + slope * K * 2.0 ** -24 * mag
    err = (ours.double() - emu).abs()
    worst = (err - bound).argmax()
    assert (err <= bound).all(), (f"{what}: |ours - emulation| {err.flatten()[worst]:.3g} > bound "
                                  f"{bound.flatten()[worst]:.3g} at {worst.item()}")


# ---- the quantizer ----


def rows_case(name: str, dtype):
    g = torch.Generator().manual_seed(3)
    if name == "random":
        return (torch.randn(129, 200, generator=g) * 3).to(dtype)
    if name == "offset":  # every value far from zero: codes near the top of each row's range
        return (torch.randn(17, 130, generator=g) * 0.01 + 5.0).to(dtype)
    if name == "zero-rows":
        x = torch.randn(5, 48, generator=g).to(dtype)
        x[1] = 0.0
        x[3] = -0.0
        return x
    if name == "tiny":  # subnormal codes (below 2^-6 after scaling) in every row
        x = torch.randn(9, 300, generator=g) * 1e-3
        x[:, 0] = 1.0
        return x.to(dtype)
    if name == "every-fp16":  # all finite fp16 values in [-448, 448] at scale 1 (a 448 in each row): every tie
        h = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.float16)
        h = h[h.isfinite() & (h.abs() <= 448)]
        body = torch.zeros(-(-h.numel() // 511) * 511, dtype=torch.float16)
        body[:h.numel()] = h
        x = torch.cat([torch.full((body.numel() // 511, 1), 448.0, dtype=torch.float16), body.reshape(-1, 511)], 1)
        return x.to(dtype)
    raise AssertionError(name)


QUANTIZE_CASES = ["random", "offset", "zero-rows", "tiny", "every-fp16"]


@pytest.mark.parametrize("dtype", [pytest.param(torch.float16, id="fp16"), pytest.param(torch.float32, id="fp32")])
@pytest.mark.parametrize("case", QUANTIZE_CASES)
def test_quantize_rows_equals_torch_e4m3(case, dtype):
    x = rows_case(case, dtype)
    codes, scales = fp8.quantize_rows(x)
    want_codes, want_scales = quantize_reference(x)
    assert codes.dtype == E4M3 and scales.dtype == torch.float32 and codes.is_contiguous()
    assert torch.equal(scales, want_scales)
    assert torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8))


def test_quantize_rows_saturation_edge():
    """Rows whose amax lands just above 448 after x * (448 / amax) (the product rounds up): saturated to 448, as the
    reference's clamp; the case is exercised, not assumed."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4096, 16, generator=g).to(torch.float16)
    amax = x.float().abs().amax(1)
    over = (x.float().abs() * torch.full_like(amax, 448.0).div(amax)[:, None]).amax(1) > 448.0
    assert over.sum() >= 10, "no row crosses 448 before saturation: the case is not exercised"
    codes, scales = fp8.quantize_rows(x)
    want_codes, want_scales = quantize_reference(x)
    assert torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8)) and torch.equal(scales, want_scales)
    assert (codes[over].float().abs().amax(1) == 448.0).all()


def test_quantize_rows_strided_and_empty():
    x = rand(33, 70, dtype=torch.float16, noncontig=True, scale=2.0)
    codes, scales = fp8.quantize_rows(x)
    want_codes, want_scales = quantize_reference(x)
    assert torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8)) and torch.equal(scales, want_scales)
    codes, scales = fp8.quantize_rows(torch.empty(0, 64, dtype=torch.float16))
    assert codes.shape == (0, 64) and scales.shape == (0,)


def test_quantize_rows_rejects_bad_input(monkeypatch):
    monkeypatch.setattr(fp8, "_quantize_rows_kernel", NoLaunch())
    with pytest.raises(ValueError, match="2-D"):
        fp8.quantize_rows(torch.zeros(4, dtype=torch.float16))
    with pytest.raises(ValueError, match="dtype"):
        fp8.quantize_rows(torch.zeros(4, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="K = 0"):
        fp8.quantize_rows(torch.zeros(4, 0, dtype=torch.float16))


# ---- the GEMM ----

# (M, N, K): M = 1, 17, 129 (tails of every row tile); N, K not multiples of BLOCK_N = 64, BLOCK_K = 128 (K = 48 is
# one partial K step, 200 and 300 two and three).
SHAPES = [
    pytest.param(1, 72, 200, id="M1-N72-K200"),
    pytest.param(17, 40, 48, id="M17-N40-K48"),
    pytest.param(129, 96, 300, id="M129-N96-K300"),
]


def operands(M, N, K, seed=0):
    x = rand(M, K, dtype=torch.float16, seed=seed, scale=2.0, offset=0.3)
    w = rand(N, K, dtype=torch.float16, seed=seed + 1, scale=K ** -0.5)
    b = rand(N, dtype=torch.float16, seed=seed + 2, scale=0.5)
    r = rand(M, N, dtype=torch.float16, seed=seed + 3, offset=3.0)
    return x, fp8.quantize_weight(w), w, b, r


@pytest.mark.parametrize("epilogue", ["none", "bias", "gelu", "residual"])
@pytest.mark.parametrize("M,N,K", SHAPES)
def test_linear_matches_emulation(M, N, K, epilogue):
    x, wq, w, b, r = operands(M, N, K)
    kwargs = {"none": {}, "bias": {"bias": b}, "gelu": {"bias": b, "act": "gelu"},
              "residual": {"bias": b, "residual": r}}[epilogue]
    ours = fp8.linear(x, wq, kwargs.get("bias"), kwargs.get("act", "none"), kwargs.get("residual"))
    emu, mag = emulate(x, wq, **kwargs)
    assert_emulated(ours, emu, mag, K, f"linear[{epilogue}]", kwargs.get("act", "none"))
    # The house rule against the unquantized product: no worse than twice the emulation's own error, plus a floor.
    act = kwargs.get("act", "none")
    exact = activation.apply(x.double() @ w.double().T + (b.double() if "bias" in kwargs else 0), act)
    exact = exact + (r.double() if "residual" in kwargs else 0)
    own = (emu - exact).abs().max().item()
    assert (ours.double() - exact).abs().max().item() <= 2 * own + 2 ** -10 * max(1.0, exact.abs().max().item())


@pytest.mark.parametrize("q_scale", [None, 0.25])
@pytest.mark.parametrize("T,H,heads", [pytest.param(1, 64, 2, id="T1-H64-h2"), pytest.param(17, 52, 2, id="T17-H52-h2"),
                                       pytest.param(129, 80, 1, id="T129-H80-h1")])
def test_qkv_matches_emulation(T, H, heads, q_scale):
    x, wq, w, b, _ = operands(T, 3 * H, H, seed=4)
    q, k, v = fp8.qkv(x, wq, b, heads, q_scale=q_scale)
    emu, mag = emulate(x, wq, b)
    exact = x.double() @ w.double().T + b.double()
    if q_scale is not None:
        for t in (emu, mag, exact):
            t[:, :H] *= q_scale
    ours = torch.cat([t.reshape(T, H) for t in (q, k, v)], 1)
    for got in (q, k, v):
        assert got.shape == (T, heads, H // heads) and got.is_contiguous()
    assert_emulated(ours, emu, mag, H, "qkv")
    own = (emu - exact).abs().max().item()
    assert (ours.double() - exact).abs().max().item() <= 2 * own + 2 ** -10 * max(1.0, exact.abs().max().item())


def test_row_alone_equals_row_in_batch():
    """A row's output is the same bits alone and inside a batch of 300 rows (> 2x the largest BLOCK_M, 128), for
    each epilogue: its activation scale is its own and every config steps K by the same BLOCK_K."""
    assert max(c.kwargs["BLOCK_M"] for c in fp8._CONFIGS_FP8) * 2 < 300
    assert len({c.kwargs["BLOCK_K"] for c in fp8._CONFIGS_FP8 + fp8.CONFIGS_FP8}) == 1
    x, wq, _, b, r = operands(300, 72, 200, seed=7)
    H = 40
    xq, wqq, _, bq, _ = operands(300, 3 * H, H, seed=8)
    full = {"gelu": fp8.linear(x, wq, b, "gelu"), "residual": fp8.linear(x, wq, b, residual=r),
            "qkv": torch.cat(fp8.qkv(xq, wqq, bq, 2, q_scale=0.5), -1)}
    for i in (0, 137, 299):
        row = slice(i, i + 1)
        alone = {"gelu": fp8.linear(x[row], wq, b, "gelu"), "residual": fp8.linear(x[row], wq, b, residual=r[row]),
                 "qkv": torch.cat(fp8.qkv(xq[row], wqq, bq, 2, q_scale=0.5), -1)}
        for name in full:
            assert torch.equal(alone[name][0], full[name][i]), f"{name}: row {i} alone differs from the batch's"


def test_gemm_rejects_bad_operands(monkeypatch):
    monkeypatch.setattr(fp8, "_fp8_linear_kernel", NoLaunch())
    x, wq, w, b, r = operands(5, 24, 32)
    with pytest.raises(ValueError, match="Fp8Weight"):
        fp8.linear(x, w, b)
    with pytest.raises(ValueError, match="K = 31"):
        fp8.linear(x[:, :31], wq, b)
    with pytest.raises(ValueError, match="bias"):
        fp8.linear(x, wq, b.float())
    with pytest.raises(ValueError, match="residual"):
        fp8.linear(x, wq, b, residual=r[:, :5])
    with pytest.raises(ValueError, match="activation"):
        fp8.linear(x, wq, b, "swish")
    with pytest.raises(ValueError, match="rows"):
        fp8.qkv(x, wq, None, 2)


# ---- the GPU generation ----


@pytest.mark.parametrize("capability,ok", [((8, 6), False), ((8, 0), False), ((7, 5), False), ((8, 9), True),
                                           ((9, 0), True), ((12, 0), True)])
def test_arch_check_names_the_gpu(monkeypatch, capability, ok):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA Test GPU")
    fp8.check_arch("cpu")  # the interpreter: no GPU generation to check
    if ok:
        fp8.check_arch(torch.device("cuda", 0))
        return
    major, minor = capability
    with pytest.raises(ValueError, match=rf"8\.9 or later.*NVIDIA Test GPU has {major}\.{minor} \(sm_{major}{minor}\)"):
        fp8.check_arch(torch.device("cuda", 0))

