"""`bertfast.profile` and `bertfast embed --profile`: where a run's time goes.

The profile changes no output bit (fp32, bf16, int8); its stages cover the pipeline (tokenize, pooling, read, write),
every op of the forward, inside the native layer (`_C.Layer`, its own timers) and on the op-by-op path (the backend's
methods wrapped), with each GEMM's FLOPs counted exactly; off, nothing stays wrapped and the native timers are off.
"""

from __future__ import annotations

import json

import pytest
import torch

import bertfast
import modern_models
from bertfast import Encoder
from bertfast.profiling import OPS, Profile, stage
from conftest import corpus, hf_bert, ragged_batch

TEXTS = corpus(40)
LAYER_OPS = ("gemm qkv", "attention", "gemm attn-out", "layernorm", "gemm ffn-in", "gemm ffn-out")


def _native():
    from bertfast import _C

    return _C


@pytest.mark.parametrize("dtype", [None, "bf16", "int8"])
def test_profiled_encode_is_bit_identical_and_covers_every_stage(tiny_text_model, dtype):
    enc = Encoder.from_pretrained(tiny_text_model, backend="cpu", dtype=dtype)
    plain = enc.encode(TEXTS, batch_size=16)
    with bertfast.profile(enc, label="tiny") as prof:
        profiled = enc.encode(TEXTS, batch_size=16)
    assert torch.equal(plain, profiled)
    rows = {r["stage"]: r for r in prof.rows()}
    batches, layers = 3, enc.config.num_hidden_layers
    for name in ("tokenize", "pooling", "embeddings") + LAYER_OPS:
        assert rows[name]["seconds"] > 0, name
    assert rows["tokenize"]["calls"] == rows["pooling"]["calls"] == rows["embeddings"]["calls"] == batches
    # The plain BERT layer runs whole in `_C.Layer`: its own timers split it, two LayerNorms a layer (int8: the first
    # on each row block of the output GEMM as it is written, at least one a group, the second per FFN chunk of rows,
    # as the FFN GEMMs; int8 and fp32: the QKV GEMM and attention per group of sequences).
    qkv = rows["gemm qkv"]["calls"]
    grouped = dtype in (None, "int8")
    assert qkv == rows["attention"]["calls"] == rows["gemm attn-out"]["calls"]
    assert qkv > batches * layers if grouped else qkv == batches * layers
    second = rows["gemm ffn-in"]["calls"] if dtype == "int8" else batches * layers
    if dtype == "int8":
        assert rows["layernorm"]["calls"] - second >= rows["gemm attn-out"]["calls"]
    else:
        assert rows["layernorm"]["calls"] == batches * layers + second
    assert dtype != "int8" or second > batches * layers  # several chunks a layer here
    assert ("quantize rows" in rows) == (dtype == "int8")
    # bf16: the QKV GEMM's operand rounded on its own, the FFN-in one's in its LayerNorm's pass (layernorm_to_bf16)
    assert ("bf16 operands" in rows) == (dtype == "bf16")
    assert dtype != "bf16" or rows["bf16 operands"]["calls"] == batches * layers
    assert "gemm pooler" not in rows  # sentence embeddings never run the pooler
    assert all(rows[g]["gflops_per_s"] > 0 for g in LAYER_OPS if g.startswith("gemm"))
    assert all(r["seconds"] >= 0 for r in rows.values())
    # encode on worker threads (auto: one per torch thread): their thread-seconds add up to wall x workers
    assert sum(r["seconds"] for r in rows.values()) == pytest.approx(prof.wall * prof.workers, rel=1e-6)
    assert "where the time goes: tiny" in prof.table() and "GEMMs" in prof.table()


def test_gemm_flops_are_counted_exactly(tiny_text_model):
    enc = Encoder.from_pretrained(tiny_text_model, backend="cpu")
    cfg = enc.config
    lengths = [7, 1, 30]
    ids, mask, types = ragged_batch(lengths, vocab=cfg.vocab_size)
    with bertfast.profile(enc) as prof:
        enc(ids, mask, types)
    T, H, I, L = sum(lengths), cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    assert prof.flops["gemm qkv"] == 2 * T * H * 3 * H * L
    assert prof.flops["gemm attn-out"] == 2 * T * H * H * L
    assert prof.flops["gemm ffn-in"] == prof.flops["gemm ffn-out"] == 2 * T * H * I * L
    assert prof.flops["gemm pooler"] == 2 * len(lengths) * H * H  # a model's own forward keeps its pooler


