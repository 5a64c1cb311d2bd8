"""MPNet: the relative position bias end to end against transformers' MPNetModel, random weights.

The oracle (`reference.forward`) against transformers; the native attention with a bias against the reference op on
every ISA tier (fp32, bf16, awkward head dims and lengths, q/k/v as views of one fused output); the encoder on the
torch, triton (interpreter) and cpu backends (every tier) on a ragged batch with a 1-token row and a row past the
128-position bucket horizon, masks with left padding and holes, bf16 within twice transformers' own bf16 error, batch invariance;
sentence-transformers' mean pooling + Normalize; clear errors. Task heads and `optimize` for MPNet run in
test_heads.py and test_optimize.py.
"""

from __future__ import annotations

import copy
import os
import shutil
import warnings

import pytest
import torch
import transformers

import bertfast
from bertfast import Encoder, reference, relative
from bertfast.backends import AttentionBias, available_backends
from bertfast.loading import load_hf_model
from bertfast.accuracy import TABLE, within
from conftest import rel_err
from helpers.tokens import layout_mask


CPU_REASON = available_backends("cpu").get("cpu")
needs_cpu = pytest.mark.skipif(CPU_REASON is not None, reason=f"backend 'cpu' unavailable: {CPU_REASON}")
LENGTHS = [150, 1, 37, 9]  # 150 > 128: the far, log-spaced buckets; one 1-token row


