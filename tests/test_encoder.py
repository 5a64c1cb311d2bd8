"""`bertfast.Encoder` as a drop-in for transformers.BertModel: parity, batch invariance, errors."""

import warnings

import pytest
import torch

import bertfast
from bertfast import Encoder
from conftest import hf_bert, ragged_batch, rel_err

SENTENCES = [
    "Hello world.",
    "The quick brown fox jumps over the lazy dog, then naps in the warm afternoon sun.",
    "x",
    "Padding must never change what a sentence means to the model.",
    "BERT encoders run well on CPUs when the padding is removed.",
]

# Backends checked on every model-level test: those usable on this CPU without the interpreter
# (the triton backend has its own, smaller model tests under TRITON_INTERPRET=1).
CPU_BACKENDS = [name for name, reason in bertfast.available_backends("cpu").items()
                if reason is None and name != "triton"]


@pytest.fixture(scope="module")
def hf_minilm(minilm_path):
    import transformers
    return transformers.BertModel.from_pretrained(minilm_path, attn_implementation="eager").eval()


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_minilm_matches_transformers_on_padded_batch(minilm_path, hf_minilm, backend):
    enc = Encoder.from_pretrained(minilm_path, backend=backend)
    assert enc.backend == backend
    ids, mask, types = enc.tokenize(SENTENCES)
    assert (mask == 0).any(), "the batch must be padded for this test to mean anything"
    with torch.no_grad():
        ref = hf_minilm(input_ids=ids, attention_mask=mask, token_type_ids=types)
    out = enc(ids, mask, types)
    assert out.last_hidden_state.shape == ref.last_hidden_state.shape
    assert rel_err(out.last_hidden_state, ref.last_hidden_state, mask) <= 1e-5
    assert rel_err(out.pooler_output, ref.pooler_output) <= 1e-5
    assert (out.last_hidden_state[~mask.bool()] == 0).all()  # documented: padded positions are 0


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_sentence_alone_equals_inside_batch(minilm_path, backend):
    enc = Encoder.from_pretrained(minilm_path, backend=backend)
    ids, mask, types = enc.tokenize(SENTENCES)
    batch = enc(ids, mask, types)
    for i, s in enumerate(SENTENCES):
        a_ids, a_mask, a_types = enc.tokenize([s])
        alone = enc(a_ids, a_mask, a_types)
        n = int(a_mask.sum())
        # Not bitwise: BLAS blocking depends on the number of rows, so sums round differently.
        # The bar is fp32 parity; padding leaking into a sentence would show as O(1) errors.
        assert rel_err(batch.last_hidden_state[i, :n], alone.last_hidden_state[0, :n]) <= 1e-5
        assert rel_err(batch.pooler_output[i], alone.pooler_output[0]) <= 1e-5


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("overrides", [
    pytest.param(dict(hidden_size=312, num_attention_heads=12, intermediate_size=400), id="d26"),
    pytest.param(dict(hidden_size=128, num_attention_heads=4, intermediate_size=256, hidden_act="gelu_new"), id="d32"),
    pytest.param(dict(hidden_size=256, num_attention_heads=4, intermediate_size=512), id="d64"),
    pytest.param(dict(hidden_size=160, num_attention_heads=2, intermediate_size=320, num_hidden_layers=1,
                      hidden_act="relu"), id="d80"),
])
def test_random_configs_match_transformers(overrides, backend):
    model = hf_bert(seed=21, attn="sdpa", **overrides)
    P = model.config.max_position_embeddings
    ids, mask, types = ragged_batch([P, 1, 9, 33, 2], seqlen=P, seed=22)
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask, token_type_ids=types, output_hidden_states=True)
    out = Encoder.from_hf(model, backend=backend)(ids, mask, types, output_hidden_states=True)
    assert rel_err(out.last_hidden_state, ref.last_hidden_state, mask) <= 1e-5
    assert rel_err(out.pooler_output, ref.pooler_output) <= 1e-5
    for ours, theirs in zip(out.hidden_states, ref.hidden_states, strict=True):
        assert rel_err(ours, theirs, mask) <= 1e-5


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_left_padding_and_holes(backend):
    model = hf_bert(seed=23)
    ids, _, types = ragged_batch([8, 8, 8], seed=24)
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1], [1, 0, 1, 1, 0, 1, 1, 0], [1] * 8])
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask, token_type_ids=types)
    enc = Encoder.from_hf(model, backend=backend, add_pooling_layer=False)
    out = enc(ids, mask, types)
    assert out.pooler_output is None
    assert rel_err(out.last_hidden_state, ref.last_hidden_state, mask) <= 1e-5
    with pytest.raises(ValueError, match="left padding"):
        Encoder.from_hf(model, backend=backend)(ids, mask, types)


