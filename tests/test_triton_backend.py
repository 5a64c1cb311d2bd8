"""The triton backend end to end: Encoder(backend="triton") under the Triton interpreter vs the
reference model, on tiny random BERTs with ragged batches.

TRITON_INTERPRET=1 is set before bertfast is imported (Triton fixes the mode when the kernels are
defined). If something imported `bertfast.kernels.triton` earlier without it, the tests are skipped, naming
that condition.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from bertfast import Encoder, ModelConfig, reference  # noqa: E402
from bertfast.backends.weights import EmbeddingWeights, LayerWeights, ModelWeights  # noqa: E402
from bertfast.accuracy import rel_error, within  # noqa: E402

from bertfast.kernels import triton as _ops
pytestmark = pytest.mark.skipif(not _ops.INTERPRET, reason="bertfast.kernels.triton was imported before TRITON_INTERPRET=1 "
                                "was set in this process, so its kernels were built for GPU")


def random_weights(hidden, heads, layers=1, inter=None, vocab=41, maxpos=12, act="gelu", seed=0) -> ModelWeights:
    """Random fp64 BERT weights (biases and LayerNorm perturbed so every term is exercised)."""
    inter = inter or 2 * hidden
    cfg = ModelConfig.from_dict(dict(model_type="bert", hidden_size=hidden, num_attention_heads=heads,
                                     num_hidden_layers=layers, intermediate_size=inter, hidden_act=act,
                                     vocab_size=vocab, max_position_embeddings=maxpos, type_vocab_size=2,
                                     layer_norm_eps=1e-12))
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=1.0, offset=0.0):
        return torch.randn(*shape, generator=g, dtype=torch.float64) * scale + offset

    H, I = hidden, inter
    emb = EmbeddingWeights(r(vocab, H), r(maxpos, H, scale=0.3), r(2, H, scale=0.3), r(H, scale=0.1, offset=1),
                           r(H, scale=0.1))
    layer_list = [LayerWeights(r(3 * H, H, scale=H ** -0.5), r(3 * H, scale=0.1), r(H, H, scale=H ** -0.5),
                               r(H, scale=0.1), r(H, scale=0.1, offset=1), r(H, scale=0.1),
                               r(I, H, scale=H ** -0.5), r(I, scale=0.1), r(H, I, scale=I ** -0.5), r(H, scale=0.1),
                               r(H, scale=0.1, offset=1), r(H, scale=0.1))
                  for _ in range(layers)]
    return ModelWeights(cfg, emb, layer_list, r(H, H, scale=H ** -0.5), r(H, scale=0.1))


def ragged(lengths, S, vocab=41, seed=0):
    g = torch.Generator().manual_seed(seed)
    mask = (torch.arange(S)[None, :] < torch.tensor(lengths)[:, None]).long()
    ids = torch.randint(1, vocab, (len(lengths), S), generator=g) * mask
    types = torch.randint(0, 2, (len(lengths), S), generator=g) * mask
    return ids, mask, types


def errors(out, weights64, ids, mask, types):
    """(max abs error of last_hidden_state on real tokens, of pooler_output) vs the fp64 reference."""
    last, pooled, _ = reference.forward(weights64, ids, mask, types)
    real = mask.bool()
    e_last = (out.last_hidden_state.double()[real] - last[real]).abs().max().item()
    e_pool = (out.pooler_output.double() - pooled).abs().max().item()
    return e_last, e_pool


# (hidden, heads): head dims 26 (odd) and 32; lengths: ragged with a length-1 row and one at the
# position limit (maxpos = 12).
CONFIGS = [pytest.param(52, 2, "gelu", id="H52-h2-d26-gelu"), pytest.param(64, 2, "gelu_new", id="H64-h2-d32-tanh")]
LENGTHS = [12, 1, 7, 3]


@pytest.mark.parametrize("hidden,heads,act", CONFIGS)
def test_fp32_matches_reference(hidden, heads, act):
    w64 = random_weights(hidden, heads, layers=2, act=act)
    enc = Encoder(w64.to(torch.float32), backend="triton")
    assert enc.backend == "triton"
    ids, mask, types = ragged(LENGTHS, 12)
    out = enc(ids, mask, types, output_hidden_states=True)
    e_last, e_pool = errors(out, w64, ids, mask, types)
    # Padded positions are defined as 0 by the engine; they are checked as such, not compared.
    assert torch.equal(out.last_hidden_state[~mask.bool()], torch.zeros_like(out.last_hidden_state[~mask.bool()]))
    assert e_last < 1e-5 and e_pool < 1e-5, (e_last, e_pool)
    assert len(out.hidden_states) == 3


def test_fp16_no_worse_than_twice_reference_fp16():
    w64 = random_weights(64, 2, layers=2)
    ids, mask, types = ragged(LENGTHS, 12, seed=1)
    ours = Encoder(w64.to(torch.float16), backend="triton")(ids, mask, types)
    ref16_last, ref16_pool, _ = reference.forward(w64.to(torch.float16), ids, mask, types)

    class _Ref:  # the reference's own fp16 output, scored the same way
        last_hidden_state, pooler_output = ref16_last, ref16_pool

    e_ours, e_ref = errors(ours, w64, ids, mask, types), errors(_Ref, w64, ids, mask, types)
    for name, eo, er in zip(("last_hidden_state", "pooler_output"), e_ours, e_ref):
        assert within(eo, er, torch.float16, cap=False), f"{name}: ours {eo:.3g} vs reference fp16 {er:.3g}"


def test_sequence_alone_equals_sequence_in_batch():
    w = random_weights(52, 2, seed=3).to(torch.float32)
    enc = Encoder(w, backend="triton")
    ids, mask, types = ragged([9, 4, 1], 9, seed=2)
    batch = enc(ids, mask, types).last_hidden_state
    alone = enc(ids[1:2, :4], mask[1:2, :4], types[1:2, :4]).last_hidden_state
    assert torch.equal(alone[0], batch[1, :4])


def test_backend_reports_interpreter_requirement(monkeypatch):
    from bertfast.backends.cuda.triton import TritonBackend

    assert TritonBackend.unavailable_reason("cpu") is None
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert "TRITON_INTERPRET=1" in TritonBackend.unavailable_reason("cpu")


def test_bf16_on_cpu_is_rejected_with_a_reason():
    w = random_weights(32, 2).to(torch.bfloat16)
    with pytest.raises(ValueError, match="Triton interpreter.*float16"):
        Encoder(w, backend="triton")


def test_kernels_built_for_gpu_reject_cpu_tensors_with_a_reason():
    # Imported without the interpreter, the kernels are GPU builds: CPU tensors raise ValueError
    # (not a Triton crash) and the backend reports why it is unavailable.
    import subprocess
    import sys

    code = "\n".join([
        "import os, torch",
        "from bertfast.kernels.triton.linear import linear",
        "from bertfast.backends.cuda.triton import TritonBackend",
        "try:",
        "    linear(torch.ones(2, 3), torch.ones(4, 3))",
        "except ValueError as e:",
        "    print('ValueError:', e)",
        "os.environ['TRITON_INTERPRET'] = '1'",
        "print('reason:', TritonBackend.unavailable_reason('cpu'))",
    ])
    env = dict(os.environ, TRITON_INTERPRET="0")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "ValueError: linear: CPU tensors need the Triton interpreter" in proc.stdout
    assert "reason: bertfast.kernels.triton was imported before TRITON_INTERPRET=1" in proc.stdout


# Issue 4's parity bar: transformers itself, fp32, head dims 26/32/64/80 (hidden 312, 384, 768 at 2
# layers; 160 at 1 layer), ragged lengths with a length-1 row and a row at the position limit.
HF_CONFIGS = [pytest.param(312, 12, 2, id="H312-d26"), pytest.param(384, 12, 2, id="H384-d32"),
              pytest.param(768, 12, 2, id="H768-d64"), pytest.param(160, 2, 1, id="H160-d80")]


@pytest.mark.parametrize("hidden,heads,layers", HF_CONFIGS)
def test_fp32_matches_transformers(hidden, heads, layers):
    import transformers
    torch.manual_seed(7)
    cfg = transformers.BertConfig(vocab_size=41, hidden_size=hidden, num_hidden_layers=layers,
                                  num_attention_heads=heads, intermediate_size=2 * hidden,
                                  max_position_embeddings=12, attn_implementation="eager")
    model = transformers.BertModel(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "LayerNorm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    ids, mask, types = ragged(LENGTHS, 12, seed=5)
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask, token_type_ids=types)
    out = Encoder.from_hf(model, backend="triton")(ids, mask, types)
    rel = rel_error(out.last_hidden_state, ref.last_hidden_state, mask)
    rel_pool = rel_error(out.pooler_output, ref.pooler_output)
    assert rel <= 1e-5 and rel_pool <= 1e-5, (rel, rel_pool)


@pytest.mark.parametrize("family", ["bert", "roberta", "xlm-roberta", "electra", "albert", "distilbert", "mpnet"])
def test_each_family_matches_transformers(family):
    from helpers.families import batch_for, build

    model = build(family, seed=8)
    kwargs, mask = batch_for(model, [12, 1, 7], seed=9)
    with torch.no_grad():
        ref = model(**kwargs).last_hidden_state
    out = Encoder.from_hf(model, backend="triton")(**kwargs).last_hidden_state
    rel = rel_error(out, ref, mask)
    assert rel <= 1e-5, rel


def test_key_mask_matches_transformers():
    """ColBERT's query expansion: every token computed, the masked ones attended to by none (`engine.key_bias`: the
    p2c term of the attention), against transformers with an attention mask of 0 there, its outputs at every
    position; rows of 1, 13 and 20 keys."""
    from conftest import hf_bert

    model = hf_bert(max_position_embeddings=24)
    ids = torch.randint(3, 97, (3, 20), generator=torch.Generator().manual_seed(3))
    key_mask = (torch.arange(20)[None, :] < torch.tensor([1, 13, 20])[:, None]).long()
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=key_mask).last_hidden_state
    enc = Encoder.from_hf(model, backend="triton", add_pooling_layer=False)
    out = enc._run(ids, torch.ones_like(key_mask), None, None, False, pool=False, key_mask=key_mask)[0]
    assert rel_error(out, ref) <= 1e-5


# ---- the ops rotary, gated and sliding-window models use (issue 19), through the backend's signatures ----


def modern_layer(ops, x, w, cu, max_seqlen, heads, rotary, window):
    """A ModernBERT-style pre-norm layer from the backend's ops: no biases, RoPE in the QKV projection, a
    sliding window, a GeGLU FFN."""
    d = x.shape[1] // heads
    h = ops.layernorm(x, w["ln1"], w["ln1_b"], 1e-5)
    q, k, v = ops.qkv(h, w["qkv"], None, heads, rotary=rotary)
    ctx = ops.attention(q, k, v, cu, max_seqlen, d ** -0.5, window=window)
    x = ops.linear(ctx, w["out"], None, residual=x)
    h = ops.layernorm(x, w["ln2"], w["ln2_b"], 1e-5)
    h = ops.linear(h, w["ffn_in"], None, act="gelu", gated=True)
    return ops.linear(h, w["ffn_out"], None, residual=x)


def modern_inputs(lengths, hidden=64, heads=2, inter=96, seed=0):
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=1.0, offset=0.0):
        return torch.randn(*shape, generator=g, dtype=torch.float64) * scale + offset

    H = hidden
    zeros = torch.zeros(H, dtype=torch.float64)  # ModernBERT's norms have no bias
    w = {"ln1": r(H, scale=0.1, offset=1), "ln1_b": zeros, "qkv": r(3 * H, H, scale=H ** -0.5),
         "out": r(H, H, scale=H ** -0.5), "ln2": r(H, scale=0.1, offset=1), "ln2_b": zeros,
         "ffn_in": r(2 * inter, H, scale=H ** -0.5), "ffn_out": r(H, inter, scale=inter ** -0.5)}
    x = r(sum(lengths), H)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    positions = torch.cat([torch.arange(n, dtype=torch.float64) for n in lengths])
    inv_freq = 10000.0 ** (-torch.arange(0, H // heads, 2, dtype=torch.float64) / (H // heads))
    angles = positions[:, None] * inv_freq[None, :]
    from bertfast.backends import Rotary

    return x, w, cu, max(lengths), Rotary(angles.cos().float(), angles.sin().float())


# Lengths: a 1-token row, rows at (w + 1 = 9) and one past (10) the window's reach, a row longer than the
# interpreter's 64-row query tile.
MODERN_LENGTHS = [1, 9, 10, 70]


@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, id="fp32"), pytest.param(torch.float16, id="fp16")])
def test_modern_layer_ops_match_torch_backend(dtype):
    from bertfast.backends.torch import TorchBackend
    from bertfast.backends.cuda.triton import TritonBackend

    x, w, cu, max_seqlen, rotary = modern_inputs(MODERN_LENGTHS)
    cast = lambda t: {k: v.to(dtype) for k, v in t.items()} if isinstance(t, dict) else t.to(dtype)  # noqa: E731
    ours = modern_layer(TritonBackend(), x.to(dtype), cast(w), cu, max_seqlen, 2, rotary, 8)
    ref_low = modern_layer(TorchBackend(), x.to(dtype), cast(w), cu, max_seqlen, 2, rotary, 8)
    # The fp64 oracle (reference.rotate computes the rotation itself in fp32, ~1e-7 off fp64).
    ref_hi = modern_layer(TorchBackend(), x, w, cu, max_seqlen, 2, rotary, 8)
    e_ours, e_ref = ((t.double() - ref_hi).abs().max().item() for t in (ours, ref_low))
    scale = ref_hi.abs().max().item()
    assert ours.dtype == dtype and ours.shape == ref_hi.shape
    assert within(e_ours / scale, e_ref / scale, dtype, cap=dtype != torch.float16), (e_ours, e_ref, scale)
    if dtype == torch.float32:
        assert e_ours / scale < 1e-5, e_ours / scale


def test_gated_linear_takes_no_residual_and_bias_may_be_none():
    from bertfast.backends.cuda.triton import TritonBackend

    ops = TritonBackend()
    x, w = torch.randn(5, 8), torch.randn(12, 8)
    with pytest.raises(ValueError, match="gated linear takes no residual"):
        ops.linear(x, w, None, act="silu", residual=torch.randn(5, 6), gated=True)
    torch.testing.assert_close(ops.linear(x, w, None, act="silu", gated=True), reference.linear_glu(x, w, None, "silu"))
    torch.testing.assert_close(ops.linear(x, w, None), x @ w.T)
