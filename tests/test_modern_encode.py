"""ModernBERT, NomicBERT, GTE base models: `Encoder.from_pretrained` on saved checkpoints (the tensor names
transformers writes to files, not its modules' names), `encode` and sentence-transformers parity."""

import os
import shutil

os.environ["HF_HUB_OFFLINE"] = "1"  # nothing here may download; set before the hub libraries load

import pytest
import torch
import transformers
import sentence_transformers as st

import bertfast
from bertfast import Encoder
from conftest import rel_err
from helpers.modern_tasks import BACKENDS, PREFIX, build, inputs_for
from helpers.sentences import max_diff, sentences

try:
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer
except ImportError:  # releases before 6.0
    from sentence_transformers.models import Normalize, Pooling, Transformer

TOL = 1e-5  # fp32 parity, max abs difference over every embedding coordinate
BASES = [("modernbert", {}), ("nomic_bert", {}), ("gte", {}), ("gte", {"type_vocab_size": 0})]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("family, kw", BASES, ids=["modernbert", "nomic_bert", "gte", "gte-no-types"])
def test_saved_base_model_matches_transformers(tmp_path, family, kw, backend):
    model = build(family, PREFIX[family] + "Model", seed=1, **kw)
    # NomicBERT's files keep nomic's names (fused Wqkv, fc11 = up, fc12 = gate), GTE's Alibaba's (fused qkv_proj,
    # up_gate_proj with the activated half second): a swapped half would still run, only the values tell.
    model.save_pretrained(tmp_path)
    kwargs, mask = inputs_for(model)
    with torch.no_grad():
        ref = model(**kwargs, output_hidden_states=True)
    for enc in (Encoder.from_pretrained(tmp_path, backend=backend), bertfast.load(tmp_path, backend=backend)):
        out = enc(**kwargs, output_hidden_states=True)
        assert out.pooler_output is None and rel_err(out.last_hidden_state, ref.last_hidden_state, mask) <= 1e-5
        # ModernBERT: the last entry is after the final norm, as transformers' (it ties it to last_hidden_state)
        assert len(out.hidden_states) == len(ref.hidden_states)
        for ours, theirs in zip(out.hidden_states, ref.hidden_states):
            assert rel_err(ours, theirs, mask) <= 1e-5


def test_missing_checkpoint_tensor_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    build("gte", "GteModel").save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["encoder.layer.1.mlp.up_gate_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(bertfast.LoadError, match="'encoder.layer.1.mlp.up_gate_proj.weight' is missing"):
        Encoder.from_pretrained(tmp_path, backend="torch")


# --- sentence-transformers ----------------------------------------------------------------------


def write_sentence_model(directory, minilm, family, pooling, seed=0):
    """A random model of `family` (vocab of MiniLM's tokenizer, copied beside it) saved by sentence-transformers
    as Transformer -> Pooling(pooling) -> Normalize."""
    model = build(family, PREFIX[family] + "Model", seed=seed, vocab_size=30522)
    hf_dir = os.path.join(directory, "hf")
    model.save_pretrained(hf_dir)
    for name in ("tokenizer.json", "vocab.txt", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(os.path.join(minilm, name), hf_dir)
    out = os.path.join(directory, "st")
    st.SentenceTransformer(modules=[Transformer(hf_dir), Pooling(64, pooling_mode=pooling), Normalize()],
                           device="cpu").save(out)
    return out


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("family, pooling", [("modernbert", "mean"), ("nomic_bert", "cls"), ("gte", "weightedmean")])
def test_encode_matches_sentence_transformers(tmp_path, minilm_path, family, pooling, backend):
    path = write_sentence_model(tmp_path, minilm_path, family, pooling)
    texts = sentences(24, seed=3, long_every=6, long_words=(30, 60))  # most texts longer than ModernBERT's window
    model = st.SentenceTransformer(path, device="cpu")
    ref = model.encode(texts, convert_to_tensor=True, batch_size=8)
    enc = Encoder.from_pretrained(path, backend=backend)
    assert enc.sentence_config.pooling == (pooling,) and enc.sentence_config.normalizes
    ours = enc.encode(texts, batch_size=8)
    assert ours.shape == ref.shape == (24, 64) and max_diff(ours, ref) <= TOL
    assert max_diff(enc.encode(texts, batch_tokens=256), ref) <= TOL

    bertfast.optimize(model, backend=backend, strict=True)  # strict: a call the engine did not serve would raise
    assert type(model[0].auto_model).__mro__[1].__name__ == "_EngineForward"
    assert max_diff(model.encode(texts, convert_to_tensor=True, batch_size=8), ref) <= TOL
