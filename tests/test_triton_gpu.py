"""The compiled Triton kernels of the rotary, gated, sliding-window and relative-bias models on a CUDA GPU, vs the
reference ops.

This test session runs Triton under the interpreter (the conftests set TRITON_INTERPRET=1 before anything
imports triton), so the GPU checks run in a subprocess with the interpreter off: `_check_on_gpu` prints one
JSON line per (op, dtype) with our error, the same-dtype reference's error (both vs fp64) and the output's
scale, and the test holds each to the house rule. Skipped without CUDA.
"""

from __future__ import annotations

import json

import pytest
import torch

from helpers.gpu_child import compiled_rows

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available())")]


def _check_on_gpu():
    """Run in the subprocess: every new kernel path, fp32/fp16/bf16, awkward shapes; prints JSON lines."""
    from bertfast import reference as ref
    from bertfast import relative
    from bertfast.backends import AttentionBias, Rotary
    from bertfast.kernels.triton import INTERPRET, attention, linear, qkv

    assert not INTERPRET, "the GPU check must run the compiled kernels"
    g = torch.Generator().manual_seed(0)

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).cuda()

    def report(op, dtype, ours, low, hi):
        scale = max(1.0, hi.abs().max().item())
        print(json.dumps({"op": op, "dtype": str(dtype), "err": (ours.double() - hi).abs().max().item(),
                          "ref_err": (low.double() - hi).abs().max().item(), "scale": scale}), flush=True)

    lengths = [1, 129, 65, 200]  # 1-token row, block tails, a row far longer than the window
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    T, H, heads = sum(lengths), 256, 4
    d = H // heads
    positions = torch.cat([torch.arange(n, dtype=torch.float64) for n in lengths]).cuda()
    angles = positions[:, None] * 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64, device="cuda") / d)
    rotary = Rotary(angles.cos().float(), angles.sin().float())
    x, wqkv, w_in = r(T, H), r(3 * H, H, scale=H ** -0.5), r(2 * 384, H, scale=H ** -0.5)
    q64, k64, v64 = r(T, heads, d), r(T, heads, d), r(T, heads, d)
    bias = AttentionBias(relative.bias_table(torch.randn(32, heads, generator=g).cuda(), max(lengths)),
                         positions.to(torch.int32))
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        lo = lambda t: t.to(dtype)  # noqa: E731
        ours = qkv.qkv(lo(x), lo(wqkv), None, heads, rotary=rotary)
        low = ref.qkv(lo(x), lo(wqkv), None, heads, rotary)
        hi = ref.qkv(x, wqkv, None, heads, rotary)  # fp64 (the rotation itself in fp32, ~1e-7 off)
        for name, o, lw, h in zip("qkv", ours, low, hi):
            report(f"qkv_rotary.{name}", dtype, o, lw, h)
        for act in ("gelu", "silu"):
            report(f"linear_gated.{act}", dtype, linear.linear_gated(lo(x), lo(w_in), None, act),
                   ref.linear_glu(lo(x), lo(w_in), None, act), ref.linear_glu(x, w_in, None, act))
        for window in (8, 64, 300):
            report(f"attention.window{window}", dtype,
                   attention.attention_varlen(lo(q64), lo(k64), lo(v64), cu, max(lengths), d ** -0.5, window=window),
                   ref.attention_loop(lo(q64), lo(k64), lo(v64), cu, d ** -0.5, window=window),
                   ref.attention_loop(q64, k64, v64, cu, d ** -0.5, window=window))
        report("attention.bias", dtype,
               attention.attention_varlen(lo(q64), lo(k64), lo(v64), cu, max(lengths), d ** -0.5, bias=bias),
               ref.attention_loop(lo(q64), lo(k64), lo(v64), cu, d ** -0.5, bias=bias),
               ref.attention_loop(q64, k64, v64, cu, d ** -0.5, bias=bias))


def test_new_kernels_compiled_on_gpu_match_reference():
    from bertfast.accuracy import within

    rows = compiled_rows("test_triton_gpu", "_check_on_gpu", timeout=600)
    assert len(rows) == 3 * (3 + 2 + 3 + 1)
    for row in rows:
        dtype = getattr(torch, row["dtype"].replace("torch.", ""))
        rel, ref_rel = row["err"] / row["scale"], row["ref_err"] / row["scale"]
        assert within(rel, ref_rel, dtype), row  # 2x the reference's own error + floor, capped by the table
