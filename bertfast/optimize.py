"""`bertfast.optimize(model)`: run a Hugging Face model's encoder on the bertfast engine, in place.

The model object is returned itself: its task head, its modules and its state dict are untouched
(`save_pretrained` keeps working). Only its base model (`model.base_model`, e.g. the `BertModel`
inside `BertForSequenceClassification`) changes class, to a thin subclass of its own class whose
`forward` sends supported calls to the engine and returns the same output type. Calls the engine
does not serve (training mode, `output_attentions`, `head_mask`, `inputs_embeds`, cross-attention,
caches, left padding under a pooler or a head reading position 0, `output_hidden_states` given as
indices, or the hidden states transformers 4 gives otherwise than 5: ModernBERT's, ALBERT's with inner
groups) run the original modules after a one-time warning, or raise under `strict=True`: never a
silently different answer.

A sentence-transformers `SentenceTransformer` is accelerated the same way: the Hugging Face model
inside its Transformer module is optimized, every other module (pooling, dense, normalize) runs as
before, so `model.encode(...)` keeps working. A stack whose first module is no such Transformer over a
supported family is left unchanged after a warning (strict=True raises).

A `peft.PeftModel` (LoRA), or a transformers model given adapters through transformers' PEFT integration
(`add_adapter`, `load_adapter`: what a SentenceTransformer's own `add_adapter` does to its Transformer's model), is
served with its active adapter: the engine runs the base weights with the adapter unmerged, as
`Encoder.default_adapter` (the model itself is returned; a call the engine cannot serve that way, with the adapters
disabled, another active adapter or PEFT's per-call `adapter_names`, runs the original modules), or, with merge=True,
the merged weights of a merged copy (returned, for a SentenceTransformer a copy of the stack around it; the model is
left as it was).

The engine reads the weights at optimize time: after changing them, call `optimize` again.
"""

from __future__ import annotations

import copy
import inspect
import sys
import warnings


from .adapters_peft import BaseWeights, read_peft_model
from .config import ConfigError
from .encoder import Encoder
from .loading import LoadError
from .tasks import reads_first_token

# The output class each family's base model returns (from transformers.modeling_outputs).
OUTPUT_CLASS = {
    "bert": "BaseModelOutputWithPoolingAndCrossAttentions",
    "roberta": "BaseModelOutputWithPoolingAndCrossAttentions",
    "xlm-roberta": "BaseModelOutputWithPoolingAndCrossAttentions",
    "albert": "BaseModelOutputWithPooling",
    "electra": "BaseModelOutputWithPastAndCrossAttentions",
    "distilbert": "BaseModelOutput",
    "mpnet": "BaseModelOutputWithPooling",
    "modernbert": "BaseModelOutput",
    "nomic_bert": "BaseModelOutputWithPooling",
    "gte": "BaseModelOutputWithPooling",
    "deberta-v2": "BaseModelOutput",
}
# Arguments the engine serves; any other argument given a non-default value means fallback.
SERVED = {"input_ids", "attention_mask", "token_type_ids", "position_ids", "output_hidden_states",
          "return_dict", "use_cache", "output_attentions"}
# What transformers 4's ModernBertFor* heads pass their base model: the padded input's shape (served when it is).
PADDED_SHAPE = {"batch_size": 0, "seq_len": 1}


def _transformers_major() -> int:
    """The major version of the transformers an optimized model comes from (imported already)."""
    import transformers

    return int(transformers.__version__.split(".")[0])


class EngineUnsupported(RuntimeError):
    """Raised under strict=True for a call the bertfast engine does not serve."""


