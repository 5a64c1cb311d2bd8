"""ModernBERT, NomicBERT and GTE end to end against transformers' own models, random weights.

Config parsing (RoPE bases, per-layer windows, gating, norm placement) and its errors; the oracle
(`reference.forward`) against transformers, every hidden state; the encoder on each backend that runs these
families, on ragged batches with a 1-token row and rows at, one past and far past ModernBERT's sliding window,
right and left padding; a ModernBERT row of 3000 tokens; bf16 within twice transformers' own bf16 error; saved
directories and their length limit; checkpoint errors naming the tensor. Task heads, `optimize` and
sentence-transformers for these families run in test_modern_heads.py; the native ops in tests/ops/cpu/test_modern_ops.py.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import transformers

import bertfast
from bertfast import Encoder, reference
from bertfast.loading import _TensorSource, assemble, load_hf_model
from bertfast.accuracy import within
from conftest import rel_err
from modern_models import CONFIGS, FAMILY_OF, batch, build


NAMES = list(CONFIGS)
# modernbert's window is 8 (local_attention 16), modernbert-bias's 5: rows shorter than, at, one past and far
# past the window, and a 1-token row.
LENGTHS = [40, 1, 8, 9, 6, 23]
BACKENDS = ["torch"] + (["cpu"] if bertfast.backends.available_backends("cpu").get("cpu") is None else [])


@pytest.fixture(scope="module", params=NAMES)
def named(request):
    return request.param, build(request.param)


# --- config ---------------------------------------------------------------------------------------------------

def test_config_fields():
    cfg = bertfast.ModelConfig.from_dict(build("modernbert").config.to_dict())
    assert (cfg.family, cfg.rotary, cfg.norm_first, cfg.gated_ffn) == ("modernbert", True, True, True)
    assert cfg.layer_windows == (0, 8, 8, 0) and (cfg.rope_theta, cfg.local_rope_theta) == (160_000.0, 10_000.0)
    assert [cfg.rope_base(i) for i in range(4)] == [160_000.0, 10_000.0, 10_000.0, 160_000.0]
    assert cfg.type_vocab_size == 0 and cfg.layer_norm_eps == 1e-5
    cfg = bertfast.ModelConfig.from_dict(build("modernbert-bias").config.to_dict())
    assert cfg.layer_windows == (0, 5, 0) and (cfg.rope_theta, cfg.local_rope_theta) == (5000.0, 500.0)
    assert cfg.activation == "gelu_tanh"
    cfg = bertfast.ModelConfig.from_dict(build("nomic_bert").config.to_dict())
    assert (cfg.norm_first, cfg.layer_windows, cfg.rope_theta, cfg.activation) == (False, (), 1000.0, "silu")
    # configs written before rope_parameters: the bases in their own fields
    legacy = {"model_type": "modernbert", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 3,
              "intermediate_size": 96, "vocab_size": 50, "global_rope_theta": 1234.0, "local_rope_theta": 99.0,
              "global_attn_every_n_layers": 2, "local_attention": 64}
    cfg = bertfast.ModelConfig.from_dict(legacy)
    assert (cfg.rope_theta, cfg.local_rope_theta, cfg.layer_windows) == (1234.0, 99.0, (0, 32, 0))


@pytest.mark.parametrize("change, message", [
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 10.0, "factor": 2.0}}, "rope_type 'yarn'"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": -1}}, "rope_theta' must be a positive number"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 10.0, "partial_rotary_factor": 0.5}},
     "partial_rotary_factor"),
    ({"head_dim": 32}, "'head_dim' = 32"),
    ({"hidden_act": "mish"}, "'hidden_act' = 'mish'"),
], ids=["yarn", "theta", "partial", "head_dim", "act"])
def test_config_errors(change, message):
    d = {**build("nomic_bert").config.to_dict(), **change}
    with pytest.raises(bertfast.ConfigError, match=message):
        bertfast.ModelConfig.from_dict(d)


@pytest.mark.parametrize("change, message", [
    ({"layer_types": ["full_attention"]}, "'layer_types' must list"),
    ({"layer_types": ["full_attention", "chunked", "full_attention", "full_attention"]}, "'layer_types' must list"),
    ({"local_attention": 1}, "'local_attention' must be an integer >= 2"),
    ({"hidden_activation": "relu6"}, "'hidden_activation' = 'relu6'"),
], ids=["types-count", "types-kind", "window", "act"])
def test_modernbert_config_errors(change, message):
    d = {**build("modernbert").config.to_dict(), **change}
    with pytest.raises(bertfast.ConfigError, match=message):
        bertfast.ModelConfig.from_dict(d)


def test_bert_keeps_its_activations():
    d = transformers.BertConfig(hidden_act="silu").to_dict()
    with pytest.raises(bertfast.ConfigError, match="'hidden_act' = 'silu'"):  # a plain FFN's epilogues lack it
        bertfast.ModelConfig.from_dict(d)


# --- the oracle and the engine against transformers --------------------------------------------------------------

def test_reference_matches_transformers(named):
    name, hf = named
    ids, mask = batch(LENGTHS)
    with torch.no_grad():
        ref = hf(ids, attention_mask=mask, output_hidden_states=True)
    ours = reference.forward(load_hf_model(hf, torch.float64), ids, mask, output_hidden_states=True)
    assert rel_err(ours[0], ref.last_hidden_state, mask) <= 1e-5
    assert len(ours[2]) == len(ref.hidden_states)
    for a, b in zip(ours[2], ref.hidden_states, strict=True):
        assert rel_err(a, b, mask) <= 1e-5


@pytest.mark.parametrize("layout", ["right", "left"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_encoder_matches_transformers(named, backend, layout):
    name, hf = named
    types = hf.config.type_vocab_size if FAMILY_OF[name] != "modernbert" else 0
    inputs = batch(LENGTHS, seed=2, layout=layout, types=types)
    ids, mask = inputs[:2]
    kwargs = {"token_type_ids": inputs[2]} if types else {}
    with torch.no_grad():
        ref = hf(ids, attention_mask=mask, **kwargs, output_hidden_states=True)
    out = Encoder.from_hf(hf, backend=backend, dtype=torch.float32)(ids, mask, **kwargs, output_hidden_states=True)
    assert rel_err(out.last_hidden_state, ref.last_hidden_state, mask) <= 1e-5
    assert bool((out.last_hidden_state[~mask.bool()] == 0).all())
    for a, b in zip(out.hidden_states, ref.hidden_states, strict=True):
        assert rel_err(a, b, mask) <= 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
def test_modernbert_long_row(backend):
    """3000 tokens: every local layer's window slides the whole row; the global layers see all of it."""
    hf = build("modernbert", attn="sdpa")
    ids, mask = batch([3000, 7], seed=3)
    with torch.no_grad():
        ref = hf(ids, attention_mask=mask).last_hidden_state
    out = Encoder.from_hf(hf, backend=backend, dtype=torch.float32)(ids, mask).last_hidden_state
    assert rel_err(out, ref, mask) <= 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["modernbert", "nomic_bert", "gte"])