def test_output_behaves_like_transformers_output():
    model = hf_bert(seed=25)
    ids, mask, types = ragged_batch([3, 5], seed=26)
    out = Encoder.from_hf(model, backend="torch")(ids, mask, types)
    assert out[0] is out.last_hidden_state and out[1] is out.pooler_output
    assert out["pooler_output"] is out.pooler_output and len(out) == 2
    last, pooled = out
    assert last.shape == (2, 5, 64) and pooled.shape == (2, 64)
    tup = Encoder.from_hf(model, backend="torch")(ids, mask, return_dict=False)
    assert isinstance(tup, tuple) and len(tup) == 2


def test_defaults_match_transformers_defaults():
    model = hf_bert(seed=27)
    ids, _, _ = ragged_batch([6, 6], seed=28)
    with torch.no_grad():
        ref = model(input_ids=ids)
    out = Encoder.from_hf(model, backend="torch")(ids)
    assert rel_err(out.last_hidden_state, ref.last_hidden_state) <= 1e-5


def test_dtype_conversion_at_load():
    model = hf_bert(seed=29)
    enc = Encoder.from_hf(model, backend="torch", dtype=torch.bfloat16)
    assert enc.dtype == torch.bfloat16
    ids, mask, types = ragged_batch([4, 2], seed=30)
    assert enc(ids, mask, types).last_hidden_state.dtype == torch.bfloat16
    assert next(model.parameters()).dtype == torch.float32  # the user's model is untouched


@pytest.mark.parametrize("backend, dtype", [(b, d) for b in CPU_BACKENDS for d in (torch.bfloat16, torch.float32)]
                         + [("cpu", "int8")] * ("cpu" in CPU_BACKENDS))
def test_output_dtype_float32_is_the_unrounded_stream(backend, dtype):
    """forward(output_dtype=torch.float32): every output fp32, each the very values the default output rounds to the
    engine's dtype (where the backend keeps a wider stream, as the cpu backend does under bf16) or equals."""
    model = hf_bert(seed=33)
    enc = Encoder.from_hf(model, backend=backend, dtype=dtype)
    ids, mask, types = ragged_batch([7, 3, 12], seed=34)
    plain = enc(ids, mask, types, output_hidden_states=True)
    wide = enc(ids, mask, types, output_hidden_states=True, output_dtype=torch.float32)
    outs = [(wide.last_hidden_state, plain.last_hidden_state), (wide.pooler_output, plain.pooler_output)]
    outs += list(zip(wide.hidden_states, plain.hidden_states))
    for w, p in outs:
        assert w.dtype == torch.float32 and w.shape == p.shape
        assert torch.equal(w.to(p.dtype), p)
    with torch.no_grad():
        ref = model(ids, attention_mask=mask, token_type_ids=types)
    stream_wider = enc.engine.backend.stream_dtype(enc.dtype) != enc.dtype
    real = mask.bool()  # transformers' padded positions hold values, the engine's zeros
    if stream_wider:  # unrounded: closer to fp32 than the rounded output
        assert rel_err(wide.last_hidden_state[real], ref.last_hidden_state[real]) < rel_err(
            plain.last_hidden_state[real].float(), ref.last_hidden_state[real])
    assert stream_wider == (backend == "cpu" and dtype == torch.bfloat16)
    with pytest.raises(ValueError, match="output_dtype takes None"):
        enc(ids, mask, output_dtype=torch.float16)


# --- bad input ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny():
    return Encoder.from_hf(hf_bert(seed=31), backend="torch")


@pytest.mark.parametrize("kwargs, match", [
    (dict(input_ids=torch.tensor([[1, 2, 97]])), r"input_ids values must be in \[0, 97\)"),
    (dict(input_ids=torch.tensor([[1, -2]])), r"input_ids values"),
    (dict(input_ids=torch.ones(1, 41, dtype=torch.long)), "exceeds the model.s limit of 40 tokens"),
    (dict(input_ids=torch.ones(2, 3, dtype=torch.long), attention_mask=torch.ones(2, 4)), "attention_mask has shape"),
    (dict(input_ids=torch.ones(2, 3, dtype=torch.long), attention_mask=torch.full((2, 3), 2)), "only 0 and 1"),
    (dict(input_ids=torch.ones(2, 3, dtype=torch.long), token_type_ids=torch.ones(2, 3, dtype=torch.long) * 2),
     r"token_type_ids values must be in \[0, 2\)"),
    (dict(input_ids=torch.ones(2, 3, dtype=torch.long), token_type_ids=torch.ones(3, 3, dtype=torch.long)),
     "token_type_ids has shape"),
    (dict(input_ids=torch.ones(1, 3, dtype=torch.long), position_ids=torch.tensor([[0, 1, 40]])),
     "position_ids values"),
    (dict(input_ids=torch.ones(2, 3)), "integer tensor"),
    (dict(input_ids=torch.ones(3, dtype=torch.long)), r"shape \(batch, seq_len\)"),
    (dict(input_ids=torch.ones(0, 3, dtype=torch.long)), "empty batch"),
    (dict(input_ids=torch.ones(2, 0, dtype=torch.long)), "empty batch"),
    (dict(input_ids=[[1, 2]]), "must be a torch.Tensor"),
], ids=lambda v: None if isinstance(v, dict) else v[:24])
def test_bad_inputs_raise_value_error(tiny, kwargs, match):
    with pytest.raises(ValueError, match=match):
        tiny(**kwargs)