class _EngineForward:
    """Mixin placed in front of the base model's class; see the module docstring."""

    _bertfast_encoder: Encoder
    _bertfast_strict: bool
    _bertfast_warned: set

    def forward(self, *args, **kwargs):
        original = self._bertfast_original_class
        bound = inspect.signature(original.forward).bind(self, *args, **kwargs).arguments
        extra = bound.pop("kwargs", {}) or {}
        call = {**{k: v for k, v in bound.items() if k != "self"}, **extra}
        reason = self._bertfast_unsupported(call)
        if reason is not None:
            if self._bertfast_strict:
                raise EngineUnsupported(f"bertfast engine cannot serve this call: {reason}")
            if reason not in self._bertfast_warned:
                self._bertfast_warned.add(reason)
                warnings.warn(f"bertfast: {reason}; running the original modules", stacklevel=2)
            return original.forward(self, *args, **kwargs)
        return self._bertfast_run(call)

    def _bertfast_unsupported(self, call) -> str | None:
        adapter_state = getattr(self, "_bertfast_adapter_state", None)  # an adapter's, see _optimize_peft
        if adapter_state is not None and (reason := adapter_state()) is not None:
            return reason
        if self.training:
            return "the model is in training mode"
        if call.get("input_ids") is None:
            return "no input_ids (inputs_embeds are not served)"
        cfg = self.config
        if call.get("output_attentions") or (call.get("output_attentions") is None
                                             and getattr(cfg, "output_attentions", False)):
            return "output_attentions=True"
        if call.get("use_cache"):
            return "use_cache=True"
        hidden = self._bertfast_want_hidden(call)
        if not isinstance(hidden, bool):  # transformers 5 also takes indices: the states to keep
            return f"output_hidden_states={hidden!r} (a selection, not True/False)"
        if hidden:  # the engine gives transformers 5's hidden states; 4.x differs in two cases
            v4 = _transformers_major() < 5
            tied = getattr(cfg, "tie_last_hidden_states", None)
            if ((tied is False or (tied is None and v4))
                    and self._bertfast_encoder.engine.weights.final_ln_weight is not None):
                return ("the last hidden state before the final norm (" +
                        ("tie_last_hidden_states=False)" if tied is False else "transformers 4's hidden states)"))
            if v4 and getattr(cfg, "inner_group_num", 1) > 1:
                return "output_hidden_states with ALBERT's inner_group_num > 1 (transformers 4: a state per group)"
        for name, value in call.items():
            if name in PADDED_SHAPE and value == call["input_ids"].shape[PADDED_SHAPE[name]]:
                continue
            if name not in SERVED and value is not None and value is not False:
                return f"argument {name!r} is set"
        mask = call.get("attention_mask")
        pooler = self._bertfast_encoder.engine.weights.pooler_weight is not None
        if ((pooler or self._bertfast_head_reads_first) and mask is not None
                and bool(((mask[..., 0] == 0) & (mask.sum(-1) > 0)).any())):
            return ("left padding with a pooler (pooler_output reads position 0)" if pooler else
                    "left padding under a head that reads position 0, which the engine leaves 0 for padding")
        return None

    def _bertfast_want_hidden(self, call):
        """output_hidden_states of the call, else of the config."""
        hidden = call.get("output_hidden_states")
        if hidden is None:
            hidden = getattr(self.config, "output_hidden_states", None)
        return False if hidden is None else hidden

    def _bertfast_run(self, call):
        from transformers import modeling_outputs

        want_hidden = self._bertfast_want_hidden(call)
        # A model without token types ignores any it is given (MPNet takes them through **kwargs), as here.
        types = call.get("token_type_ids") if self._bertfast_encoder.config.type_vocab_size else None
        out = self._bertfast_encoder(call["input_ids"], call.get("attention_mask"), types,
                                     call.get("position_ids"), output_hidden_states=want_hidden)
        dtype = self._bertfast_dtype  # the head expects the model's own dtype
        fields = {"last_hidden_state": out.last_hidden_state.to(dtype)}
        cls = getattr(modeling_outputs, OUTPUT_CLASS[self._bertfast_encoder.config.family])
        if "pooler_output" in cls.__dataclass_fields__:
            fields["pooler_output"] = None if out.pooler_output is None else out.pooler_output.to(dtype)
        if want_hidden:
            fields["hidden_states"] = tuple(h.to(dtype) for h in out.hidden_states)
        result = cls(**fields)
        return result if call.get("return_dict", True) is not False else result.to_tuple()


