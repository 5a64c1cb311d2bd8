"""The triton backend's per-shape GEMM choice (`backends.cuda.gemm_choice`): the table's reading, lookups by M bucket,
the cuBLAS paths' math, and the routing itself (on CPU: the interpreter for Triton, torch for the cuBLAS path)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from bertfast import reference
from bertfast.backends import get_backend
from bertfast.backends.cuda import gemm_choice

ENTRY = {"op": "linear_gelu", "m_bucket": 32, "n": 48, "k": 16, "dtype": "fp32", "arch": "sm_90", "choice": "cublas"}


def test_no_table_means_triton_everywhere(tmp_path):
    assert gemm_choice.read_table(str(tmp_path / "absent.json")) == []
    assert not gemm_choice.for_device("cpu")
    assert not gemm_choice.GemmChoices([ENTRY], "sm_80")  # measured on another arch: nothing applies
    gemm_choice.read_table()  # the committed table, if any, is well formed


def test_a_malformed_table_names_the_file(tmp_path):
    bad = tmp_path / "t.json"
    bad.write_text(json.dumps({"entries": [{**ENTRY, "choice": "cutlass"}]}))
    with pytest.raises(ValueError, match=r"t.json is malformed: .*'cutlass'"):
        gemm_choice.read_table(str(bad))
    bad.write_text("{")
    with pytest.raises(ValueError, match="malformed"):
        gemm_choice.read_table(str(bad))


@pytest.mark.parametrize("m, hit", [(17, True), (32, True), (16, False), (33, False)], ids=lambda v: str(v))
def test_choices_hold_for_their_m_bucket(m, hit):
    choices = gemm_choice.GemmChoices([ENTRY], "sm_90")
    assert bool(choices)
    assert choices.cublas("linear_gelu", m, 48, 16, torch.float32) is hit
    assert not choices.cublas("linear_gelu", 32, 48, 16, torch.float16)
    assert not choices.cublas("linear_residual", 32, 48, 16, torch.float32)


def test_op_names():
    assert gemm_choice.op_name("gelu") == "linear_gelu"
    assert gemm_choice.op_name("none", residual=True) == "linear_residual"


def test_cublas_paths_compute_the_fused_ops():
    g = torch.Generator().manual_seed(0)
    x, w, b, r = (torch.randn(*s, generator=g, dtype=torch.float64) for s in ((5, 16), (48, 16), (48,), (5, 48)))
    assert torch.allclose(gemm_choice.cublas_linear(x, w, b, "gelu"), F.gelu(F.linear(x, w, b)))
    assert torch.allclose(gemm_choice.cublas_linear(x, w, None, "none", r), F.linear(x, w) + r)
    for ours, ref in zip(gemm_choice.cublas_qkv(x, w, b, 4), reference.qkv(x, w, b, 4)):
        assert ours.shape == (5, 4, 4) and torch.allclose(ours, ref)


def test_the_backend_routes_by_the_table(monkeypatch):
    from bertfast.kernels.triton import INTERPRET

    if not INTERPRET:
        pytest.skip("needs TRITON_INTERPRET=1 before bertfast.kernels.triton is imported (tests/conftest.py)")
    backend = get_backend("triton", "cpu")
    assert not backend._gemm
    g = torch.Generator().manual_seed(1)
    w, b = torch.randn(48, 16, generator=g), torch.randn(48, generator=g)
    calls = []
    real = gemm_choice.cublas_linear
    backend._gemm = gemm_choice.GemmChoices([ENTRY], "sm_90")
    monkeypatch.setattr(gemm_choice, "cublas_linear", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    for m in (20, 40):  # bucket 32: cuBLAS; bucket 64: no entry, the Triton kernel
        x = torch.randn(m, 16, generator=g)
        out = backend.linear(x, w, b, "gelu")
        assert torch.allclose(out, F.gelu(F.linear(x, w, b)), atol=1e-5)
    assert calls == [20]
