"""PEFT LoRA adapters on the random-weight models of every family, and edits of saved adapters for the refusals.

PEFT initialises lora_B to zeros and modules_to_save as copies of the base modules (an adapter that changes nothing
would hide every mapping mistake): `save_lora` draws both factors at random, at a scale where the deltas are
comparable with the base weights, and perturbs the saved copies.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import shutil

import peft
import torch
from safetensors.torch import load_file, save_file

import modern_models
from helpers import deberta, families

ALL_BERT = ["query", "key", "value", "dense"]  # "dense": attention out, FFN in and out, the pooler
# family case -> (builder of the random transformers model, target_modules covering every slot bertfast adapts)
CASES = {
    "bert": (lambda: families.build("bert"), ALL_BERT),
    "roberta": (lambda: families.build("roberta"), ["query", "value", "intermediate.dense"]),  # no key: zero block
    "xlm-roberta": (lambda: families.build("xlm-roberta"), ["key", "value", "attention.output.dense"]),
    "electra": (lambda: families.build("electra"), ["key", "value", "output.dense", "embeddings_project"]),
    "albert": (lambda: families.build("albert"), ["query", "key", "value", "dense", "ffn", "ffn_output", "pooler",
                                                   "embedding_hidden_mapping_in"]),
    "distilbert": (lambda: families.build("distilbert"), ["q_lin", "k_lin", "v_lin", "out_lin", "lin1", "lin2"]),
    "mpnet": (lambda: families.build("mpnet"), ["q", "k", "v", "o", "intermediate.dense", "output.dense"]),
    "deberta-v2": (lambda: deberta.build("v2"), ["query_proj", "key_proj", "value_proj", "pos_key_proj",
                                                 "pos_query_proj", "dense"]),
    "deberta-v3": (lambda: deberta.build("v3"), ["query_proj", "key_proj", "value_proj"]),  # shared position keys
    "modernbert": (lambda: modern_models.build("modernbert", num_hidden_layers=2), ["Wqkv", "Wo", "Wi"]),
    "nomic_bert": (lambda: modern_models.build("nomic_bert"), ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                               "up_proj", "down_proj"]),
    "gte": (lambda: modern_models.build("gte"), ["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"]),
}

# 481 tokens in 16 rows: past every row count of the GEMM choosers (the adapters' own GEMMs too: 'a' holds 175), and
# each row's adapter of a mixed batch ("a", "b", "c" or None: the base model); the tier caps the invariance runs on.
LONG_LENGTHS = [40, 1, 33, 40, 17, 40, 39, 2, 40, 28, 40, 36, 40, 40, 36, 9]
LONG_ROWS = ["a", None, "b", "a", "c", None, "a", "b", "c", "a", None, "b", "b", "c", None, "a"]
TIERS = [None, "portable", "avx2", "avx512_vnni-nobf16", "amx_emulated"]
TIER_IDS = ["default-tier", "portable", "avx2", "avx512_vnni-nobf16", "amx_emulated"]


def peft_names(rows):
    """PEFT's `adapter_names` for rows on adapters "a" (loaded first: PEFT's "default"), "b", ... or None."""
    return ["__base__" if a is None else ("default" if a == "a" else a) for a in rows]


def randomize(model, seed=0, adapter=None):
    """Draw the LoRA factors of `model` (a PeftModel, or a model with adapters through transformers' integration)
    at random and perturb its modules_to_save copies: every adapter's, or only those of adapter `adapter`."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if adapter is not None and f".{adapter}." not in f".{name}":
                continue
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
            elif ".modules_to_save." in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.2)
    return model


def save_lora(model, path, seed=0, **lora) -> peft.PeftModel:
    """A LoRA PeftModel over a copy of `model` (lora: LoraConfig's fields), both factors random and the
    modules_to_save copies perturbed, saved to `path`."""
    pm = randomize(peft.get_peft_model(copy.deepcopy(model), peft.LoraConfig(**lora)), seed)
    pm.save_pretrained(path)
    return pm.eval()


def position_inputs(model) -> torch.Tensor | None:
    """DeBERTa-v2's relative embeddings as its position projections see them (LayerNorm'd when norm_rel_ebd)."""
    encoder = getattr(model, "encoder", None)
    if encoder is None or not hasattr(encoder, "rel_embeddings"):
        return None
    rel = encoder.rel_embeddings.weight.detach().double()
    if "layer_norm" in getattr(model.config, "norm_rel_ebd", "none"):
        ln = encoder.LayerNorm
        rel = torch.nn.functional.layer_norm(rel, rel.shape[-1:], ln.weight.double(), ln.bias.double(), ln.eps)
    return rel


def edited(src, dst, config=None, tensors=None, drop=()) -> str:
    """A copy of adapter directory `src` at `dst`: config entries updated (None removes one), tensors updated
    (name -> tensor) and names in `drop` removed."""
    shutil.copytree(src, dst)
    cfg_path, w_path = os.path.join(dst, "adapter_config.json"), os.path.join(dst, "adapter_model.safetensors")
    with open(cfg_path) as f:
        cfg = json.load(f)
    for k, v in (config or {}).items():
        cfg.pop(k, None) if v is None else cfg.__setitem__(k, v)
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    sd = {k: v for k, v in load_file(w_path).items() if k not in drop}
    save_file({**sd, **(tensors or {})}, w_path)
    return dst


def hidden_rows(n, width, seed=2) -> torch.Tensor:
    return torch.randn(n, width, generator=torch.Generator().manual_seed(seed))


@contextlib.contextmanager
def native_layer_calls(backend):
    """The cpu backend's native layers (`_C.Layer`, one per distinct plain layer: `backend._whole`) counted while in
    the block: yields the list of their calls' `lora` (each GEMM's `_C.LoraSlot` or None; None: a call without)."""
    layers, calls = backend._whole, []

    def counted(layer):
        def call(*args, **kwargs):
            calls.append(kwargs.get("lora"))
            return layer(*args, **kwargs)
        return call

    backend._whole = {key: counted(layer) for key, layer in layers.items()}
    try:
        yield calls
    finally:
        backend._whole = layers


__all__ = ["CASES", "randomize", "save_lora", "position_inputs", "edited", "hidden_rows", "native_layer_calls"]