def optimize(model, *, backend: str = "auto", dtype=None, strict: bool = False, merge: bool = False):
    """Run `model`'s encoder on bertfast; returns `model` itself (with merge=True: the merged copy).

    model: a transformers base or task model of a supported family (BERT, RoBERTa, XLM-R, ELECTRA,
    ALBERT, DistilBERT, MPNet, ModernBERT, NomicBERT, GTE). dtype: the engine's dtype (None: the model's;
    "auto": the backend's fastest within the fidelity rule, see `Encoder.from_pretrained`); outputs are cast
    back to the model's dtype for its head. strict: raise EngineUnsupported instead of falling back.
    A sentence-transformers SentenceTransformer (or SparseEncoder: its MLM head and pooling then run in torch; the
    fused path is `bertfast.SparseEncoder`) has its Transformer module's model optimized.
    A `peft.PeftModel` over such a model, or such a model with adapters loaded through transformers' PEFT
    integration (`add_adapter` / `load_adapter`, also a SentenceTransformer's Transformer's model), with its active
    LoRA adapter (or several: PEFT sums them, the engine serves them stacked as one adapter named "a+b"): served
    unmerged, or, with merge=True, returns a merged copy optimized (`merge_and_unload` on a deep copy; a
    SentenceTransformer: a deep copy of it around that). Raises LoadError for an adapter bertfast cannot serve
    (another peft_type, DoRA: `adapters_peft.check_config`; a SentenceTransformer warns and runs unchanged instead, as
    for any model it cannot serve, unless strict), ValueError for no active adapter, for merge=True with the adapters
    disabled or on a model without an adapter.
    """
    if _carries_adapter(model):
        return _optimize_peft(model, backend, dtype, strict, merge)
    st = sys.modules.get("sentence_transformers")  # imported whenever `model` can be one
    if st is not None and isinstance(model, (st.SentenceTransformer, getattr(st, "SparseEncoder", ()))):
        return _optimize_sentence_transformer(model, backend, dtype, strict, merge)
    if merge:
        raise ValueError(f"merge=True takes a peft.PeftModel or a model with adapters loaded through transformers' "
                         f"PEFT integration (add_adapter, load_adapter), got {type(model).__name__}")
    base = getattr(model, "base_model", None)
    if base is None or not hasattr(base, "config"):
        raise ValueError(f"expected a transformers PreTrainedModel, got {type(model).__name__}")
    _install(model, base, Encoder.from_hf(base, backend=backend, dtype=dtype), strict)
    return model


def _install(model, base, encoder: Encoder, strict: bool, adapter_state=None) -> None:
    """Put `encoder` in front of `base` (model.base_model, or the one under a PeftModel)."""
    original = getattr(base, "_bertfast_original_class", type(base))
    try:
        param = next(base.parameters())
    except StopIteration:
        raise ValueError("the model has no parameters") from None
    if param.device != encoder.device:
        raise ValueError(f"model parameters on {param.device} but the engine runs on {encoder.device}")
    base.__class__ = type(original.__name__, (_EngineForward, original),
                          {"__module__": original.__module__, "__qualname__": original.__qualname__,
                           "_bertfast_original_class": original})
    # Plain attributes, not submodules: the model's modules and state dict stay exactly as they were.
    head_reads_first = reads_first_token(encoder.config.family, type(model).__name__, model.config.to_dict())
    for name, value in (("_bertfast_encoder", encoder), ("_bertfast_strict", strict),
                        ("_bertfast_warned", set()), ("_bertfast_dtype", param.dtype),
                        ("_bertfast_head_reads_first", head_reads_first), ("_bertfast_adapter_state", adapter_state)):
        object.__setattr__(base, name, value)


def _carries_adapter(model) -> bool:
    """A peft.PeftModel, or a transformers model with adapters loaded through transformers' PEFT integration."""
    peft = sys.modules.get("peft")  # imported whenever `model` can carry an adapter
    return peft is not None and (isinstance(model, peft.PeftModel)
                                 or getattr(model, "_hf_peft_config_loaded", False) is True)


def _optimize_peft(model, backend, dtype, strict, merge):
    from peft import PeftModel
    from peft.tuners.lora import LoraLayer
    from peft.tuners.tuners_utils import BaseTunerLayer

    wrapped = isinstance(model, PeftModel)
    hf = model.get_base_model() if wrapped else model
    tuners = [m for m in hf.modules() if isinstance(m, BaseTunerLayer)]
    # The integration's active_adapters() reads the first tuner layer too, behind transformers' PEFT version gate.
    active = list(model.active_adapters) if wrapped else list(tuners[0].active_adapters) if tuners else []
    kind = "PeftModel" if wrapped else type(model).__name__
    if not active:
        raise ValueError(f"the {kind} has no active adapter: set_adapter(name) first")
    # Several active adapters: PEFT sums their deltas, the engine serves them stacked as one (`adapters.stack`).
    name = "+".join(active)
    files = [read_peft_model(model, n) for n in active]  # refuses what the engine cannot serve exactly, merged or not
    if merge:
        if any(t.disable_adapters for t in tuners):
            raise ValueError(f"the {kind}'s adapters are disabled (disable_adapter / disable_adapters): merging "
                             f"{name!r} would serve what the model does not run; enable them first, or optimize "
                             "without merge=True (the engine serves calls with the adapters enabled)")
        return optimize(_merge_and_unload(_copy(model), active), backend=backend, dtype=dtype, strict=strict)
    base = hf.base_model
    layers = [m for m in base.modules() if isinstance(m, LoraLayer)]
    if not layers:
        raise ValueError("the PeftModel's adapter adapts no layer of the encoder: nothing for bertfast to serve "
                         "unmerged (merge=True serves the merged model)")
    if any(layer.merged for layer in layers):
        raise ValueError("the adapter is merged into the PeftModel's weights (merge_adapter): unmerge_adapter() "
                         "first, or optimize(model, merge=True)")
    encoder = Encoder.from_hf(BaseWeights(base), backend=backend, dtype=dtype)
    encoder.load_adapter(name, files if len(files) > 1 else files[0])
    encoder.default_adapter = name
    _install(hf, base, encoder, strict, _adapter_state(layers[0], active))
    return model


