"""The TMA kernel's place in the GEMM choice (`backends.cuda.gemm_choice`): a "tma" entry holds for every M of its
(op, N, K, dtype) on sm_90 and overrides that shape's cuBLAS buckets; the table refuses a tma entry that could depend
on M or run where TMA does not; the TMA paths compute the fused ops; and the gemm stage's rule for writing such an entry
(`tools/gpucheck/gemm.tma_entry`: no slower at any M bucket, faster over them all)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from bertfast import reference
from bertfast.backends.cuda import gemm_choice

TMA = {"op": "linear_gelu", "m_bucket": 0, "n": 48, "k": 16, "dtype": "fp16", "arch": "sm_90", "choice": "tma",
       "tile": "plain"}
CUBLAS = {"op": "linear_gelu", "m_bucket": 32, "n": 48, "k": 16, "dtype": "fp16", "arch": "sm_90", "choice": "cublas"}


@pytest.mark.parametrize("m", [1, 17, 32, 300, 16384])
def test_a_tma_entry_holds_for_every_m_and_overrides_cublas(m):
    other = {**CUBLAS, "op": "linear_residual"}
    choices = gemm_choice.GemmChoices([TMA, CUBLAS, other], "sm_90")
    assert choices.tma("linear_gelu", 48, 16, torch.float16) == "plain"
    assert choices.choice("linear_gelu", m, 48, 16, torch.float16) == "tma"
    assert not choices.cublas("linear_gelu", m, 48, 16, torch.float16)  # its M buckets would break invariance
    assert choices.tma("linear_gelu", 48, 16, torch.bfloat16) is None  # another dtype, another shape
    assert choices.choice("linear_residual", 32, 48, 16, torch.float16) == "cublas"
    assert choices.choice("linear_residual", 64, 48, 16, torch.float16) == "triton"


def test_a_tma_entry_applies_only_on_its_arch():
    assert not gemm_choice.GemmChoices([TMA], "sm_80")
    assert gemm_choice.GemmChoices([TMA], "sm_80").tma("linear_gelu", 48, 16, torch.float16) is None
    assert gemm_choice.GemmChoices([TMA], "sm_90")


@pytest.mark.parametrize("change, message", [
    ({"m_bucket": 32}, "holds for every M: m_bucket must be 0, got 32"),
    ({"arch": "sm_80"}, "a tma entry is for sm_90, got arch 'sm_80'"),
    ({"tile": "huge"}, "names a tile of plain, ws, got 'huge'"),
    ({"n": 40}, "N and K multiples of 16, got 40 x 16"),
], ids=["m-bucket", "arch", "tile", "n"])
def test_the_table_refuses_a_tma_entry_that_could_not_hold(tmp_path, change, message):
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"entries": [TMA, CUBLAS]}))
    assert [e["choice"] for e in gemm_choice.read_table(str(good))] == ["tma", "cublas"]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"entries": [{**TMA, **change}]}))
    with pytest.raises(ValueError, match=f"bad.json is malformed: .*{message}"):
        gemm_choice.read_table(str(bad))


def test_the_tma_paths_compute_the_fused_ops():
    from bertfast.kernels.triton import INTERPRET

    if not INTERPRET:
        pytest.skip("needs TRITON_INTERPRET=1 before bertfast.kernels.triton is imported (tests/conftest.py)")
    g = torch.Generator().manual_seed(0)
    x, w, b, r = (torch.randn(*s, generator=g) for s in ((5, 32), (48, 32), (48,), (5, 48)))
    for tile in ("plain", "ws"):
        torch.testing.assert_close(gemm_choice.tma_linear(x, w, b, "gelu", r, tile), F.gelu(F.linear(x, w, b)) + r)
        wq, bq = torch.randn(96, 32, generator=g), torch.randn(96, generator=g)
        for ours, ref in zip(gemm_choice.tma_qkv(x, wq, bq, 2, tile), reference.qkv(x, wq, bq, 2)):
            assert ours.shape == (5, 2, 16)
            torch.testing.assert_close(ours, ref)


def _rows(triton_us, plain_us, ws_us):
    return [{"op": "qkv", "m_bucket": m, "n": 2304, "k": 768, "dtype": "fp16", "arch": "sm_90", "triton_us": t,
             "tma_plain_us": p, "tma_ws_us": w, "choice": "triton"}
            for m, t, p, w in zip((16, 1024, 16384), triton_us, plain_us, ws_us)]


def test_the_gemm_stage_writes_a_tma_entry_only_where_it_never_loses():
    from bertfast.tools.gpucheck import gemm

    tiles = ["plain", "ws"]
    # ws is faster in total but 20% slower at M = 16: plain, no slower anywhere and 30% faster in total, is chosen.
    entry = gemm.tma_entry(_rows([5.0, 40.0, 400.0], [5.1, 30.0, 280.0], [6.0, 25.0, 260.0]), tiles)
    assert entry == {"op": "qkv", "m_bucket": 0, "n": 2304, "k": 768, "dtype": "fp16", "arch": "sm_90", "choice": "tma",
                     "tile": "plain", "m_buckets": [16, 1024, 16384], "triton_us": 445.0, "tma_us": 315.1}
    # Both lose somewhere beyond the margin: no entry, the Triton kernel stays at every M.
    assert gemm.tma_entry(_rows([5.0, 40.0, 400.0], [8.0, 30.0, 280.0], [6.0, 25.0, 260.0]), tiles) is None
    # No faster than the margin in total: no entry.
    assert gemm.tma_entry(_rows([5.0, 40.0, 400.0], [5.0, 40.0, 390.0], [5.0, 40.0, 399.0]), tiles) is None
    assert gemm.tma_entry(_rows([5.0], [4.0], [4.0]), []) is None  # not a TMA arch: nothing was timed
    failed = _rows([5.0], [4.0], [4.0])
    failed[0]["error"] = "a path is off"
    assert gemm.tma_entry(failed, tiles) is None
    # What it writes, the table reads.
    gemm_choice._check_tma_entry(entry)
