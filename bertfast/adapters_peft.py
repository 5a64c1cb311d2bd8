"""Reading a PEFT LoRA directory (`adapter_config.json` and `adapter_model.safetensors`) or an adapter of an in-memory
`PeftModel`, checked field by field; writing one without PEFT (`write_peft_dir`).

Only what bertfast can serve exactly passes: plain LoRA of linears and embedding tables (no DoRA, no LoRA biases),
safetensors only (a pickle file is never unpickled). Each refusal is a `LoadError` naming the field, tensor or file.
PEFT's own matching rules are followed where they decide a module's rank and alpha (`rank_pattern`, `alpha_pattern`:
a key matches a module name ending in it, as a regex) and its targeting (`target_modules`: a list of name suffixes or
one regex for the whole name), so a file PEFT wrote is read as PEFT reads it.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass

import torch

from .loading import FLOAT_DTYPES, LoadError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLE_FILE = "adapter_model.bin"
# PEFT's prefix of every saved tensor: the PeftModel's base_model (LoraModel) holds the user's model as `model`.
SAVED_PREFIX = "base_model.model."
# Fields whose non-default values change the math in ways bertfast does not serve: field -> (default test, why).
_REFUSED = {
    "use_dora": (lambda v: not v, "DoRA (use_dora) rescales each weight column by a learned magnitude"),
    "lora_bias": (lambda v: not v, "lora_bias adds a bias to lora_B"),
    "bias": (lambda v: v in (None, "none"), "trained biases (bias != 'none') change the base model's biases"),
    "layer_replication": (lambda v: not v, "layer_replication changes the layer stack"),
    "target_parameters": (lambda v: not v, "target_parameters adapts raw parameters, not linears"),
    "trainable_token_indices": (lambda v: not v, "trainable_token_indices changes embedding rows"),
    "alora_invocation_tokens": (lambda v: not v, "activated LoRA (alora_invocation_tokens) depends on the tokens"),
    "use_qalora": (lambda v: not v, "QA-LoRA pools the input groups"),
}


@dataclass
class PeftFiles:
    """An adapter directory as read: its config (the JSON object) and every tensor by its saved name."""
    path: str
    config: dict
    tensors: dict[str, torch.Tensor]


def read_peft_dir(path: str | os.PathLike) -> PeftFiles:
    """Read and check an adapter directory's config and tensors (fp32 copies); raises LoadError."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise LoadError(f"adapter directory {path} does not exist")
    config_path = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(config_path):
        raise LoadError(f"adapter directory {path} has no {CONFIG_FILE}")
    try:
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
    except Exception as e:
        raise LoadError(f"{config_path} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise LoadError(f"{config_path} does not hold a JSON object")
    check_config(config, config_path)
    weights = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(weights):
        if os.path.isfile(os.path.join(path, PICKLE_FILE)):
            raise LoadError(f"{os.path.join(path, PICKLE_FILE)}: pickle files are not loaded (they can run code); "
                            f"save the adapter as {WEIGHTS_FILE} (PEFT's save_pretrained does by default)")
        raise LoadError(f"adapter directory {path} has no {WEIGHTS_FILE}")
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    try:
        tensors = load_file(weights)
    except (SafetensorError, OSError, ValueError) as e:
        raise LoadError(f"{weights} is not a valid safetensors file (corrupt or truncated?): {e}") from None
    for name, t in tensors.items():
        if t.dtype not in FLOAT_DTYPES:
            raise LoadError(f"tensor {name!r} in {weights} has dtype {t.dtype}, expected a floating point dtype")
    return PeftFiles(path, config, {k: v.float() for k, v in tensors.items()})


def read_peft_model(model, adapter_name: str) -> PeftFiles:
    """Adapter `adapter_name` of an in-memory `peft.PeftModel`, or of a transformers model given adapters through
    transformers' PEFT integration (`add_adapter`, `load_adapter`: the model holds PEFT's layers and `peft_config`
    itself), as `read_peft_dir` reads it from the directory `save_pretrained` would write (its config with sets as
    lists, PEFT's own state dict of the adapter under the same tensor names), without writing files. Raises
    LoadError."""
    from peft import PeftModel
    from peft.utils import get_peft_model_state_dict

    wrapped = isinstance(model, PeftModel)
    where = f"adapter {adapter_name!r} of the {'PeftModel' if wrapped else type(model).__name__}"
    if adapter_name not in model.peft_config:
        raise LoadError(f"{where}: no such adapter (it has {', '.join(map(repr, model.peft_config))})")
    config = {k: sorted(v) if isinstance(v, set) else v for k, v in model.peft_config[adapter_name].to_dict().items()}
    config["peft_type"] = str(getattr(config.get("peft_type"), "value", config.get("peft_type")))
    check_config(config, where)
    tensors = get_peft_model_state_dict(model, adapter_name=adapter_name)
    if not wrapped:  # the integration's names lack the PeftModel's prefix; its save_pretrained adds it
        tensors = {SAVED_PREFIX + k: v for k, v in tensors.items()}
    for name, t in tensors.items():
        if t.dtype not in FLOAT_DTYPES:
            raise LoadError(f"tensor {name!r} of {where} has dtype {t.dtype}, expected a floating point dtype")
    return PeftFiles(where, config, {k: v.detach().float().cpu().clone() for k, v in tensors.items()})


class BaseWeights:
    """The base weights under a PEFT-wrapped module (`peft_model.get_base_model()` or a submodule), by the names the
    unwrapped module has: each LoRA layer's `base_layer.` dropped from the name, its factors left out. What
    `load_hf_model` reads (config, state_dict, parameters); raises LoadError for a module_to_save inside it, whose
    trained copy the engine would not run."""

    def __init__(self, module):
        self.module, self.config = module, module.config

    def parameters(self):
        return self.module.parameters()

    def state_dict(self) -> dict[str, torch.Tensor]:
        out = {}
        for name, t in self.module.state_dict().items():
            if ".modules_to_save." in f".{name}" or ".original_module." in f".{name}":
                raise LoadError(f"tensor {name!r}: modules_to_save wraps a module of the encoder, whose trained copy "
                                "the engine does not run unmerged: use merge=True")
            if re.search(r"(^|\.)lora_[A-Za-z_]+\.", name):
                continue
            out[name.replace(".base_layer.", ".")] = t
        return out


def check_config(config: dict, where: str = CONFIG_FILE) -> None:
    """Refuse a config bertfast cannot serve exactly, naming the field."""
    peft_type = config.get("peft_type")
    if peft_type != "LORA":
        raise LoadError(f"{where}: peft_type is {peft_type!r}; only 'LORA' adapters are supported")
    for field, (ok, why) in _REFUSED.items():
        if not ok(config.get(field)):
            raise LoadError(f"{where}: {field} = {config[field]!r} is not supported: {why}")
    for field in ("r", "lora_alpha"):
        value = config.get(field)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise LoadError(f"{where}: {field} = {value!r}, expected a positive number")
    if not isinstance(config["r"], int):
        raise LoadError(f"{where}: r = {config['r']!r}, expected a positive integer")
    targets = config.get("target_modules")
    if not (isinstance(targets, str) or isinstance(targets, list) and targets
            and all(isinstance(t, str) for t in targets)):
        raise LoadError(f"{where}: target_modules = {targets!r}, expected a list of module names or a regex")
    for field in ("rank_pattern", "alpha_pattern"):
        if not isinstance(config.get(field) or {}, dict):
            raise LoadError(f"{where}: {field} = {config[field]!r}, expected an object of pattern -> number")
    layers = config.get("layers_to_transform")
    if layers is not None and not (isinstance(layers, int) or isinstance(layers, list)
                                   and all(isinstance(i, int) for i in layers)):
        raise LoadError(f"{where}: layers_to_transform = {layers!r}, expected an integer or a list of integers")


def _pattern_value(patterns: dict, module: str, default):
    """PEFT's get_pattern_key: the first key of `patterns` that matches the end of `module` (as a regex)."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def rank_and_scale(config: dict, module: str) -> tuple[int, float]:
    """(rank, scale) of `module` (its name inside the adapted model): r and lora_alpha, or their rank_pattern /
    alpha_pattern entries; scale = alpha / r, or alpha / sqrt(r) with use_rslora."""
    r = _pattern_value(config.get("rank_pattern") or {}, module, config["r"])
    alpha = _pattern_value(config.get("alpha_pattern") or {}, module, config["lora_alpha"])
    return r, alpha / (math.sqrt(r) if config.get("use_rslora") else r)


def is_targeted(config: dict, module: str) -> bool:
    """Whether target_modules selects `module` (PEFT's rule: a regex string must match the whole name; a list entry
    is the name or a suffix after a dot)."""
    targets = config["target_modules"]
    if isinstance(targets, str):
        return re.fullmatch(targets, module) is not None
    return module in targets or any(module.endswith("." + t) for t in targets)


def layer_index(config: dict, module: str) -> int | None:
    """PEFT's layer index of `module` for layers_to_transform: the first number after `layers_pattern` (any
    segment when it is empty)."""
    patterns = config.get("layers_pattern") or [None]
    for pattern in [patterns] if isinstance(patterns, str) else patterns:
        regex = r".*?\.[^.]*\.(?P<idx>\d+)\." if pattern is None else rf"(?:^|.*?\.){pattern}\.(?P<idx>\d+)\."
        match = re.match(regex, module)
        if match:
            return int(match.group("idx"))
    return None


def in_modules_to_save(config: dict, name: str) -> bool:
    """Whether tensor `name` (without SAVED_PREFIX) belongs to a module of modules_to_save, by PEFT's rule: a module
    whose name ends with an entry, as text ("classifier" takes DistilBERT's `pre_classifier` too, as PEFT wraps it)."""
    parts = name.split(".")
    modules = [".".join(parts[:i]) for i in range(1, len(parts))]
    return any(module.endswith(m) for module in modules for m in config.get("modules_to_save") or ())


def write_peft_dir(path: str | os.PathLike, factors: dict, *, rank: int, alpha: float, target_modules,
                   tables=()) -> None:
    """Write a PEFT LoRA directory without PEFT (benchmarks, and GPU machines that lack it): factors maps a module
    name to its (A (rank, in), B (out, rank)), an embedding table's (in `tables`) to (A (rank, V), B (E, rank)) as
    PEFT names them (`lora_embedding_A` / `_B`); plain LoRA, the config fields `check_config` reads."""
    from safetensors.torch import save_file

    tensors = {}
    for name, (A, B) in factors.items():
        a, b = ("lora_embedding_A", "lora_embedding_B") if name in tables else ("lora_A.weight", "lora_B.weight")
        tensors[f"{SAVED_PREFIX}{name}.{a}"] = A.contiguous()
        tensors[f"{SAVED_PREFIX}{name}.{b}"] = B.contiguous()
    os.makedirs(path)
    save_file(tensors, os.path.join(path, WEIGHTS_FILE))
    with open(os.path.join(path, CONFIG_FILE), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(target_modules),
                   "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False, "use_rslora": False,
                   "task_type": None, "base_model_name_or_path": None}, f)
