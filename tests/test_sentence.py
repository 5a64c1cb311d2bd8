"""Sentence-transformers checkpoints: `Encoder.encode` follows their configuration, and
`bertfast.optimize(SentenceTransformer)` keeps `model.encode` exact. Reference: sentence-transformers."""

import json
import os
import shutil
import warnings

os.environ["HF_HUB_OFFLINE"] = "1"  # nothing here may download; set before the hub libraries load

import pytest
import torch
import sentence_transformers as st

import bertfast
from bertfast import ConfigError, Encoder
from conftest import hf_bert
from helpers.sentences import max_diff, sentences

try:
    from sentence_transformers.sentence_transformer.modules import Dense, Normalize, Pooling, Transformer
except ImportError:  # releases before 6.0
    from sentence_transformers.models import Dense, Normalize, Pooling, Transformer

TOL = 1e-5  # fp32 parity, max abs difference over every embedding coordinate


@pytest.fixture(scope="module")
def minilm(minilm_path):
    return minilm_path


@pytest.fixture(scope="module")
def texts():
    return sentences(250, seed=1)


def test_minilm_encode_matches_sentence_transformers(minilm, texts):
    model = st.SentenceTransformer(minilm, device="cpu")
    assert model.max_seq_length == 256
    ref = model.encode(texts, convert_to_tensor=True)
    enc = Encoder.from_pretrained(minilm)
    assert max(len(ids) for ids in enc.tokenizer.encode_batch(texts[5::25])) == 256, "long texts must truncate"
    ours = enc.encode(texts)
    assert ours.shape == ref.shape == (len(texts), 384) and ours.dtype == torch.float32
    assert torch.allclose(ours.norm(dim=-1), torch.ones(len(texts)), atol=1e-6)  # the Normalize module
    assert max_diff(ours, ref) <= TOL

    bertfast.optimize(model, strict=True)  # strict: any call the engine did not serve would raise
    assert type(model[0].auto_model).__name__ == "BertModel"
    fast = model.encode(texts, convert_to_tensor=True)
    assert max_diff(fast, ref) <= TOL


def test_minilm_explicit_arguments_override_the_configuration(minilm):
    enc = Encoder.from_pretrained(minilm)
    some = sentences(6, seed=2, long_every=100)
    ids, mask, types = enc.tokenize(some[:1])
    last = enc(ids, mask, types).last_hidden_state[0]
    raw = enc.encode(some, normalize=False)
    # the text alone vs inside a batch: fp32 parity, not bitwise (GEMM blocking depends on the rows)
    assert max_diff(raw[0], last.mean(0)) <= TOL
    assert max_diff(enc.encode(some), torch.nn.functional.normalize(raw, dim=-1)) <= 1e-6
    cls = enc.encode(some, pooling="cls")
    assert max_diff(cls[0], torch.nn.functional.normalize(last[0], dim=0)) <= TOL
    both = enc.encode(some, pooling=("cls", "max"), normalize=False)
    assert both.shape == (6, 768) and max_diff(both[0, 384:], last.max(0).values) <= TOL
    short = enc.encode(some, truncate_dim=32, normalize=True)
    assert short.shape == (6, 32) and torch.allclose(short.norm(dim=-1), torch.ones(6), atol=1e-6)
    array = enc.encode(some, convert_to_numpy=True)
    assert type(array).__module__ == "numpy" and array.shape == (6, 384)
    assert max_diff(torch.from_numpy(array), enc.encode(some)) == 0
    assert enc.encode("one text").shape == (1, 384) and enc.encode([]).shape == (0, 384)


# --- small random checkpoints written with their own sentence-transformers modules ---------------

