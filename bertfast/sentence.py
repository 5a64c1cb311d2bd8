"""Sentence-transformers configuration and pooling for `Encoder.encode`.

`read_sentence_config(dir)` turns what a sentence-transformers checkpoint says about making one
vector per text (`modules.json`, the Pooling module's `config.json`, Dense, Dropout and Normalize
modules, `config_sentence_transformers.json`'s prompts and `truncate_dim`) into a `SentenceConfig`;
`SentenceConfig.embed` applies it with the math of sentence-transformers' own modules. A module stack
it cannot reproduce raises `ConfigError` naming the module: never a silently different embedding.
A directory without `modules.json` gets what sentence-transformers gives a plain model: mean pooling.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .config import ConfigError

POOLING_MODES = ("cls", "max", "mean", "mean_sqrt_len_tokens", "weightedmean", "lasttoken")
# The legacy boolean keys of a Pooling config, in sentence-transformers' concatenation order.
_LEGACY_POOLING_KEYS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}
# Dense activations by class name (`torch.nn.modules.activation.Tanh` in a saved config).
_ACTIVATIONS = {"Tanh": torch.tanh, "Identity": lambda x: x, "ReLU": F.relu, "GELU": F.gelu,
                "Sigmoid": torch.sigmoid, "SiLU": F.silu}
_SENTENCE = "sentence_embedding"


def pooling_modes(pooling) -> tuple[str, ...]:
    """'mean' or ('cls', 'mean', ...) -> a tuple of valid modes; ValueError names the bad one."""
    modes = (pooling,) if isinstance(pooling, str) else tuple(pooling)
    if not modes:
        raise ValueError(f"pooling must name at least one of {POOLING_MODES}")
    for mode in modes:
        if mode not in POOLING_MODES:
            raise ValueError(f"unknown pooling mode {mode!r}: valid modes are {POOLING_MODES}")
    return modes


def pool(states: torch.Tensor, mask: torch.Tensor, modes, prompt_length: int | None = None) -> torch.Tensor:
    """sentence-transformers' Pooling on a padded batch, modes concatenated in the given order.

    states: (B, S, H) float; mask: (B, S) 0/1; prompt_length: the prompt's leading tokens to leave
    out (include_prompt=False), or None. Returns (B, len(modes) * H) in states' dtype.
    """
    original = mask
    if prompt_length:
        mask = mask.clone()
        pad = mask.to(torch.int32).argmax(dim=1)
        if int(pad.sum()) == 0:
            mask[:, :prompt_length] = 0
        else:  # left padding: the prompt starts after each row's pads
            pos = torch.arange(mask.size(1), device=mask.device).unsqueeze(0)
            mask[pos < (pad + prompt_length).unsqueeze(1)] = 0
    m = mask.unsqueeze(-1).to(states.dtype)  # [B, S, 1]
    out = []
    for mode in modes:
        if mode == "cls":  # the first token the mask keeps
            first = mask.to(torch.int).argmax(dim=1)
            out.append(states[torch.arange(states.size(0), device=states.device), first])
        elif mode == "max":
            out.append(states.masked_fill(m == 0, float("-inf")).max(dim=1).values)
        elif mode in ("mean", "mean_sqrt_len_tokens"):
            total = (states * m).sum(dim=1)
            count = m.sum(dim=1).clamp(min=1e-9)
            out.append(total / (count if mode == "mean" else count.sqrt()))
        elif mode == "weightedmean":  # weights 1, 2, ... from each row's first real token
            weights = torch.arange(1, states.size(1) + 1, device=states.device, dtype=states.dtype).view(1, -1, 1)
            weights = weights - original.to(torch.int32).argmax(dim=1).view(-1, 1, 1)
            wm = m * weights
            out.append((states * wm).sum(dim=1) / wm.sum(dim=1).clamp(min=1e-9))
        elif mode == "lasttoken":  # the last position the mask keeps (the last column when none)
            values, idx = mask.flip(1).max(1)
            idx = torch.where(values == 0, mask.size(1) - 1, idx)
            last = mask.size(1) - idx - 1
            out.append((states * m)[torch.arange(states.size(0), device=states.device), last])
        else:
            raise ValueError(f"unknown pooling mode {mode!r}: valid modes are {POOLING_MODES}")
    return torch.cat(out, dim=-1)


# The modes `pool_packed` computes on the packed stream; the others pool a padded batch (`pool`).
PACKED_MODES = ("cls", "mean", "mean_sqrt_len_tokens")
_NATIVE_MODES = ("cls", "mean")  # those `_C.pool_rows` computes with the torch ops' bits


def pool_packed(states: torch.Tensor, cu_seqlens: torch.Tensor, modes) -> torch.Tensor:
    """`pool` for modes of PACKED_MODES on the packed tokens a forward leaves, without padding them back first.

    states: (T, H) float, row b's tokens at [cu_seqlens[b], cu_seqlens[b + 1]); a row without tokens pools to zeros,
    as in `pool`. A mean sums its row's tokens in order (index_add_ on the CPU: one row after another; on a GPU it
    would add atomically, in no fixed order, so there `pool` runs): a row's vector depends on its tokens alone.
    cls and mean are one `_C.pool_rows` call each where the extension is built (the same bits). Returns
    (B, len(modes) * H).
    """
    from .backends.cpu.ext import _C

    for mode in modes:
        if mode not in PACKED_MODES:
            raise ValueError(f"pooling mode {mode!r} pools a padded batch (`pool`), not the packed tokens")
    if _C is not None and states.device.type == "cpu" and states.dtype == torch.float32:
        states = states if states.stride(-1) == 1 else states.contiguous()
        # mean_sqrt_len_tokens divides by torch's sqrt of the count, which is not always the correctly rounded one
        out = [_C.pool_rows(states, cu_seqlens, mode) if mode in _NATIVE_MODES
               else pool_packed_reference(states, cu_seqlens, (mode,)) for mode in modes]
        return out[0] if len(out) == 1 else torch.cat(out, dim=-1)
    return pool_packed_reference(states, cu_seqlens, modes)


def pool_packed_reference(states: torch.Tensor, cu_seqlens: torch.Tensor, modes) -> torch.Tensor:
    """pool_packed in torch ops (without the extension, and its reference in the tests); modes of PACKED_MODES, which
    pool_packed checks."""
    B, (T, H) = cu_seqlens.numel() - 1, states.shape
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.int64)
    count = lengths.to(states.dtype).unsqueeze(1).clamp(min=1e-9)
    out, total = [], None
    for mode in modes:
        if mode == "cls":  # each row's first token
            first = states.index_select(0, cu_seqlens[:-1].to(torch.int64).clamp(max=max(T - 1, 0))) if T else \
                states.new_zeros(B, H)
            out.append(torch.where((lengths > 0).unsqueeze(1), first, torch.zeros_like(first)))
        else:  # mean, mean_sqrt_len_tokens
            if total is None:
                rows = torch.repeat_interleave(torch.arange(B, device=states.device), lengths)
                total = states.new_zeros(B, H).index_add_(0, rows, states)
            out.append(total / (count if mode == "mean" else count.sqrt()))
    return torch.cat(out, dim=-1)


@dataclass
class Dense:
    """sentence-transformers' Dense module: activation(x @ weight.T + bias) (+ x or residual(x))."""

    weight: torch.Tensor  # (out, in)
    bias: torch.Tensor | None
    activation: str = "Tanh"
    residual: torch.Tensor | None = None  # (out, in) projection, when use_residual and in != out
    use_residual: bool = False

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.weight.shape[1]:
            raise ValueError(f"the Dense module takes {self.weight.shape[1]} features, its input has "
                             f"{x.shape[-1]} (a pooling argument that changes the width?)")
        out = _ACTIVATIONS[self.activation](F.linear(x, self.weight.to(x), None if self.bias is None
                                                     else self.bias.to(x)))
        if self.use_residual:
            out = out + (x if self.residual is None else F.linear(x, self.residual.to(x)))
        return out