def _copy(model):
    """A deep copy of `model` without the engines an earlier `optimize` put in it: their native weights do not copy,
    and `_install` puts a new one in the copy."""
    engines = (getattr(m, "_bertfast_encoder", None) for m in model.modules())
    return copy.deepcopy(model, {id(e): None for e in engines if e is not None})


def _merge_and_unload(model, names: list[str]):
    """`model` (a copy, changed in place) with its active adapters `names` merged and PEFT's modules removed: a
    PeftModel's own merge_and_unload, else (transformers' integration has no merge) PEFT's steps: each tuner layer
    merged and put back as its base layer, each modules_to_save wrapper as the module it runs."""
    from peft import PeftModel
    from peft.tuners.tuners_utils import BaseTunerLayer

    if isinstance(model, PeftModel):
        return model.merge_and_unload()
    done: list[str] = []
    for key, module in list(model.named_modules()):
        unload = getattr(module, "unload_and_optionally_merge_module", None)
        if (unload is None and not isinstance(module, BaseTunerLayer)) or any(key.startswith(f"{d}.") for d in done):
            continue
        done.append(key)
        if unload is not None:
            new = unload(merge=True, safe_merge=False, adapter_names=names)
        else:
            module.merge(adapter_names=names)
            new = module.get_base_layer()
        parent, _, child = key.rpartition(".")
        setattr(model.get_submodule(parent), child, new)
    del model.peft_config
    model._hf_peft_config_loaded = False
    return model


def _adapter_state(layer, names: list[str]):
    """The adapters' state (a PeftModel's or the integration's) as one of the LoRA layers sees it at call time -> why
    the engine cannot serve the call with the active adapters `names`, or None."""
    served = names[0] if len(names) == 1 else names

    def reason() -> str | None:
        if layer.disable_adapters:
            return "the adapters are disabled (disable_adapter / disable_adapters)"
        if list(layer.active_adapters) != names:
            return f"the active adapter is no longer {served!r} (optimize again to serve {layer.active_adapters!r})"
        if layer.merged:
            return "the adapter was merged into the weights after optimize"
        if layer._forward_pre_hooks:  # PEFT's per-call adapter_names hooks its LoRA layers
            return "forward hooks on the LoRA layers (PEFT's adapter_names)"
        return None
    return reason


def _optimize_sentence_transformer(model, backend, dtype, strict, merge):
    first = model[0] if len(model) else None
    hf = getattr(first, "auto_model", None)
    if merge and not _carries_adapter(hf):
        raise ValueError(f"merge=True takes a SentenceTransformer whose Transformer's model has a PEFT adapter "
                         f"(add_adapter, load_adapter, a peft.PeftModel), got one over {type(hf).__name__}")
    if hf is None or not hasattr(hf, "base_model"):
        reason = f"its first module is {type(first).__name__}, not a Transformer over a transformers model"
    elif getattr(model, "do_query_expansion", False) and getattr(model, "attend_to_expansion_tokens", None) is False:
        reason = ("a PyLate ColBERT reads the outputs of its query expansion, tokens no token attends to (attention "
                  "mask 0), and the engine computes no masked position: use bertfast.ColBERT.from_pylate(model)")
    else:
        try:
            served = optimize(hf, backend=backend, dtype=dtype, strict=strict, merge=merge)
            # merge=True: a copy of the stack with the merged copy of the model in its place (deepcopy's memo)
            return copy.deepcopy(model, {id(hf): served}) if merge else model
        except (ConfigError, LoadError) as e:  # a family or config the engine does not serve
            reason = str(e)
    if strict:
        raise EngineUnsupported(f"bertfast cannot serve this SentenceTransformer: {reason}")
    warnings.warn(f"bertfast: cannot serve this SentenceTransformer ({reason}); it runs unchanged", stacklevel=3)
    return model


__all__ = ["optimize", "EngineUnsupported"]