def write_checkpoint(directory, minilm, seed=0, modules=None, st_config=None, **overrides):
    """A random BERT (hidden 64, 64 positions) with MiniLM's tokenizer; then modules.json and the
    module configs that sentence-transformers itself saves for `modules` (built on its Transformer)."""
    model = hf_bert(seed=seed, vocab_size=30522, max_position_embeddings=64, **overrides)
    hf_dir = os.path.join(directory, "hf")
    model.save_pretrained(hf_dir)
    for name in ("tokenizer.json", "vocab.txt", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(os.path.join(minilm, name), hf_dir)
    if modules is None:
        return hf_dir
    out = os.path.join(directory, "st")
    st.SentenceTransformer(modules=[Transformer(hf_dir), *modules(64)], device="cpu").save(out)
    if st_config is not None:
        path = os.path.join(out, "config_sentence_transformers.json")
        with open(path) as f:
            config = json.load(f)
        with open(path, "w") as f:
            json.dump({**config, **st_config}, f)
    return out


POOLINGS = ["cls", "max", "mean", "mean_sqrt_len_tokens", "weightedmean", "lasttoken", ("cls", "mean", "max")]


@pytest.mark.parametrize("mode", POOLINGS, ids=lambda m: m if isinstance(m, str) else "+".join(m))
def test_every_pooling_mode_matches_sentence_transformers(tmp_path, minilm, mode):
    path = write_checkpoint(tmp_path, minilm, seed=3, modules=lambda h: [Pooling(h, pooling_mode=mode)])
    some = sentences(40, seed=4, long_every=7, long_words=(60, 90))  # past the 64 positions
    ref = st.SentenceTransformer(path, device="cpu").encode(some, convert_to_tensor=True, batch_size=8)
    ours = Encoder.from_pretrained(path).encode(some, batch_size=8)
    assert ours.shape == ref.shape and max_diff(ours, ref) <= TOL


def test_legacy_pooling_config_and_dense_normalize_stack(tmp_path, minilm):
    path = write_checkpoint(tmp_path, minilm, seed=5, modules=lambda h: [
        Pooling(h, pooling_mode=("max", "mean")), Dense(2 * h, 24, activation_function=torch.nn.Tanh()),
        Dense(24, 24, activation_function=None),
        Normalize()])
    with open(os.path.join(path, "1_Pooling", "config.json"), "w") as f:  # the pre-6.0 format
        json.dump({"word_embedding_dimension": 64, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True,
                   "pooling_mode_max_tokens": True, "pooling_mode_mean_sqrt_len_tokens": False}, f)
    some = sentences(30, seed=6, long_words=(60, 90))
    ref = st.SentenceTransformer(path, device="cpu").encode(some, convert_to_tensor=True)
    enc = Encoder.from_pretrained(path)
    assert enc.sentence_config.pooling == ("max", "mean")  # sentence-transformers' concatenation order
    ours = enc.encode(some)
    assert ours.shape == (30, 24) and max_diff(ours, ref) <= TOL


@pytest.mark.parametrize("mode", ["mean", "cls", "lasttoken"])
def test_prompts_follow_sentence_transformers(tmp_path, minilm, mode):
    path = write_checkpoint(
        tmp_path, minilm, seed=7, modules=lambda h: [Pooling(h, pooling_mode=mode, include_prompt=False)],
        st_config={"prompts": {"query": "query: ", "doc": "passage of text: "}, "default_prompt_name": "query"})
    some = sentences(20, seed=8, long_words=(60, 90))
    model = st.SentenceTransformer(path, device="cpu")
    enc = Encoder.from_pretrained(path)
    for kwargs in ({}, {"prompt_name": "doc"}, {"prompt": "Represent this: "}):
        ref = model.encode(some, convert_to_tensor=True, **kwargs)
        assert max_diff(enc.encode(some, **kwargs), ref) <= TOL, kwargs
    with pytest.raises(ValueError, match="prompt name 'nope' is not one of the configured prompts"):
        enc.encode(some, prompt_name="nope")
    assert max_diff(enc.encode(some, prompt_name="document"), model.encode(some, prompt_name="document")) <= TOL


def test_optimized_sentence_transformer_with_dense_stack(tmp_path, minilm):
    path = write_checkpoint(tmp_path, minilm, seed=9, modules=lambda h: [
        Pooling(h, pooling_mode="weightedmean"), Dense(h, 16), Normalize()])
    some = sentences(30, seed=10, long_words=(60, 90))
    model = st.SentenceTransformer(path, device="cpu")
    ref = model.encode(some, convert_to_tensor=True)
    keys = list(model.state_dict())
    bertfast.optimize(model, strict=True)
    assert list(model.state_dict()) == keys
    assert [type(m).__name__ for m in model][1:] == ["Pooling", "Dense", "Normalize"]
    assert max_diff(model.encode(some, convert_to_tensor=True), ref) <= TOL
    assert max_diff(Encoder.from_pretrained(path).encode(some), ref) <= TOL


def test_optimize_falls_back_on_a_model_the_engine_does_not_serve(tmp_path, minilm):
    path = write_checkpoint(tmp_path, minilm, seed=11, modules=lambda h: [Pooling(h)],
                            position_embedding_type="relative_key")
    model = st.SentenceTransformer(path, device="cpu")
    some = sentences(4, seed=12)
    ref = model.encode(some, convert_to_tensor=True)
    with pytest.raises(bertfast.EngineUnsupported, match="position_embedding_type"):
        bertfast.optimize(model, strict=True)
    with pytest.warns(UserWarning, match="cannot serve this SentenceTransformer.*position_embedding_type"):
        assert bertfast.optimize(model) is model
    assert type(model[0].auto_model).__mro__[1].__name__ != "_EngineForward"
    assert max_diff(model.encode(some, convert_to_tensor=True), ref) == 0


def test_plain_checkpoint_gets_mean_pooling(tmp_path, minilm):
    path = write_checkpoint(tmp_path, minilm, seed=13)
    some = sentences(10, seed=14)
    ref = st.SentenceTransformer(path, device="cpu").encode(some, convert_to_tensor=True)
    enc = Encoder.from_pretrained(path)
    assert enc.sentence_config.pooling == ("mean",) and not enc.sentence_config.normalizes
    assert max_diff(enc.encode(some), ref) <= TOL


def test_progress_bar(minilm, capsys):
    enc = Encoder.from_pretrained(minilm)
    some = sentences(12, seed=15, long_every=100)
    enc.encode(some, batch_size=4, show_progress_bar=True)
    err = capsys.readouterr().err
    assert "Batches" in err and "3/3" in err
    enc.encode(some, batch_size=4, show_progress_bar=False)
    enc.encode(some, batch_size=1)  # default: only on a terminal (pytest captures stderr: none)
    assert capsys.readouterr().err == ""


# --- bad configurations --------------------------------------------------------------------------

def _modules(path, entries):
    with open(os.path.join(path, "modules.json"), "w") as f:
        json.dump([{"idx": i, "name": str(i), "path": p, "type": t} for i, (p, t) in enumerate(entries)], f)


TRANSFORMER = ("", "sentence_transformers.models.Transformer")


@pytest.mark.parametrize("case, match", [
    ("no-pooling-config", r"1_Pooling.config\.json is missing"),
    ("unknown-mode", r"unknown pooling mode 'median'"),
    ("legacy-bad-dimension", r"embedding dimension 32 does not match the model's hidden size 64"),
    ("unsupported-module", r"module 2 \(sentence_transformers.models.LayerNorm.*not supported"),
    ("foreign-module", r"module 2 \(my_package.Pooling.*not supported"),
    ("no-pooling", r"needs a Pooling module right after the Transformer"),
    ("transformer-in-subdir", r"first module must be the Transformer in the model's own directory"),
    ("bad-json", r"modules.json.*not valid JSON"),
    ("bad-default-prompt", r"default_prompt_name 'passage' is not one of the prompts \['doc', 'document', 'query'\]"),
    ("dense-bad-activation", r"activation_function 'my.Activation' is not supported"),
])
def test_bad_configurations_raise_config_error(tmp_path, minilm, case, match):
    path = write_checkpoint(tmp_path, minilm, seed=16)
    pooling = ("1_Pooling", "sentence_transformers.models.Pooling")
    os.makedirs(os.path.join(path, "1_Pooling"))
    pool_config = {"word_embedding_dimension": 64, "pooling_mode_mean_tokens": True}
    entries = [TRANSFORMER, pooling]
    if case == "unknown-mode":
        pool_config = {"embedding_dimension": 64, "pooling_mode": ["mean", "median"]}
    elif case == "legacy-bad-dimension":
        pool_config["word_embedding_dimension"] = 32
    elif case == "unsupported-module":
        entries.append(("2_LayerNorm", "sentence_transformers.models.LayerNorm"))
    elif case == "foreign-module":
        entries.append(("2_P", "my_package.Pooling"))
    elif case == "no-pooling":
        entries = [TRANSFORMER, ("2_Normalize", "sentence_transformers.models.Normalize")]
    elif case == "transformer-in-subdir":
        entries[0] = ("0_Transformer", TRANSFORMER[1])
    elif case == "bad-default-prompt":
        with open(os.path.join(path, "config_sentence_transformers.json"), "w") as f:
            json.dump({"prompts": {"doc": "d: "}, "default_prompt_name": "passage"}, f)
    elif case == "dense-bad-activation":
        entries.append(("2_Dense", "sentence_transformers.models.Dense"))
        os.makedirs(os.path.join(path, "2_Dense"))
        with open(os.path.join(path, "2_Dense", "config.json"), "w") as f:
            json.dump({"in_features": 64, "out_features": 8, "activation_function": "my.Activation"}, f)
    _modules(path, entries)
    if case == "bad-json":
        with open(os.path.join(path, "modules.json"), "a") as f:
            f.write("}")
    if case != "no-pooling-config":
        with open(os.path.join(path, "1_Pooling", "config.json"), "w") as f:
            json.dump(pool_config, f)
    enc = Encoder.from_pretrained(path)  # the configuration is read when first needed, by encode
    with pytest.raises(ConfigError, match=match):
        enc.encode(["hello"])


def test_bad_arguments(minilm):
    enc = Encoder.from_pretrained(minilm)
    with pytest.raises(ValueError, match="unknown pooling mode 'median'"):
        enc.encode(["a"], pooling="median")
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        enc.encode(["a"], batch_size=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        enc.encode(["a"], pooling=["mean"])


def test_embed_tokens_rows_alone_equal_encode(minilm, texts):
    """`embed_tokens` on rows tokenized by `unpadded` (one row, or several right padded together) gives
    encode's vectors bit for bit on the cpu backend, and `unpadded` truncates from the side asked."""
    from bertfast.tokenization import unpadded

    enc = Encoder.from_pretrained(minilm, backend="cpu")
    some = texts[:6] + ["word " * 300]
    ref = enc.encode(some)
    rows = [e.ids for e in unpadded(enc.tokenizer).encode_batch(some)]
    assert len(rows[-1]) == 256 and len({len(r) for r in rows}) > 1
    for i, r in enumerate(rows):
        ids = torch.tensor([r])
        assert torch.equal(enc.embed_tokens(ids, torch.ones_like(ids))[0], ref[i])
    together = enc.embed_tokens(*enc.tokenize(some))
    assert torch.equal(together, ref)
    left = unpadded(enc.tokenizer, "left").encode("first " + "word " * 300)
    right = unpadded(enc.tokenizer, "right").encode("first " + "word " * 300)
    assert left.overflowing and right.ids[1] == enc.tokenizer.token_to_id("first") != left.ids[1]
    with pytest.raises(ValueError, match="direction must be 'right' or 'left'"):
        unpadded(enc.tokenizer, "up")