def resolve_prompt(prompts: dict, default_prompt_name: str | None, prompt: str | None,
                   prompt_name: str | None) -> str | None:
    """The prompt to prepend, as sentence-transformers picks it: an explicit prompt wins, then prompt_name (one of
    `prompts`, else ValueError), then the configured default."""
    if prompt is not None:
        return prompt
    if prompt_name is not None:
        if prompt_name not in prompts:
            raise ValueError(f"prompt name {prompt_name!r} is not one of the configured prompts {sorted(prompts)}")
        return prompts[prompt_name]
    return None if default_prompt_name is None else prompts.get(default_prompt_name)


@dataclass
class SentenceConfig:
    """How token states become one vector; defaults are a plain model's (mean pooling)."""

    pooling: tuple[str, ...] = ("mean",)
    include_prompt: bool = True
    steps: tuple = ()  # after pooling, in order: Dense, or "normalize"
    prompts: dict = field(default_factory=lambda: {"query": "", "document": ""})
    default_prompt_name: str | None = None
    truncate_dim: int | None = None

    @property
    def normalizes(self) -> bool:
        return "normalize" in self.steps

    def resolve_prompt(self, prompt: str | None, prompt_name: str | None) -> str | None:
        return resolve_prompt(self.prompts, self.default_prompt_name, prompt, prompt_name)

    def embed(self, states, mask, *, pooling=None, normalize=None, truncate_dim=None, prompt_length=None):
        """(B, S, H) fp32 states, (B, S) mask -> (B, D) sentence embeddings.

        pooling overrides the configured modes; normalize=False skips the Normalize modules,
        True normalizes the final (truncated) vector; truncate_dim keeps the first dims."""
        modes = self.pooling if pooling is None else pooling
        return self.finish(pool(states, mask, modes, None if self.include_prompt else prompt_length),
                           normalize=normalize, truncate_dim=truncate_dim)

    def pools_packed(self, pooling=None, prompt_length=None) -> bool:
        """Whether `embed_packed` computes these modes (`pool_packed`): PACKED_MODES, no prompt tokens to leave out."""
        modes = self.pooling if pooling is None else pooling
        return all(m in PACKED_MODES for m in modes) and (self.include_prompt or not prompt_length)

    def embed_packed(self, states, cu_seqlens, *, pooling=None, normalize=None, truncate_dim=None):
        """`embed` on the packed tokens of a forward ((T, H) fp32, cu_seqlens (B + 1,)), where `pools_packed`."""
        return self.finish(pool_packed(states, cu_seqlens, self.pooling if pooling is None else pooling),
                           normalize=normalize, truncate_dim=truncate_dim)

    def finish(self, x, *, normalize=None, truncate_dim=None):
        """The modules after pooling (Dense, Normalize), then truncate_dim and normalize as `embed` takes them."""
        for step in self.steps:
            if step == "normalize":
                if normalize is not False:
                    x = F.normalize(x, p=2, dim=-1)
            else:
                x = step(x)
        dim = truncate_dim if truncate_dim is not None else self.truncate_dim
        if dim is not None:
            x = x[..., :dim]
        return F.normalize(x, p=2, dim=-1) if normalize else x

    def dimension(self, hidden: int, pooling=None, truncate_dim=None) -> int:
        """The width `embed` returns for a model of hidden size `hidden`."""
        dim = hidden * len(self.pooling if pooling is None else pooling)
        for step in self.steps:
            if isinstance(step, Dense):
                dim = step.weight.shape[0]
        cap = truncate_dim if truncate_dim is not None else self.truncate_dim
        return dim if cap is None else min(dim, cap)