def build(seed=0, **overrides):
    """A random MPNetModel (hidden 96, 3 heads of 32, 2 layers) with LayerNorms, biases and the relative bias
    table moved off their init (which leaves the bias table nearly zero)."""
    cfg = dict(vocab_size=97, hidden_size=96, num_hidden_layers=2, num_attention_heads=3, intermediate_size=192,
               max_position_embeddings=200, layer_norm_eps=1e-5)
    torch.manual_seed(seed)
    model = transformers.MPNetModel(transformers.MPNetConfig(**{**cfg, **overrides})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name.lower() or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
        model.encoder.relative_attention_bias.weight.normal_(0, 1.0)
    return model


def batch(lengths=LENGTHS, seed=1, layout="right"):
    """ids, mask (B, S): pad id 1 at padded positions; layout "left" pads on the left, "holes" masks a few
    columns inside rows (the relative bias then spans the holes, as in transformers)."""
    g = torch.Generator().manual_seed(seed)
    mask = layout_mask(lengths, layout)
    S = mask.shape[1]
    ids = torch.randint(2, 97, (len(lengths), S), generator=g)
    return torch.where(mask.bool(), ids, torch.ones_like(ids)), mask


@pytest.fixture(scope="module")
def hf():
    return build()


def test_buckets_match_transformers():
    r = torch.arange(-300, 301)[None, :]
    theirs = transformers.models.mpnet.modeling_mpnet.MPNetEncoder.relative_position_bucket(r)
    assert torch.equal(relative.relative_position_bucket(r), theirs)


def test_reference_matches_transformers(hf):
    ids, mask = batch()
    with torch.no_grad():
        ref = hf(ids, attention_mask=mask, output_hidden_states=True)
    ours = reference.forward(load_hf_model(hf, torch.float64), ids, mask, output_hidden_states=True)
    assert rel_err(ours[0], ref.last_hidden_state, mask) <= 1e-5
    assert rel_err(ours[1], ref.pooler_output) <= 1e-5
    for a, b in zip(ours[2], ref.hidden_states, strict=True):
        assert rel_err(a, b, mask) <= 1e-5


# --- the attention op with a bias: native (every tier) vs the reference ---------------------------------------

ATTN_CASES = [([1], 32), ([129, 1, 70], 32), ([65, 17], 64), ([40, 3], 80), ([33, 8], 20)]


@needs_cpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("lengths, d", ATTN_CASES, ids=[f"L{'-'.join(map(str, c[0]))}-D{c[1]}" for c in ATTN_CASES])
def test_native_attention_with_bias(isa, dtype, lengths, d):
    from bertfast import _C

    heads, T = 3, sum(lengths)
    g = torch.Generator().manual_seed(len(lengths) * d)
    qkv = torch.randn(T, 3, heads, d, generator=g)  # q, k, v as strided views of one fused output
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    width = max(lengths) + 5  # the padded width: columns start anywhere in [0, 5]
    positions = torch.cat([torch.arange(n) + i % 6 for i, n in enumerate(lengths)]).to(torch.int32)
    bias = AttentionBias(torch.randn(heads, 2 * width - 1, generator=g) * 2, positions)
    q, k, v = (qkv[:, i].to(dtype) for i in range(3))
    scale = d ** -0.5
    ours = _C.attention(q, k, v, cu, max(lengths), scale, bias_table=bias.table, bias_positions=positions)
    expected = reference.attention(*(t.double() for t in (q, k, v)), cu, max(lengths), scale,
                                   AttentionBias(bias.table.double(), positions))
    loop = reference.attention_loop(*(t.double() for t in (q, k, v)), cu, scale, AttentionBias(bias.table.double(),
                                                                                               positions))
    assert rel_err(loop, expected) <= 1e-12
    err = rel_err(ours, expected)
    if dtype == torch.float32:
        assert err <= TABLE[dtype]
    else:
        low = reference.attention(q, k, v, cu, max(lengths), scale, AttentionBias(bias.table, positions))
        assert within(err, rel_err(low, expected), dtype, floor=0.0, cap=False)


@needs_cpu
def test_native_attention_bias_errors():
    from bertfast import _C

    q = torch.randn(5, 2, 16)
    cu = torch.tensor([0, 4, 5], dtype=torch.int32)
    pos = torch.arange(5, dtype=torch.int32)
    table = torch.randn(2, 9)
    call = lambda **kw: _C.attention(q, q, q, cu, 4, 0.25, **kw)  # noqa: E731
    with pytest.raises(ValueError, match="go together"):
        call(bias_table=table)
    with pytest.raises(ValueError, match="bias_table must be float32"):
        call(bias_table=table.double(), bias_positions=pos)
    with pytest.raises(ValueError, match="width odd"):
        call(bias_table=torch.randn(2, 8), bias_positions=pos)
    with pytest.raises(ValueError, match=r"heads = 2"):
        call(bias_table=torch.randn(3, 9), bias_positions=pos)
    with pytest.raises(ValueError, match="bias_positions must be int32"):
        call(bias_table=table, bias_positions=pos.long())
    with pytest.raises(ValueError, match=r"bias_positions must be \(5,\)"):
        call(bias_table=table, bias_positions=pos[:4])
    with pytest.raises(ValueError, match="sequence 0 span 6"):
        call(bias_table=table, bias_positions=torch.tensor([0, 1, 2, 6, 0], dtype=torch.int32))


# --- the encoder on the torch, triton and cpu backends ---------------------------------------------------------

@pytest.mark.parametrize("layout", ["right", "left", "holes"])
def test_torch_backend_matches_transformers(hf, layout):
    ids, mask = batch(layout=layout)
    with torch.no_grad():
        ref = hf(ids, attention_mask=mask)
    out = Encoder.from_hf(hf, backend="torch", add_pooling_layer=layout != "left")(ids, mask)
    assert rel_err(out.last_hidden_state, ref.last_hidden_state, mask) <= 1e-5
    if layout != "left":  # the pooler reads position 0, which left padding masks
        assert rel_err(out.pooler_output, ref.pooler_output) <= 1e-5


TRITON_REASON = available_backends("cpu").get("triton")


@pytest.mark.skipif(TRITON_REASON is not None, reason=f"backend 'triton' unavailable on CPU: {TRITON_REASON}")
@pytest.mark.parametrize("layout", ["right", "holes"])
def test_triton_backend_matches_transformers(hf, layout):
    # The Triton kernels under the interpreter: the bias gathered per score tile from the per-distance table.
    ids, mask = batch(layout=layout)
    with torch.no_grad():
        ref = hf(ids, attention_mask=mask)
    out = Encoder.from_hf(hf, backend="triton")(ids, mask)
    assert rel_err(out.last_hidden_state, ref.last_hidden_state, mask) <= 1e-5
    assert rel_err(out.pooler_output, ref.pooler_output) <= 1e-5


@pytest.mark.skipif(TRITON_REASON is not None, reason=f"backend 'triton' unavailable on CPU: {TRITON_REASON}")
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_one_token_batch_matches_transformers(hf, backend):
    # One token: the per-distance table is (heads, 1), whose transposed view has a column stride of `heads`
    # (first seen on an H200: the triton backend refused it).
    ids, mask = batch()
    ids, mask = ids[:1, :1], mask[:1, :1]
    with torch.no_grad():
        ref = hf(ids, attention_mask=mask)
    out = Encoder.from_hf(hf, backend=backend)(ids, mask)
    assert rel_err(out.last_hidden_state, ref.last_hidden_state, mask) <= 1e-5


@needs_cpu
def test_cpu_fp32_matches_transformers(isa, hf):
    ids, mask = batch()
    with torch.no_grad():
        ref = hf(ids, attention_mask=mask, output_hidden_states=True)
    out = Encoder.from_hf(hf, backend="cpu", dtype=torch.float32)(ids, mask, output_hidden_states=True)
    assert rel_err(out.last_hidden_state, ref.last_hidden_state, mask) <= 1e-5
    assert rel_err(out.pooler_output, ref.pooler_output) <= 1e-5
    assert bool((out.last_hidden_state[~mask.bool()] == 0).all())
    for a, b in zip(out.hidden_states, ref.hidden_states, strict=True):
        assert rel_err(a, b, mask) <= 1e-5


@needs_cpu
@pytest.mark.parametrize("layout", ["left", "holes"])
def test_cpu_masks_match_transformers(hf, layout):
    ids, mask = batch([40, 1, 12], layout=layout)
    with torch.no_grad():
        ref = hf(ids, attention_mask=mask).last_hidden_state
    out = Encoder.from_hf(hf, backend="cpu", add_pooling_layer=False)(ids, mask).last_hidden_state
    assert rel_err(out, ref, mask) <= 1e-5


@needs_cpu
def test_cpu_bf16_within_twice_hf_bf16(isa, hf):
    ids, mask = batch()
    with torch.no_grad():
        ref = hf(ids, attention_mask=mask).last_hidden_state
        theirs = copy.deepcopy(hf).to(torch.bfloat16)(ids, attention_mask=mask).last_hidden_state
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the slower-than-fp32 notice on some tiers
        enc = Encoder.from_hf(hf, backend="cpu", dtype=torch.bfloat16)
    out = enc(ids, mask).last_hidden_state
    ours, hf_err = rel_err(out, ref, mask), rel_err(theirs, ref, mask)
    assert within(ours, hf_err, torch.bfloat16, floor=0.0, cap=False), f"bf16 {ours:.3g} vs HF bf16 {hf_err:.3g}"


@needs_cpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_batch_invariance(isa, hf, dtype):
    lengths = [20, 1, 9]
    ids, mask = batch(lengths, seed=5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        enc = Encoder.from_hf(hf, backend="cpu", dtype=dtype)
    together = enc(ids, mask).last_hidden_state
    for b, n in enumerate(lengths):
        assert torch.equal(enc(ids[b:b + 1, :n]).last_hidden_state[0], together[b, :n]), f"row {b} differs alone"


def test_saved_directory_and_length_limit(tmp_path, hf):
    hf.save_pretrained(tmp_path)
    ids, mask = batch([30, 4], seed=6)
    with torch.no_grad():
        ref = hf(ids, attention_mask=mask).last_hidden_state
    enc = Encoder.from_pretrained(tmp_path, backend="torch")
    assert rel_err(enc(ids, mask).last_hidden_state, ref, mask) <= 1e-5
    with pytest.raises(ValueError, match="limit of 198 tokens"):  # positions start after MPNet's padding_idx 1
        enc(torch.full((1, 199), 5))
    with pytest.raises(ValueError, match="no token types"):
        enc(ids, mask, token_type_ids=torch.zeros_like(ids))


# --- errors -----------------------------------------------------------------------------------------------------

def test_config_and_checkpoint_errors(hf):
    d = hf.config.to_dict()
    with pytest.raises(bertfast.ConfigError, match="relative_attention_num_buckets' = 16"):
        bertfast.ModelConfig.from_dict({**d, "relative_attention_num_buckets": 16})
    with pytest.raises(bertfast.ConfigError, match="relative_attention_num_buckets' must be an integer"):
        bertfast.ModelConfig.from_dict({**d, "relative_attention_num_buckets": "32"})
    sd = {k: v for k, v in hf.state_dict().items() if k != "encoder.relative_attention_bias.weight"}
    from bertfast.loading import _TensorSource, assemble

    cfg = bertfast.ModelConfig.from_dict(d)
    with pytest.raises(bertfast.LoadError, match="encoder.relative_attention_bias.weight' is missing"):
        assemble(_TensorSource({k: "memory" for k in sd}, sd.__getitem__), cfg)
    bad = {**sd, "encoder.relative_attention_bias.weight": torch.zeros(32, 4)}
    with pytest.raises(bertfast.LoadError, match=r"relative_attention_bias.weight' has shape \(32, 4\)"):
        assemble(_TensorSource({k: "memory" for k in bad}, bad.__getitem__), cfg)
    bad = {**sd, "encoder.relative_attention_bias.weight": torch.zeros(32, 3),
           "encoder.layer.0.attention.attn.q.weight": torch.zeros(96, 95)}
    with pytest.raises(bertfast.LoadError, match="encoder.layer.0.attention.attn.q.weight"):
        assemble(_TensorSource({k: "memory" for k in bad}, bad.__getitem__), cfg)


class _NoMpnet(bertfast.backends.Backend):
    """Stands for a backend that cannot run MPNet yet (every registered one can): only its family list matters."""

    name = "triton"
    unsupported_families = {"mpnet": "no relative position bias"}

    @classmethod
    def unavailable_reason(cls, device):
        return None


def test_backend_listing_mpnet_is_not_picked_for_it(hf, monkeypatch):
    from bertfast import backends

    real = backends._backend_class
    monkeypatch.setattr(backends, "_backend_class", lambda name: _NoMpnet if name == "triton" else real(name))
    with pytest.raises(ValueError, match="does not run mpnet models yet"):
        backends.get_backend("triton", "cuda", family="mpnet")
    with pytest.warns(UserWarning, match="no mpnet models yet"):  # "auto" on CUDA passes over it, says why
        assert backends.get_backend("auto", "cuda", family="mpnet").name == "torch"
    enc = Encoder.from_hf(hf, backend="torch")
    with pytest.raises(bertfast.ConfigError, match="'triton' does not run mpnet models yet"):
        bertfast.engine.Engine(enc.engine.weights, _NoMpnet())


# --- sentence-transformers: all-mpnet-base-v2's stack (mean pooling, Normalize) ----------------------------------

def test_encode_matches_sentence_transformers(tmp_path, minilm_path):
    import sentence_transformers as st
    try:
        from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer
    except ImportError:  # before sentence-transformers 6
        from sentence_transformers.models import Normalize, Pooling, Transformer
    model = build(seed=4, vocab_size=30522, max_position_embeddings=66)
    hf_dir = os.path.join(tmp_path, "hf")
    model.save_pretrained(hf_dir)
    for name in ("tokenizer.json", "vocab.txt", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(os.path.join(minilm_path, name), hf_dir)
    out = os.path.join(tmp_path, "st")
    modules = [Transformer(hf_dir, max_seq_length=64), Pooling(96, pooling_mode="mean"), Normalize()]
    st.SentenceTransformer(modules=modules, device="cpu").save(out)
    texts = ["a short one", "MPNet measures relative positions between columns " * 8, "x", "two words"]
    ref = st.SentenceTransformer(out, device="cpu").encode(texts, convert_to_tensor=True)
    ours = Encoder.from_pretrained(out).encode(texts)
    assert (ours - ref).abs().max().item() <= 1e-5
    accelerated = bertfast.optimize(st.SentenceTransformer(out, device="cpu"), strict=True)
    assert (accelerated.encode(texts, convert_to_tensor=True) - ref).abs().max().item() <= 1e-5