def test_bf16_within_twice_hf_bf16(backend, name):
    hf = build(name)
    ids, mask = batch(LENGTHS, seed=4)
    with torch.no_grad():
        ref = hf(ids, attention_mask=mask).last_hidden_state
        theirs = copy.deepcopy(hf).to(torch.bfloat16)(ids, attention_mask=mask).last_hidden_state
    out = Encoder.from_hf(hf, backend=backend, dtype=torch.bfloat16)(ids, mask).last_hidden_state
    ours, hf_err = rel_err(out, ref, mask), rel_err(theirs, ref, mask)
    assert within(ours, hf_err, torch.bfloat16, floor=0.0, cap=False), f"bf16 {ours:.3g} vs HF bf16 {hf_err:.3g}"


# --- saved directories, limits, checkpoint errors ----------------------------------------------------------------

@pytest.mark.parametrize("name", ["modernbert", "nomic_bert", "gte"])
def test_saved_directory_and_length_limit(tmp_path, name):
    """save_pretrained writes each family's hub layout (NomicBERT: fused Wqkv, fc11/fc12; GTE: qkv_proj and
    up_gate_proj, up first)."""
    hf = build(name, max_position_embeddings=64)
    hf.save_pretrained(tmp_path)
    ids, mask = batch([30, 4], seed=6)
    with torch.no_grad():
        ref = hf(ids, attention_mask=mask).last_hidden_state
    enc = Encoder.from_pretrained(tmp_path, backend="torch")
    assert rel_err(enc(ids, mask).last_hidden_state, ref, mask) <= 1e-5
    with pytest.raises(ValueError, match="limit of 64 tokens"):
        enc(torch.full((1, 65), 5))
    if name == "modernbert":
        with pytest.raises(ValueError, match="no token types"):
            enc(ids, mask, token_type_ids=torch.zeros_like(ids))
        holes = mask.clone()
        holes[0, 3:5] = 0
        with pytest.raises(ValueError, match=r"attention_mask rows \[0\] have masked positions between real tokens"):
            enc(ids, holes)


def test_gte_task_checkpoint_of_its_own_repos():
    """Alibaba's GTE repos keep the encoder under "new." in task checkpoints."""
    hf = build("gte", "ForSequenceClassification")
    sd = {k.replace("gte.", "new.", 1): v for k, v in hf.state_dict().items()}
    ours = _assemble(sd, hf)
    assert torch.equal(ours.layers[1].ffn_out_weight, hf.gte.layers[1].mlp.down_proj.weight)
    assert torch.equal(ours.pooler_weight, hf.gte.pooler.dense.weight)