def test_op_by_op_path_is_timed_through_the_backend():
    """ModernBERT composes its layers from the backend's ops (rotary, gated FFN): the wrapped methods time them."""
    model = modern_models.build("modernbert")
    enc = Encoder.from_hf(model, backend="cpu")
    ids, mask = modern_models.batch([9, 1, 20])
    plain = enc(ids, mask).last_hidden_state
    with bertfast.profile(enc) as prof:
        profiled = enc(ids, mask).last_hidden_state
    assert torch.equal(plain, profiled)
    layers = model.config.num_hidden_layers
    assert prof.calls["gemm qkv"] == prof.calls["attention"] == layers
    assert prof.calls["gemm ffn-in"] == prof.calls["gemm ffn-out"] == layers
    assert "layer (native)" not in prof.seconds
    # The cpu backend's qkv runs its own linear: one GEMM, timed once (not again as "gemm other").
    assert "gemm other" not in prof.seconds
    assert sum(prof.seconds[k] for k in prof.seconds if k != "forward") <= prof.wall


def test_off_leaves_nothing_behind(tiny_text_model):
    enc = Encoder.from_pretrained(tiny_text_model, backend="cpu")
    backend = enc.engine.backend
    with bertfast.profile(enc):
        assert "linear" in vars(backend) and "forward" in vars(enc.engine)
        with pytest.raises(RuntimeError, match="already running"):
            with bertfast.profile(enc):
                pass
    ops = {"embeddings", "qkv", "attention", "linear", "layernorm", "whole_layer", "disentangled"}
    assert not ops & set(vars(backend))
    assert "forward" not in vars(enc.engine) and bertfast.profiling._active is None
    before = _native().profile_counters()
    enc.encode(TEXTS[:4])
    assert _native().profile_counters() == before  # the native timers are off
    with stage("nothing"):  # no profile: a no-op
        pass


def test_rest_and_shares_add_up():
    prof = Profile("made up")
    prof.wall = 10.0
    prof.add("tokenize", 1.0)
    prof.add("forward", 6.0)
    prof.add("gemm qkv", 3.0, flops=6e9)
    prof.add("layer (native)", 5.0)  # split by the native timers: not a row of its own
    rows = {r["stage"]: r for r in prof.rows()}
    assert rows["forward: rest"]["seconds"] == 3.0 and rows["rest"]["seconds"] == 3.0
    assert rows["gemm qkv"]["gflops_per_s"] == 2.0 and rows["gemm qkv"]["share"] == 0.3
    assert "layer (native)" not in rows and "forward" not in rows
    assert sum(r["share"] for r in rows.values()) == pytest.approx(1.0)
    assert set(OPS) >= {"gemm qkv", "layernorm", "quantize rows"}
    assert "of peak" in prof.table({"gemm": 4.0}) and " 50%" in prof.table({"gemm": 4.0})
    # 6 GFLOP of GEMMs in the 10 s wall: 0.6 GFLOP/s end to end, 15% of a 4 GFLOP/s ceiling
    assert "the GEMMs' 6.0 GFLOP in 10.000 s, 1 GFLOP/s, 15% of the ceiling" in prof.table({"gemm": 4.0})


def test_embed_command_profile(tmp_path, tiny_text_model, capsys):
    from bertfast.tools.cli import main

    src = tmp_path / "in.txt"
    src.write_text("\n".join(TEXTS))
    out_json = tmp_path / "profile.json"
    assert main(["embed", str(src), str(tmp_path / "out"), "--model", tiny_text_model, "--backend", "cpu",
                 "--profile", str(out_json)]) == 0
    printed = capsys.readouterr().out
    assert "where the time goes: bertfast embed" in printed and "gemm ffn-in" in printed
    data = json.loads(out_json.read_text())
    stages = {r["stage"]: r for r in data["stages"]}
    for name in ("read", "tokenize", "pooling", "write") + LAYER_OPS:
        assert stages[name]["seconds"] > 0, name
    assert data["wall_s"] * data["workers"] >= sum(r["seconds"] for r in data["stages"]) * (1 - 1e-6)
    code = main(["embed", str(src), str(tmp_path / "o2"), "--model", tiny_text_model, "--profile", "--ray"])
    assert code == 2 and "cannot see into Ray actors" in capsys.readouterr().err


def test_bert_without_a_native_layer_is_timed_op_by_op():
    """The torch backend has no whole layer: every op is one of its methods."""
    model = hf_bert()
    enc = Encoder.from_hf(model, backend="torch")
    ids, mask, types = ragged_batch([5, 9])
    with bertfast.profile(enc) as prof:
        enc(ids, mask, types)
    layers = model.config.num_hidden_layers
    assert prof.calls["layernorm"] == 2 * layers and prof.calls["gemm qkv"] == layers
    assert prof.calls["embeddings"] == 1 and "layer (native)" not in prof.seconds
