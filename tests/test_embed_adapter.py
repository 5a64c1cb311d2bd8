"""`bertfast embed --adapter DIR`: the corpus through one PEFT LoRA adapter.

Every vector must equal `Encoder.encode(texts, adapter=name)` bit for bit (and differ from the base model's) across
shards, chunks, token budgets and worker threads; an adapter that cannot be loaded stops the command before OUTPUT
exists; `--resume` refuses another adapter, none, or the same path with other contents, and finishes with the same
adapter into the bytes of an uninterrupted run. The Ray path: tests/test_embed_ray.py.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch

from conftest import corpus, hf_bert
from helpers.adapters import ALL_BERT, edited, save_lora
from helpers.embed import embed, interrupt_at_commit, lora_dir, read_output, write_input

from bertfast import Encoder

TEXTS = corpus(300, seed=5)
SHARD_ROWS = 128  # 3 shards, the last one short


@pytest.fixture(scope="module")
def adapters(tiny_text_model, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("embed_adapters")
    return {name: lora_dir(tiny_text_model, root / name, seed) for name, seed in (("a", 1), ("b", 2))}


@pytest.fixture(scope="module")
def encoders(tiny_text_model, adapters) -> dict:
    """dtype -> the reference Encoder with adapter "a" loaded (built on first use)."""
    built = {}

    def get(dtype):
        if dtype not in built:
            enc = Encoder.from_pretrained(tiny_text_model, backend="cpu", dtype=dtype)
            enc.load_adapter("a", adapters["a"])
            built[dtype] = enc
        return built[dtype]

    return get


def contents(out) -> dict:
    """File name -> bytes, every file of an output directory."""
    return {name: (out / name).read_bytes() for name in sorted(os.listdir(out))}


# Budgets of 2048 and 64 tokens put each text in other batches than encode's default budget gives it; 2 workers take
# chunks of 256 texts, 1 worker chunks of 1024 (the corpus whole).
@pytest.mark.parametrize("dtype, budget, workers", [
    ("fp32", 2048, 1), ("fp32", 64, 2), ("int8", 2048, 2), ("int8", 64, 1), ("bf16", 512, 2),
], ids=["fp32-b2048-w1", "fp32-b64-w2", "int8-b2048-w2", "int8-b64-w1", "bf16-b512-w2"])
def test_adapter_equals_encode(tmp_path, tiny_text_model, adapters, encoders, dtype, budget, workers):
    src = write_input(tmp_path / "c.txt", TEXTS)
    out = tmp_path / "out"
    assert embed(src, out, "--model", tiny_text_model, "--backend", "cpu", "--dtype", dtype, "--adapter",
                 adapters["a"], "--shard-rows", SHARD_ROWS, "--batch-tokens", budget, "--workers", workers,
                 "--no-progress") == 0
    got = read_output(out)
    assert got["id"] == list(range(len(TEXTS)))
    enc = encoders(dtype)
    want = enc.encode(TEXTS, adapter="a", convert_to_numpy=True)
    assert np.array_equal(got["embedding"], want)
    base = enc.encode(TEXTS, convert_to_numpy=True)
    assert (got["embedding"] != base).any(axis=1).all(), "a text's vector is the base model's"
    settings = json.loads((out / "_manifest.json").read_text())["settings"]
    assert settings["adapter"] == os.path.realpath(adapters["a"]) and len(settings["adapter_sha256"]) == 64


def _pickle_only(good, path):
    path.mkdir()
    shutil.copy(os.path.join(good, "adapter_config.json"), path)
    torch.save({}, path / "adapter_model.bin")
    return path


def _other_base(good, path):
    """A LoRA with the same module names, saved on a BERT of hidden size 32 (the model's is 64)."""
    save_lora(hf_bert(hidden_size=32, intermediate_size=48), path, 3, r=4, lora_alpha=8, target_modules=ALL_BERT)
    return path


BAD = {
    "missing": (lambda good, path: path, "is not a directory"),
    "pickle-only": (_pickle_only, "adapter_model.bin: pickle files are not loaded"),
    "other-base": (_other_base, "the base model needs (4, 64)"),
    "bad-config": (lambda good, path: edited(good, path, config={"peft_type": "IA3"}),
                   "only 'LORA' adapters are supported"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_adapter_fails_before_output(tmp_path, tiny_text_model, adapters, capsys, case):
    make, message = BAD[case]
    bad = make(adapters["a"], tmp_path / "adapter")
    src = write_input(tmp_path / "c.txt", TEXTS[:20])
    for out in (tmp_path / "out", tmp_path / "out.npy"):
        code = embed(src, out, "--model", tiny_text_model, "--backend", "cpu", "--adapter", bad)
        err = capsys.readouterr().err
        assert code == 2 and err.startswith("bertfast embed: error:") and message in err, err
        assert str(bad) in err, err
        assert not os.path.exists(out) and not os.path.exists(f"{out}.shards")


def test_resume_checks_the_adapter(tmp_path, tiny_text_model, adapters, encoders, monkeypatch, capsys):
    src = write_input(tmp_path / "c.txt", TEXTS)
    live = tmp_path / "live"  # one path whose contents change
    shutil.copytree(adapters["a"], live)
    common = ["--model", tiny_text_model, "--backend", "cpu", "--shard-rows", SHARD_ROWS, "--no-progress"]
    out = tmp_path / "out"
    interrupt_at_commit(monkeypatch)
    assert embed(src, out, *common, "--adapter", live) == 130
    monkeypatch.undo()
    assert sorted(json.loads((out / "_manifest.json").read_text())["shards"]) == ["0"]
    capsys.readouterr()
    stopped = contents(out)
    was = repr(os.path.realpath(live))
    refusals = [(["--adapter", adapters["b"]], f"adapter: {was} then, {os.path.realpath(adapters['b'])!r} now"),
                ([], f"adapter: {was} then, None now")]
    for extra, message in refusals:
        assert embed(src, out, *common, *extra, "--resume") == 2
        err = capsys.readouterr().err
        assert f"cannot resume {out}: it was written with other settings" in err and message in err, err
    for name in ("adapter_config.json", "adapter_model.safetensors"):  # retrained in place
        shutil.copy(os.path.join(adapters["b"], name), live / name)
    assert embed(src, out, *common, "--adapter", live, "--resume") == 2
    err = capsys.readouterr().err
    assert "adapter_sha256: '" in err and "adapter: '" not in err, err
    assert contents(out) == stopped  # the refusals wrote nothing
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        shutil.copy(os.path.join(adapters["a"], name), live / name)
    assert embed(src, out, *common, "--adapter", live, "--resume") == 0
    assert f"resumed: {SHARD_ROWS} texts were already embedded" in capsys.readouterr().out
    clean = tmp_path / "clean"
    assert embed(src, clean, *common, "--adapter", live) == 0
    assert contents(out) == contents(clean)
    want = encoders("fp32").encode(TEXTS, adapter="a", convert_to_numpy=True)
    assert np.array_equal(read_output(out)["embedding"], want)