def test_row_of_padding_only_is_defined(tiny):
    ids, mask, types = ragged_batch([4, 0, 2], seed=32)
    out = tiny(ids, mask, types)
    assert torch.isfinite(out.last_hidden_state).all() and (out.last_hidden_state[1] == 0).all()


def test_backend_errors(monkeypatch):
    model = hf_bert(seed=33)
    with pytest.raises(ValueError, match="unknown backend 'gpu'.*torch"):
        Encoder.from_hf(model, backend="gpu")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="backend 'triton' is not available.*Available here: .*torch"):
        Encoder.from_hf(model, backend="triton")


def test_auto_picks_an_available_backend():
    enc = Encoder.from_hf(hf_bert(seed=34))
    assert enc.backend in CPU_BACKENDS


# --- encode -----------------------------------------------------------------------------------

def test_encode_mean_and_cls_pooling(minilm_path):
    enc = Encoder.from_pretrained(minilm_path, backend="torch")
    emb = enc.encode(SENTENCES, batch_size=2, normalize=False)  # the checkpoint's Normalize module skipped
    assert emb.shape == (len(SENTENCES), 384) and emb.dtype == torch.float32
    ids, mask, types = enc.tokenize(SENTENCES[:1])
    last = enc(ids, mask, types).last_hidden_state[0]
    assert torch.allclose(emb[0], last.mean(0), atol=1e-6)
    cls = enc.encode(SENTENCES[:2], pooling="cls", normalize=True)
    assert torch.allclose(cls.norm(dim=-1), torch.ones(2), atol=1e-6)
    assert torch.allclose(cls[0], torch.nn.functional.normalize(last[0], dim=0), atol=1e-6)
    # related sentences are closer than unrelated ones (the model really encodes meaning)
    e = enc.encode(["A cat sits on a mat.", "A kitten rests on a rug.", "Interest rates rose again."],
                   normalize=True)
    assert e[0] @ e[1] > e[0] @ e[2] + 0.2
    with pytest.raises(ValueError, match="pooling"):
        enc.encode(["a"], pooling="median")


def test_tokenize_matches_the_tokenizer_and_pads_right(tiny_text_model):
    enc = Encoder.from_pretrained(tiny_text_model, backend="cpu")
    texts = ["a b", "hello there world, again"]
    ids, mask, types = enc.tokenize(texts)
    for i, e in enumerate(enc.tokenizer.encode_batch(texts)):
        assert ids[i].tolist() == e.ids and mask[i].tolist() == e.attention_mask and types[i].tolist() == e.type_ids
    assert ids.dtype == mask.dtype == types.dtype == torch.int64 and mask[0, -1] == 0 and mask[1].all()
    assert [tuple(t.shape) for t in enc.tokenize([])] == [(0, 0)] * 3


def test_encode_without_tokenizer_raises():
    with pytest.raises(ValueError, match="no tokenizer"):
        Encoder.from_hf(hf_bert(seed=35), backend="torch").encode(["hello"])


def test_int8_needs_a_backend_that_offers_it():
    model = hf_bert(seed=36)
    with pytest.raises(ValueError, match="backend 'torch' does not support 'int8' quantization"):
        Encoder.from_hf(model, backend="torch", dtype="int8")


def test_auto_warns_once_when_it_passes_over_a_faster_backend(monkeypatch):
    from bertfast import backends

    monkeypatch.setitem(backends.REGISTRY, "missing", "bertfast.backends.not_built:Nothing")
    monkeypatch.setitem(backends.AUTO_ORDER, "cpu", ("missing", "torch"))
    monkeypatch.setattr(backends, "_warned", set())
    with pytest.warns(UserWarning, match="using 'torch', not the faster 'missing'"):
        assert backends.get_backend("auto", "cpu").name == "torch"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        backends.get_backend("auto", "cpu")  # once only