def _assemble(sd, hf):
    cfg = bertfast.ModelConfig.from_dict(hf.config.to_dict())
    return assemble(_TensorSource({k: "memory" for k in sd}, sd.__getitem__), cfg)


def test_checkpoint_errors():
    hf = build("modernbert")
    sd = hf.state_dict()
    _assemble(sd, hf)  # loads as is
    missing = {k: v for k, v in sd.items() if k != "layers.1.attn_norm.weight"}
    with pytest.raises(bertfast.LoadError, match="'layers.1.attn_norm.weight' is missing"):
        _assemble(missing, hf)
    bad = {**sd, "layers.2.mlp.Wi.weight": torch.zeros(96, 64)}  # the gate half lost
    with pytest.raises(bertfast.LoadError, match=r"layers.2.mlp.Wi.weight' has shape \(96, 64\), expected \(192, 64\)"):
        _assemble(bad, hf)
    hf = build("gte")
    sd = {k: v for k, v in hf.state_dict().items() if k != "layers.0.self_attn.k_proj.bias"}
    with pytest.raises(bertfast.LoadError, match="some of the fused projections have a bias"):
        _assemble(sd, hf)


# --- bertfast validate --model on a saved random checkpoint of each family ----------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["modernbert", "nomic_bert", "gte-notypes"])
def test_validate_model(tmp_path, capsys, backend, name):
    from bertfast.tools.cli import main

    build(name).save_pretrained(tmp_path)
    code = main(["validate", "--backend", backend, "--model", str(tmp_path), "--dtype", "fp32,bf16"])
    out = capsys.readouterr().out
    assert code == 0, out
    layers = CONFIGS[name][1]["num_hidden_layers"]
    rows = [line.split() for line in out.splitlines() if line.split()[:1] and line.split()[0] in
            ["embeddings"] + [f"layer{i + 1}" for i in range(layers)]]
    assert len(rows) == 2 * (layers + 1) and all(r[-1] == "PASS" for r in rows), out


# --- the cpu backend on every ISA tier the CPU has ---------------------------------------------------------------

needs_cpu = pytest.mark.skipif("cpu" not in BACKENDS, reason="backend 'cpu' unavailable")


@needs_cpu
@pytest.mark.parametrize("name", ["modernbert", "nomic_bert", "gte"])
def test_cpu_tier(isa, name):
    """fp32 within 1e-5 of transformers; bf16 within twice transformers' own bf16 error; a row alone equals itself
    inside the batch, bit for bit, in both; int8 per-token cosine to fp32 >= 0.995 mean (the int8 report's bar)."""
    hf = build(name)
    ids, mask = batch(LENGTHS, seed=7)
    with torch.no_grad():
        ref = hf(ids, attention_mask=mask).last_hidden_state
        theirs = copy.deepcopy(hf).to(torch.bfloat16)(ids, attention_mask=mask).last_hidden_state
    real = mask.bool()
    for dtype in (torch.float32, torch.bfloat16):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the slower-than-fp32 notice on some tiers
            enc = Encoder.from_hf(hf, backend="cpu", dtype=dtype)
        out = enc(ids, mask).last_hidden_state
        err = rel_err(out, ref, mask)
        if dtype == torch.float32:
            assert err <= 1e-5
        else:
            hf_err = rel_err(theirs, ref, mask)
            assert within(err, hf_err, dtype, floor=0.0, cap=False), f"bf16 {err:.3g} vs HF bf16 {hf_err:.3g}"
        for b in (0, 1, 3):
            n = LENGTHS[b]
            assert torch.equal(enc(ids[b:b + 1, :n]).last_hidden_state[0], out[b, :n]), f"row {b} differs alone"
    q = Encoder.from_hf(hf, backend="cpu", dtype="int8")(ids, mask).last_hidden_state
    fp32 = Encoder.from_hf(hf, backend="cpu")(ids, mask).last_hidden_state
    cos = torch.nn.functional.cosine_similarity(q[real], fp32[real], dim=-1)
    assert cos.mean() >= 0.995 and cos.min() >= 0.98


# --- the triton backend (under the interpreter on CPU: small rows) -----------------------------------------------

@pytest.mark.parametrize("name", ["modernbert", "nomic_bert", "gte"])
def test_triton_matches_transformers(name):
    reason = bertfast.backends.available_backends("cpu").get("triton")
    if reason is not None:
        pytest.skip(f"backend 'triton' unavailable: {reason}")
    hf = build(name)
    ids, mask = batch([20, 1, 9], seed=2)  # 20 > modernbert's window of 8
    with torch.no_grad():
        ref = hf(ids, attention_mask=mask).last_hidden_state
    out = Encoder.from_hf(hf, backend="triton", dtype=torch.float32)(ids, mask).last_hidden_state
    assert rel_err(out, ref, mask) <= 1e-5
