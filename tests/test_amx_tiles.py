"""The AMX tile kernels against the Intel SDM: on the amx_emulated tier (the tile instructions emulated, any CPU
with AVX-512 BF16) and on the amx tier (the hardware) alike.

The bf16 GEMM (linear_amx.cpp's kernel) against a model of TDPBF16PS written here from the SDM's pseudo-code, bit
for bit: per 32-wide K step and output row, the even and the odd bf16 products each summed over the step's 16
pairs in an fp32 chain of their own, the two chains added, then added to the accumulator; bf16 denormal inputs read
as zero. On amx_emulated this checks the kernel and the emulation; on amx, that the hardware sums as the SDM says
(docs/tiers.md#amx_emulated: where that fails, the emulation's bf16 bits are not the hardware's). The shapes cross
every tile edge of the kernel: 16-row blocks and their tails, 48-column panels of three 16-column tiles and a short
last panel, one to five K steps. The model-level tests (test_tiers.py, test_embed.py, ...) run both tiers through
the `isa` fixture like every other.
"""

from __future__ import annotations

import pytest
import torch

from bertfast.backends.cpu import isa as isa_module

_C = pytest.importorskip("bertfast._C")


@pytest.fixture(params=["amx", isa_module.EMULATED])
def tiles(request):
    """The kernels on a tier with AMX tiles (real or emulated) for the test; skipped where the CPU lacks it."""
    reason = isa_module.unsupported(request.param)
    if reason is not None:
        pytest.skip(reason)
    before = _C.isa()
    assert _C.set_isa(request.param) and _C.isa() == request.param
    yield request.param
    _C.set_isa(before)


def _daz(t: torch.Tensor) -> torch.Tensor:
    """bf16 denormals read as zero (TDPBF16PS's DAZ), the rest unchanged; in fp32."""
    f = t.float()
    return torch.where(f.abs() < torch.finfo(torch.float32).tiny, torch.zeros_like(f), f)


def tdpbf16ps_model(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x (M, K) bf16 times w (N, K) bf16 transposed, K a multiple of 32, as AMX tiles accumulate it: fp32 (M, N).
    A product of two bf16 is exact in fp32, so each `chain + a * b` is the SDM's FMA, rounded once."""
    a, b = _daz(x), _daz(w)
    acc = torch.zeros(x.shape[0], w.shape[0])
    for k0 in range(0, x.shape[1], 32):
        even, odd = torch.zeros_like(acc), torch.zeros_like(acc)
        for p in range(16):
            ke, ko = k0 + 2 * p, k0 + 2 * p + 1
            even = even + a[:, ke, None] * b[None, :, ke]
            odd = odd + a[:, ko, None] * b[None, :, ko]
        acc = acc + (even + odd)
    return acc


def sequential_model(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The same products summed into the accumulator one by one along K (the Intrinsics Guide's older text)."""
    a, b = _daz(x), _daz(w)
    acc = torch.zeros(x.shape[0], w.shape[0])
    for k in range(x.shape[1]):
        acc = acc + a[:, k, None] * b[None, :, k]
    return acc


def cancelling(m: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x (m, k), w (n, k) in bf16 whose second half of K cancels the first to ~1%: the fp32 roundings of the
    order of summation show through the bf16 output, so a test on them tells orders apart."""
    g = torch.Generator().manual_seed(seed)
    h = k // 2
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    x[:, h:] = x[:, :h]
    w[:, h:] = -w[:, :h] * (1 + 0.01 * torch.randn(n, h, generator=g))
    return x.to(torch.bfloat16), w.to(torch.bfloat16)


@pytest.mark.parametrize("m", [1, 15, 16, 17, 47], ids=lambda m: f"M{m}")
@pytest.mark.parametrize("n,k", [(16, 32), (47, 64), (48, 160), (49, 96), (100, 32)],
                         ids=lambda v: str(v))
def test_bf16_gemm_is_the_sdm_tdpbf16ps(tiles, m, n, k):
    x, w = cancelling(m, n, k, seed=m * 1000 + n * 10 + k)
    x[0, :3] = torch.tensor([1e-39, -3e-40, 5e-39]).to(torch.bfloat16)  # denormals: read as zero
    ours = _C.linear(x, _C.pack_linear(w), n, None, "none", None)
    assert torch.equal(ours, tdpbf16ps_model(x, w).to(torch.bfloat16))


def test_the_order_shows():
    """On the cancelling inputs the SDM's two chains and a sequential sum give different bf16 outputs: the test
    above tells them apart."""
    x, w = cancelling(47, 49, 96, seed=47 * 1000 + 49 * 10 + 96)
    assert not torch.equal(tdpbf16ps_model(x, w).to(torch.bfloat16), sequential_model(x, w).to(torch.bfloat16))


def test_bf16_gemm_epilogue_on_the_tile_sums(tiles):
    """bias, GELU and residual applied to the fp32 tile sums, rounded once: the other tiers' epilogue."""
    g = torch.Generator().manual_seed(3)
    m, n, k = 33, 50, 64
    x, w = torch.randn(m, k, generator=g).to(torch.bfloat16), torch.randn(n, k, generator=g).to(torch.bfloat16)
    bias, res = torch.randn(n, generator=g).to(torch.bfloat16), torch.randn(m, n, generator=g).to(torch.bfloat16)
    ours = _C.linear(x, _C.pack_linear(w), n, bias, "none", res)
    assert torch.equal(ours, (tdpbf16ps_model(x, w) + bias.float() + res.float()).to(torch.bfloat16))


def test_k_not_a_multiple_of_32_leaves_the_tiles(tiles):
    """K % 32 != 0 runs the AVX-512 BF16 kernel, as on amx (the tiles step K by 32): the avx512_vnni tier's bits."""
    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(20, 40, generator=g).to(torch.bfloat16), torch.randn(30, 40, generator=g).to(torch.bfloat16)
    before = _C.isa()
    ours = _C.linear(x, _C.pack_linear(w), 30, None, "none", None)
    assert _C.set_isa("avx512_vnni")
    try:
        assert torch.equal(ours, _C.linear(x, _C.pack_linear(w), 30, None, "none", None))
    finally:
        _C.set_isa(before)


def test_tiles_are_not_the_avx512_kernel(tiles):
    """The tier runs the tile kernel, not a fallback: where K allows tiles its sums are the SDM's, not the
    AVX-512 BF16 kernel's (one running sum over pairs)."""
    x, w = cancelling(40, 64, 256, seed=5)
    tiles = _C.linear(x, _C.pack_linear(w), 64, None, "none", None)
    before = _C.isa()
    assert _C.set_isa("avx512_vnni")
    try:
        streamed = _C.linear(x, _C.pack_linear(w), 64, None, "none", None)
    finally:
        _C.set_isa(before)
    assert torch.equal(tiles, tdpbf16ps_model(x, w).to(torch.bfloat16)) and not torch.equal(tiles, streamed)