def read_json(path: str, what: str, required: bool = True):
    """A sentence-transformers module file's JSON; ConfigError naming `what` and the path when it is missing
    (required) or malformed; {} for a missing optional file."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        if required:
            raise ConfigError(f"{what}: {path} is missing") from None
        return {}
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"{what}: {path} is not valid JSON ({e})") from None


def _pooling(config: dict, where: str, hidden: int) -> tuple[tuple[str, ...], bool]:
    dim = config.get("embedding_dimension", config.get("word_embedding_dimension"))
    if dim is not None and dim != hidden:
        raise ConfigError(f"{where}: embedding dimension {dim} does not match the model's hidden size {hidden}")
    if "pooling_mode" in config:
        modes = config["pooling_mode"]
    else:
        modes = tuple(mode for key, mode in _LEGACY_POOLING_KEYS.items() if config.get(key)) or ("mean",)
    try:
        modes = pooling_modes(modes)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{where}: {e}") from None
    return modes, bool(config.get("include_prompt", True))


def read_dense(directory: str, where: str) -> Dense:
    """A Dense module's directory (config.json, its weights) -> Dense; ConfigError naming `where` otherwise."""
    config = read_json(os.path.join(directory, "config.json"), where)
    for key in ("module_input_name", "module_output_name"):
        if config.get(key) not in (None, _SENTENCE):
            raise ConfigError(f"{where}: {key}={config[key]!r} is not supported (only {_SENTENCE!r})")
    name = config.get("activation_function", "torch.nn.modules.activation.Tanh")
    act = name.rsplit(".", 1)[-1]
    if not name.startswith("torch.nn.") or act not in _ACTIVATIONS:
        raise ConfigError(f"{where}: activation_function {name!r} is not supported "
                          f"(torch.nn.{{{', '.join(_ACTIVATIONS)}}})")
    st_path, bin_path = os.path.join(directory, "model.safetensors"), os.path.join(directory, "pytorch_model.bin")
    if os.path.isfile(st_path):
        from safetensors.torch import load_file

        state = load_file(st_path)
    elif os.path.isfile(bin_path):
        state = torch.load(bin_path, map_location="cpu", weights_only=True)
    else:
        raise ConfigError(f"{where}: no model.safetensors or pytorch_model.bin in {directory}")
    if "linear.weight" not in state:
        raise ConfigError(f"{where}: the weights file has no 'linear.weight' (found {sorted(state)})")
    weight = state["linear.weight"].float()
    expected = (config.get("out_features", weight.shape[0]), config.get("in_features", weight.shape[1]))
    if tuple(weight.shape) != tuple(expected):
        raise ConfigError(f"{where}: linear.weight has shape {tuple(weight.shape)}, config says {expected}")
    bias = state.get("linear.bias") if config.get("bias", True) else None
    residual = state.get("residual.weight")
    use_residual = bool(config.get("use_residual", False))
    if use_residual and residual is None and weight.shape[0] != weight.shape[1]:
        raise ConfigError(f"{where}: use_residual with in != out features needs 'residual.weight'")
    return Dense(weight, None if bias is None else bias.float(), act,
                 None if residual is None else residual.float(), use_residual)


