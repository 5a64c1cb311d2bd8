"""Task heads on top of the engine, and `load(path_or_model)`: encoder + head from one checkpoint.

Every head transformers offers for the supported families is one row of `tasks.HEADS` (dropout is the
identity in eval mode and has no step). The table is resolved once at load time
into tensors: every head tensor is looked up by name and checked against the shape config.json
implies before anything is returned, so a missing or misshapen tensor raises `LoadError` naming it
and nothing half-loaded escapes.

Per-token outputs (token classification, QA, masked LM, ELECTRA discriminator) are computed on the
real tokens only; at padded positions they are 0 (the head is not run there), like the encoder's
`last_hidden_state`. `transformers` is not needed at run time: an in-memory transformers model is
read through its `config.to_dict()` and `state_dict()` only.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from .adapters_heads import TaskAdapters, per_choice, run_heads
from .backends import get_backend
from .config import ModelConfig, read_config_json
from .encoder import Encoder, choose_dtype, model_device, split_quantization
from .loading import BASE_PREFIX, LoadError, _TensorSource, assemble, open_checkpoint
from .loading import POOLER as POOLER_MODULES
from .outputs import EncoderOutput
from .padding import pad, unpad
from .kernels.activation import apply as activation
from .tasks import (CONFIG_ACTIVATIONS, ELECTRA_SUMMARY, FIRST, FIRST_REAL, HEAD_ACTIVATIONS, HEADS, MEAN, POOLER,
                    TOKENS, act, lin, source_of, supported_architectures, task_of)

# ------------------------------------------------------------------------------------------------
# Resolving the table against a checkpoint.


def _num_labels(d: dict) -> int:
    # config.json stores id2label (num_labels is derived from it); transformers' default is 2.
    if isinstance(d.get("id2label"), dict) and d["id2label"]:
        return len(d["id2label"])
    return int(d.get("num_labels") or 2)


def _expand(steps, d: dict, family: str, task: str):
    """Replace config-dependent steps (ELECTRA's sequence summary, steps chosen by a config field) by plain ones."""
    out = []
    for step in steps:
        if isinstance(step, tuple) and step[0] == "choose":
            _, field, default, choices = step
            value = d.get(field, default)
            if value not in choices:
                raise LoadError(f"{family} {task}: config field {field!r} = {value!r} is not supported "
                                f"(supported: {', '.join(map(repr, choices))})")
            out.extend(_expand(choices[value], d, family, task))
            continue
        if step is not ELECTRA_SUMMARY:
            out.append(step)
            continue
        summary_type = d.get("summary_type", "first")
        if summary_type != "first":
            # "last"/"mean"/"cls_index" read padded positions, which the engine does not compute.
            raise LoadError(f"{family} {task}: config field 'summary_type' = {summary_type!r} is not supported "
                            "(supported: 'first')")
        if d.get("summary_use_proj", True):
            to_labels = d.get("summary_proj_to_labels", False) and _num_labels(d) > 0
            out.append(lin("sequence_summary.summary", "L" if to_labels else "H"))
        if d.get("summary_activation", "gelu"):
            out.append(act("summary_activation"))
    return out


class _Resolver:
    """Looks head tensors up by name and checks their shapes; one instance per load."""

    def __init__(self, src, config: ModelConfig, d: dict, word_embeddings: torch.Tensor, task: str):
        self.src, self.config, self.d, self.task = src, config, d, task
        self.word = word_embeddings  # [V, E], already in the engine's dtype and device
        self.dims = {"H": config.hidden_size, "E": config.embedding_size, "L": _num_labels(d),
                     "V": config.vocab_size}
        self.tied = bool(d.get("tie_word_embeddings", True))
        self.names: dict[str, torch.Tensor] = {}  # every tensor the head reads, by its name in the task model

    def dim(self, sym):
        return sym if isinstance(sym, int) else self.dims[sym]

    def tensor(self, name: str, shape) -> torch.Tensor:
        full = name if name in self.src else None
        if full is None and "LayerNorm" in name:  # old checkpoints: LayerNorm.gamma / .beta
            stem, _, suffix = name.rpartition(".")
            legacy = stem + {"weight": ".gamma", "bias": ".beta"}.get(suffix, "." + suffix)
            full = legacy if legacy in self.src else None
        if full is None:
            raise LoadError(f"head tensor {name!r} ({self.config.family} {self.task}) is missing from the checkpoint")
        t = self.src.get(full)
        if tuple(t.shape) != tuple(shape):
            raise LoadError(f"head tensor {full!r} has shape {tuple(t.shape)}, expected {tuple(shape)} "
                            f"from config.json")
        if not t.is_floating_point():
            raise LoadError(f"head tensor {full!r} has dtype {t.dtype}, expected a floating point dtype")
        if name not in self.names:  # one tensor per name, read by every step naming it
            self.names[name] = t.detach().to(device=self.word.device, dtype=self.word.dtype).contiguous()
        return self.names[name]

    def module(self, name) -> str:
        """A module's name in this checkpoint: `name`, or of a tuple of spellings the first whose weight it holds."""
        if isinstance(name, str):
            return name
        present = [n for n in name if n + ".weight" in self.src]
        if not present:
            raise LoadError(f"head tensor {name[0] + '.weight'!r} ({self.config.family} {self.task}) is missing from "
                            f"the checkpoint (also looked for {', '.join(repr(n + '.weight') for n in name[1:])})")
        return present[0]

    def has_bias(self, bias) -> bool:
        """A step's bias: True, or a `tasks.flag` read from config.json."""
        if bias is True:
            return True
        _, field, default = bias
        value = self.d.get(field, default)
        if not isinstance(value, bool):
            raise LoadError(f"{self.config.family} {self.task}: config field {field!r} must be true or false, "
                            f"got {value!r}")
        return value

    def activation(self, kind: str):
        if kind == "hidden_act":
            return self.config.activation  # already validated and mapped by ModelConfig
        name = (self.d.get(kind) or CONFIG_ACTIVATIONS[kind]) if kind in CONFIG_ACTIVATIONS else kind
        if name not in HEAD_ACTIVATIONS:
            raise LoadError(f"{self.config.family} {self.task}: activation {name!r} is not supported "
                            f"(supported: {', '.join(HEAD_ACTIVATIONS)})")
        return HEAD_ACTIVATIONS[name]

    def step(self, step):
        """A table step -> an executable step: ("linear", W, b) | ("act", id) | ("layernorm", w, b) | ("squeeze",),
        b None where the module has no bias."""
        kind = step[0]
        if kind in ("linear", "layernorm"):
            _, name, *dims, bias = step
            name, shape = self.module(name), tuple(self.dim(d) for d in dims)
            w = self.tensor(name + ".weight", shape)
            return (kind, w, self.tensor(name + ".bias", shape[:1]) if self.has_bias(bias) else None)
        if kind == "decoder":
            _, weight_name, biases, inp, bias = step
            V, inp = self.config.vocab_size, self.dim(inp)
            if self.tied:
                if tuple(self.word.shape) != (V, inp):
                    raise LoadError(f"tied decoder {weight_name!r} needs word embeddings of shape {(V, inp)}, "
                                    f"found {tuple(self.word.shape)}")
                weight = self.names[weight_name] = self.word  # an adapter's saved decoder unties it for its rows
            else:
                weight = self.tensor(weight_name, (V, inp))
                biases = biases[::-1]
            if not self.has_bias(bias):
                return ("linear", weight, None)
            present = [b for b in biases if b in self.src]
            if not present:
                also = ", ".join(map(repr, biases[1:])) or "nothing else"
                raise LoadError(f"head tensor {biases[0]!r} ({self.config.family} {self.task}) is missing from "
                                f"the checkpoint (also looked for {also})")
            bias = self.tensor(present[0], (V,))
            self.names.update({b: bias for b in biases})  # transformers' aliases of one tensor
            return ("linear", weight, bias)
        if kind == "act":
            return ("act", self.activation(step[1]))
        if kind == "squeeze":
            return step
        raise AssertionError(f"unknown head step {step!r}")


# ------------------------------------------------------------------------------------------------
# Modules.


class Head(nn.Module):
    """One task head: output field -> (source, executable steps), run on the encoder's outputs; `tensors`: the
    tensors its steps hold, by their names in the task model (what an adapter's modules_to_save replaces)."""

    def __init__(self, branches: dict, eps: float, tensors: dict[str, torch.Tensor] | None = None):
        super().__init__()
        self.branches = branches
        self.eps = eps
        self.tensors = dict(tensors or {})

    def extra_repr(self):
        return ", ".join(f"{field}<-{source}({len(steps)} steps)" for field, (source, steps) in self.branches.items())

    @property
    def sources(self) -> set[str]:
        return {source for source, _ in self.branches.values()}

    def run(self, x: torch.Tensor, steps, per_row: bool = False) -> torch.Tensor:
        """x: (N, H) -> (N, ...). per_row runs each linear one row at a time: a GEMM library picks its
        kernel and summation order by row count, so only M=1 calls make a row's result independent of
        the others in its batch (sequence-level heads: N = batch rows, a few GEMVs)."""
        for step in steps:
            kind = step[0]
            if kind == "linear":
                x = (torch.cat([F.linear(row, step[1], step[2]) for row in x.split(1)]) if per_row and len(x) > 1
                     else F.linear(x, step[1], step[2]))
            elif kind == "layernorm":
                x = F.layer_norm(x, (x.shape[-1],), step[1], step[2], self.eps)
            elif kind == "act":
                x = x if step[1] is None else activation(x, step[1])
            else:  # squeeze
                x = x.squeeze(-1)
        return x

    def forward(self, last_hidden_state, pooler_output, attention_mask) -> dict[str, torch.Tensor]:
        """last_hidden_state: (B, S, H); pooler_output: (B, H) or None; attention_mask: (B, S) 0/1. Per-token steps
        run one sequence at a time (a GEMM library's summation order follows its row count), so a row's bits do not
        depend on the other rows.

        Returns field -> tensor: (B, ...) for sequence-level fields, (B, S, ...) for per-token ones
        (0 at padded positions).
        """
        B, S = attention_mask.shape
        out = {}
        for field, (source, steps) in self.branches.items():
            if source == POOLER:  # sequence level: batch-invariant like the engine
                out[field] = self.run(pooler_output, steps, per_row=True)
            elif source == FIRST:
                out[field] = self.run(last_hidden_state[:, 0], steps, per_row=True)
            elif source == FIRST_REAL:
                first = attention_mask.argmax(1)
                out[field] = self.run(last_hidden_state[torch.arange(B, device=first.device), first], steps,
                                      per_row=True)
            elif source == MEAN:  # padded positions hold 0; a row without real tokens pools to 0
                count = attention_mask.sum(1, keepdim=True).clamp(min=1).to(last_hidden_state.dtype)
                out[field] = self.run(last_hidden_state.sum(1) / count, steps, per_row=True)
            else:  # per token: run on the real tokens only, scatter back with zeros at padding
                assert source == TOKENS, source
                packed, indices, cu_seqlens, _ = unpad(last_hidden_state, attention_mask)
                bounds = cu_seqlens.tolist()
                runs = [self.run(packed[a:b], steps) for a, b in zip(bounds, bounds[1:]) if b > a]
                out[field] = pad(torch.cat(runs) if runs else self.run(packed, steps), indices, B, S)
        return out


class TaskOutput(EncoderOutput):
    """transformers' field names in transformers' order (without loss and attentions), then
    `last_hidden_state`: attribute, integer and key access over the non-None fields."""

    def __init__(self, fields: dict, hidden_states=None, last_hidden_state=None):
        self._fields = tuple(fields) + ("hidden_states", "last_hidden_state")
        for name, value in fields.items():
            setattr(self, name, value)
        self.hidden_states = hidden_states
        self.last_hidden_state = last_hidden_state
        self.pooler_output = None


class TaskModel(TaskAdapters, nn.Module):
    """A bertfast `Encoder` plus the task head of the same checkpoint (see `load`).

    forward(input_ids, attention_mask, token_type_ids, position_ids, output_hidden_states, adapter_ids) takes
    (B, S) tensors, or (B, C, S) for multiple choice, and returns a `TaskOutput`:
      sequence classification / NSP / SOP: logits (B, num_labels or 2); multiple choice: logits (B, C);
      token classification: logits (B, S, num_labels); QA: start_logits, end_logits (B, S);
      masked LM: logits (B, S, V); BERT pre-training: prediction_logits (B, S, V),
      seq_relationship_logits (B, 2); ALBERT: prediction_logits, sop_logits (B, num_labels);
      ELECTRA discriminator: logits (B, S).
    Per-token outputs are 0 at padded positions. hidden_states / last_hidden_state are (B*C, S, H)
    for multiple choice, as in transformers. Outputs have the engine's dtype. Sequence-level outputs
    are batch-invariant: a row's logits do not depend on the other rows of its batch.

    `labels` (sequence and token classification): the label names in logit order (config.json's id2label,
    transformers' `LABEL_<i>` where it has none); `problem_type` as config.json gives it; `scores(logits)`
    turns classification logits into probabilities.

    LoRA adapters (`load_adapter`, `TaskAdapters`): adapter_ids gives one loaded adapter's name or None (base) per row
    (per example for multiple choice); a row runs its adapter's LoRA in the encoder and its adapter's head tensors
    (modules_to_save) in the head, the base head where the adapter saved none. With adapters, per-token outputs too
    are batch-invariant.
    """

    def __init__(self, encoder: Encoder, head: Head, architecture: str, id2label: dict | None = None,
                 labels: list[str] | None = None, problem_type: str | None = None):
        super().__init__()
        self.encoder = encoder
        self.head = head
        self.config = encoder.config
        self.architecture = architecture
        self.task = architecture.split("For", 1)[1]
        self.id2label = id2label
        self.labels = labels
        self.problem_type = problem_type
        self._adapter_heads: dict[str, Head] = {}  # adapter name -> its head, for adapters saving head tensors

    @property
    def multi_label(self) -> bool:
        """Each label scored on its own (sigmoid): one label (a cross-encoder's relevance, a regression
        score) or problem_type multi_label_classification, as transformers' text-classification pipeline."""
        return self.labels is not None and (len(self.labels) == 1 or self.problem_type == "multi_label_classification")

    def scores(self, logits: torch.Tensor) -> torch.Tensor:
        """Classification logits (B, ..., num_labels) -> fp32 probabilities: sigmoid per label when
        `multi_label`, else softmax over the labels. Batch-invariant, like the logits: softmax runs row by
        row already; an elementwise sigmoid takes vector or scalar code by position in the tensor, so it
        runs one row at a time."""
        x = logits.float()
        if not self.multi_label:
            return torch.softmax(x, dim=-1)
        return torch.cat([torch.sigmoid(row) for row in x.split(1)]) if len(x) > 1 else torch.sigmoid(x)

    def extra_repr(self):
        return f"architecture={self.architecture!r}"

    @torch.inference_mode()
    def forward(self, input_ids, attention_mask=None, token_type_ids=None, position_ids=None,
                output_hidden_states: bool = False, return_dict: bool = True, adapter_ids=None):
        choices = None
        if self.task == "MultipleChoice":
            examples = input_ids.shape[0] if torch.is_tensor(input_ids) else None
            input_ids, attention_mask, token_type_ids, position_ids, choices = _flatten_choices(
                input_ids, attention_mask, token_type_ids, position_ids)
            adapter_ids = per_choice(adapter_ids, examples, choices)
        if FIRST in self.head.sources:
            _check_first_token(attention_mask, self.architecture)
        enc = self.encoder(input_ids, attention_mask, token_type_ids, position_ids, output_hidden_states,
                           adapter_ids=adapter_ids)
        last = enc.last_hidden_state
        mask = (torch.ones(last.shape[:2], dtype=torch.int64, device=last.device) if attention_mask is None
                else attention_mask.to(last.device))
        heads = self._row_heads(adapter_ids, last.shape[0])
        fields = (self.head(last, enc.pooler_output, mask) if heads is None else
                  run_heads(heads, last, enc.pooler_output, mask))
        if self.task == "QuestionAnswering":
            logits = fields.pop("logits")
            fields = {"start_logits": logits[..., 0].contiguous(), "end_logits": logits[..., 1].contiguous()}
        if choices is not None:
            fields["logits"] = fields["logits"].view(-1, choices)
        out = TaskOutput(fields, enc.hidden_states, last)
        return out if return_dict else out.to_tuple()


def _flatten_choices(input_ids, attention_mask, token_type_ids, position_ids):
    """(B, C, S) inputs -> (B*C, S), and C. Raises ValueError for anything else."""
    if not torch.is_tensor(input_ids) or input_ids.dim() != 3:
        shape = tuple(input_ids.shape) if torch.is_tensor(input_ids) else type(input_ids).__name__
        raise ValueError(f"multiple choice input_ids must have shape (batch, num_choices, seq_len), got {shape}")
    flat = []
    for name, t in (("attention_mask", attention_mask), ("token_type_ids", token_type_ids),
                    ("position_ids", position_ids)):
        if t is not None:
            if not torch.is_tensor(t) or t.shape != input_ids.shape:
                shape = tuple(t.shape) if torch.is_tensor(t) else type(t).__name__
                raise ValueError(f"{name} has shape {shape} but input_ids has {tuple(input_ids.shape)}")
            t = t.reshape(-1, t.shape[-1])
        flat.append(t)
    return (input_ids.reshape(-1, input_ids.shape[-1]), *flat, input_ids.shape[1])


def _check_first_token(attention_mask, architecture):
    """Heads reading token 0 need it computed: reject left padding (the engine zeroes padding)."""
    if not (torch.is_tensor(attention_mask) and attention_mask.dim() == 2 and attention_mask.shape[1] > 0):
        return  # absent (all real) or malformed: the Encoder's own checks report the latter
    masked = (attention_mask[:, 0] == 0) & (attention_mask.sum(1) > 0)
    if bool(masked.any()):
        rows = masked.nonzero().flatten().tolist()[:5]
        raise ValueError(f"attention_mask masks position 0 of rows {rows} that hold real tokens (left padding): "
                         f"the {architecture} head reads position 0, which this engine does not compute for "
                         "padding. Pad on the right.")


# ------------------------------------------------------------------------------------------------
# Entry point.


def load(path_or_hf_model, *, backend: str = "auto", dtype=None, architecture: str | None = None,
         adapters: dict | None = None):
    """Encoder + task head from a Hugging Face checkpoint directory or an in-memory transformers model.

    The head follows `architectures[0]` of config.json (for a directory) or the model's class name (for
    an in-memory model); `architecture` overrides both, e.g. "BertForMaskedLM". A base-model
    architecture (e.g. "BertModel") or a config without `architectures` gives a plain `Encoder`;
    a task architecture gives a `TaskModel`. dtype None keeps the checkpoint's dtype, "auto" takes the
    backend's fastest within the fidelity rule (`encoder.choose_dtype`), "int8" quantizes the encoder's GEMM
    weights as `Encoder.from_pretrained` does; the head runs in the engine's dtype (fp32 with int8).
    adapters: {name: PEFT LoRA directory}, each loaded with `load_adapter` (a task model also takes the adapter's
    modules_to_save head tensors for its rows).
    Raises LoadError naming the architecture, tensor or file that cannot be served
    (`supported_architectures()` lists the supported ones); ConfigError for an unsupported config.json field.
    """
    model_dir = None
    if isinstance(path_or_hf_model, (str, os.PathLike)):
        model_dir = os.fspath(path_or_hf_model)
        if not os.path.isdir(model_dir):
            raise LoadError(f"model directory {model_dir} does not exist")
        d = read_config_json(model_dir)
        archs = d.get("architectures") or []
        arch = architecture or (archs[0] if archs else None)
    elif hasattr(path_or_hf_model, "state_dict") and hasattr(getattr(path_or_hf_model, "config", None), "to_dict"):
        d = path_or_hf_model.config.to_dict()
        arch = architecture or type(path_or_hf_model).__name__
    else:
        raise LoadError("expected a model directory or an in-memory transformers model, got "
                        f"{type(path_or_hf_model).__name__}")
    config = ModelConfig.from_dict(d)
    task = task_of(config.family, arch) if arch else None  # unknown architecture fails before any read
    device = "cpu" if model_dir is not None else model_device(path_or_hf_model)
    dtype, quantize = split_quantization(dtype)
    engine_backend = get_backend(backend, device, quantize, family=config.family)
    dtype = choose_dtype(dtype, engine_backend, device)
    if model_dir is not None:
        src = open_checkpoint(model_dir)
    else:
        sd = {k: v.detach() for k, v in path_or_hf_model.state_dict().items()}
        src = _TensorSource({k: "the in-memory model" for k in sd}, sd.__getitem__)
    weights = assemble(src, config, dtype, engine_backend.stream_dtype(dtype))
    if task is None:
        return _with_adapters(Encoder(weights, engine_backend, model_dir=model_dir, quantize=quantize), adapters)

    branches = HEADS[config.family][task]
    if task == "QuestionAnswering" and _num_labels(d) != 2:
        raise LoadError(f"{arch}: num_labels is {_num_labels(d)} in config.json, question answering needs 2 "
                        "(start and end logits)")
    resolver = _Resolver(src, config, d, weights.embeddings.word, task)
    resolved = {field: (source_of(source, d, config.family, task),
                        [resolver.step(s) for s in _expand(steps, d, config.family, task)])
                for field, (source, steps) in branches.items()}
    needs_pooler = any(source == POOLER for source, _ in resolved.values())
    if needs_pooler and weights.pooler_weight is None:
        raise LoadError(f"{arch} reads the pooler, but tensor "
                        f"{BASE_PREFIX[config.family] + POOLER_MODULES[config.family] + '.weight'!r} "
                        "is missing from the checkpoint")
    encoder = Encoder(weights, engine_backend, add_pooling_layer=needs_pooler, model_dir=model_dir, quantize=quantize)
    id2label = d.get("id2label") if isinstance(d.get("id2label"), dict) else None
    labels = None
    if task in ("SequenceClassification", "TokenClassification"):
        # keys are strings in config.json, ints in an in-memory transformers config
        names = {str(k): str(v) for k, v in (id2label or {}).items()}
        labels = [names.get(str(i), f"LABEL_{i}") for i in range(_num_labels(d))]
    model = TaskModel(encoder, Head(resolved, config.layer_norm_eps, resolver.names), arch, id2label, labels,
                      d.get("problem_type"))
    return _with_adapters(model, adapters)


def _with_adapters(model, adapters: dict | None):
    for name, path in (adapters or {}).items():
        model.load_adapter(name, path)
    return model


__all__ = ["load", "supported_architectures", "TaskModel", "TaskOutput", "Head", "HEADS"]
