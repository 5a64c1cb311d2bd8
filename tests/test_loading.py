"""Weight loading from every supported source, and every error path naming what is wrong."""

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import save_file

from bertfast import reference
from bertfast.loading import LoadError, load_hf_model, load_pretrained
from conftest import hf_bert, ragged_batch


@pytest.fixture(scope="module")
def model():
    return hf_bert(seed=11)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, model):
    d = tmp_path_factory.mktemp("ckpt")
    model.save_pretrained(d)
    return d


def _state(model, prefix=""):
    return {prefix + k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}


def _write_dir(path, model, state, fmt="safetensors"):
    os.makedirs(path, exist_ok=True)
    (path / "config.json").write_text(json.dumps(model.config.to_dict()))
    if fmt == "safetensors":
        save_file(state, str(path / "model.safetensors"))
    else:
        torch.save(state, str(path / "pytorch_model.bin"))
    return path


def _same_weights(weights, model):
    sd = model.state_dict()
    L0 = weights.layers[0]
    qkv = torch.cat([sd[f"encoder.layer.0.attention.self.{n}.weight"] for n in ("query", "key", "value")])
    assert torch.equal(L0.qkv_weight, qkv)
    assert torch.equal(L0.qkv_bias, torch.cat([sd[f"encoder.layer.0.attention.self.{n}.bias"]
                                               for n in ("query", "key", "value")]))
    assert torch.equal(weights.embeddings.word, sd["embeddings.word_embeddings.weight"])
    assert torch.equal(weights.pooler_weight, sd["pooler.dense.weight"])
    assert len(weights.layers) == model.config.num_hidden_layers


def test_save_pretrained_directory(checkpoint, model):
    _same_weights(load_pretrained(checkpoint), model)


def test_pytorch_model_bin_with_task_prefix(tmp_path, model):
    d = _write_dir(tmp_path / "bin", model, _state(model, "bert."), fmt="bin")
    _same_weights(load_pretrained(d), model)


def test_sharded_safetensors(tmp_path, model):
    d = tmp_path / "sharded"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(model.config.to_dict()))
    state = _state(model)
    names = sorted(state)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    weight_map = {}
    for fname, keys in shards.items():
        save_file({k: state[k] for k in keys}, str(d / fname))
        weight_map.update({k: fname for k in keys})
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    _same_weights(load_pretrained(d), model)


def test_legacy_layernorm_gamma_beta_names(tmp_path, model):
    state = {k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): v
             for k, v in _state(model).items()}
    _same_weights(load_pretrained(_write_dir(tmp_path / "legacy", model, state)), model)


def test_from_hf_task_model_and_dtype():
    import transformers
    base = hf_bert(seed=12)
    task = transformers.BertForSequenceClassification(base.config).eval()
    task.bert.load_state_dict(base.state_dict())
    w = load_hf_model(task)
    _same_weights(w, base)
    bf = load_hf_model(task, dtype="bf16")
    assert bf.dtype == torch.bfloat16 and bf.layers[1].ffn_out_weight.dtype == torch.bfloat16


def test_loaded_weights_drive_the_reference(checkpoint, model):
    ids, mask, types = ragged_batch([4, 2], seed=1)
    with torch.no_grad():
        hf = model(input_ids=ids, attention_mask=mask, token_type_ids=types).last_hidden_state
    last, _, _ = reference.forward(load_pretrained(checkpoint), ids, mask, types)
    assert torch.allclose(last[mask.bool()], hf[mask.bool()], rtol=1e-5, atol=1e-5)


def test_checkpoint_without_pooler(tmp_path, model):
    state = {k: v for k, v in _state(model).items() if not k.startswith("pooler.")}
    w = load_pretrained(_write_dir(tmp_path / "nopool", model, state))
    assert w.pooler_weight is None and w.pooler_bias is None


# --- errors ---------------------------------------------------------------------------------

def test_missing_tensor_is_named(tmp_path, model):
    state = _state(model)
    del state["encoder.layer.1.intermediate.dense.bias"]
    with pytest.raises(LoadError, match=r"encoder\.layer\.1\.intermediate\.dense\.bias.*missing"):
        load_pretrained(_write_dir(tmp_path / "m", model, state))


def test_wrong_shape_names_expected_and_found(tmp_path, model):
    state = _state(model)
    state["encoder.layer.0.output.dense.weight"] = torch.zeros(64, 95)
    with pytest.raises(LoadError, match=r"encoder\.layer\.0\.output\.dense\.weight.*\(64, 95\).*\(64, 96\)"):
        load_pretrained(_write_dir(tmp_path / "s", model, state))


def test_integer_dtype_rejected(tmp_path, model):
    state = _state(model)
    state["embeddings.LayerNorm.weight"] = torch.ones(64, dtype=torch.int32)
    with pytest.raises(LoadError, match=r"embeddings\.LayerNorm\.weight.*int32"):
        load_pretrained(_write_dir(tmp_path / "i", model, state))


def test_truncated_safetensors(tmp_path, checkpoint):
    d = tmp_path / "trunc"
    shutil.copytree(checkpoint, d)
    f = d / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) - 1000])
    with pytest.raises(LoadError, match="model.safetensors.*truncated"):
        load_pretrained(d)


def test_corrupt_safetensors_header(tmp_path, checkpoint):
    d = tmp_path / "corrupt"
    shutil.copytree(checkpoint, d)
    (d / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage garbage")
    with pytest.raises(LoadError, match="model.safetensors"):
        load_pretrained(d)


def test_corrupt_pytorch_bin(tmp_path, model):
    d = _write_dir(tmp_path / "badbin", model, _state(model), fmt="bin")
    data = (d / "pytorch_model.bin").read_bytes()
    (d / "pytorch_model.bin").write_bytes(data[: len(data) // 2])
    with pytest.raises(LoadError, match="pytorch_model.bin"):
        load_pretrained(d)


def test_pickle_with_code_is_refused(tmp_path, model):
    d = _write_dir(tmp_path / "pickle", model, _state(model), fmt="bin")
    torch.save({**_state(model), "fn": os.getcwd}, str(d / "pytorch_model.bin"))
    with pytest.raises(LoadError, match="pytorch_model.bin"):
        load_pretrained(d)


def test_no_weights_and_no_directory(tmp_path, model):
    (tmp_path / "config.json").write_text(json.dumps(model.config.to_dict()))
    with pytest.raises(LoadError, match="no weights"):
        load_pretrained(tmp_path)
    with pytest.raises(LoadError, match="does not exist"):
        load_pretrained(tmp_path / "nope")


def test_not_a_bert_checkpoint(tmp_path, model):
    state = {"foo.weight": torch.zeros(2)}
    with pytest.raises(LoadError, match="word_embeddings"):
        load_pretrained(_write_dir(tmp_path / "x", model, state))


def test_bad_dtype_argument(checkpoint):
    with pytest.raises(ValueError, match="dtype"):
        load_pretrained(checkpoint, dtype="int8")
    with pytest.raises(ValueError, match="dtype"):
        load_pretrained(checkpoint, dtype=torch.int64)