def read_sentence_config(directory: str, hidden: int) -> SentenceConfig:
    """The sentence-transformers configuration in `directory` (defaults when it has none)."""
    cfg = SentenceConfig()
    st = read_json(os.path.join(directory, "config_sentence_transformers.json"),
               "config_sentence_transformers.json", required=False)
    prompts = st.get("prompts") or {}
    if not isinstance(prompts, dict) or not all(isinstance(v, str) for v in prompts.values()):
        raise ConfigError(f"config_sentence_transformers.json: 'prompts' must map names to strings, got {prompts!r}")
    # sentence-transformers' SentenceTransformer always knows 'query' and 'document' (empty by default)
    cfg.prompts = {"query": "", "document": "", **prompts}
    cfg.default_prompt_name = st.get("default_prompt_name")
    if cfg.default_prompt_name is not None and cfg.default_prompt_name not in cfg.prompts:
        raise ConfigError(f"config_sentence_transformers.json: default_prompt_name "
                          f"{cfg.default_prompt_name!r} is not one of the prompts {sorted(cfg.prompts)}")
    cfg.truncate_dim = st.get("truncate_dim")

    modules_path = os.path.join(directory, "modules.json")
    if not os.path.isfile(modules_path):
        return cfg
    modules = read_json(modules_path, "modules.json")
    if not isinstance(modules, list) or not all(isinstance(m, dict) and "type" in m for m in modules):
        raise ConfigError("modules.json must be a list of {idx, name, path, type} objects")
    modules = sorted(modules, key=lambda m: m.get("idx", 0))
    kinds = []
    for m in modules:
        module, _, kind = str(m["type"]).rpartition(".")
        kinds.append(kind if module.startswith("sentence_transformers") else m["type"])
    if not kinds or kinds[0] != "Transformer" or os.path.normpath(modules[0].get("path") or ".") != ".":
        raise ConfigError(f"modules.json: the first module must be the Transformer in the model's own "
                          f"directory (path ''); found {modules[0]['type'] if modules else 'no modules'}")
    if len(kinds) < 2 or kinds[1] != "Pooling":
        raise ConfigError(f"modules.json: bertfast needs a Pooling module right after the Transformer; "
                          f"found {[m['type'] for m in modules[1:2]] or 'none'}")
    steps = []
    for i, (m, kind) in enumerate(zip(modules, kinds)):
        if i == 0:
            continue
        sub = os.path.join(directory, m.get("path") or "")
        where = f"modules.json module {i} ({m['type']}, path {m.get('path')!r})"
        if kind == "Pooling" and i == 1:
            cfg.pooling, cfg.include_prompt = _pooling(
                read_json(os.path.join(sub, "config.json"), where), where, hidden)
        elif kind == "Dense":
            steps.append(read_dense(sub, where))
        elif kind == "Normalize":
            conf = read_json(os.path.join(sub, "config.json"), where, required=False)
            if conf.get("module_input_name", _SENTENCE) != _SENTENCE:
                raise ConfigError(f"{where}: normalizing {conf['module_input_name']!r} is not supported")
            steps.append("normalize")
        elif kind != "Dropout":  # identity at inference
            raise ConfigError(f"{where}: this module is not supported by bertfast's encode "
                              "(supported after the Transformer: Pooling, then Dense, Dropout, Normalize); "
                              "run the model with sentence-transformers and bertfast.optimize instead")
    cfg.steps = tuple(steps)
    return cfg


__all__ = ["POOLING_MODES", "SentenceConfig", "Dense", "pool", "pooling_modes", "read_dense", "read_sentence_config"]
