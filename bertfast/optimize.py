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

The engine reads the weights at optimize time: after changing them, call `optimize` again.
"""

from __future__ import annotations

import inspect
import sys
import warnings


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


def optimize(model, *, backend: str = "auto", dtype=None, strict: bool = False):
    """Run `model`'s encoder on bertfast; returns `model` itself.

    model: a transformers base or task model of a supported family (BERT, RoBERTa, XLM-R, ELECTRA,
    ALBERT, DistilBERT, MPNet, ModernBERT, NomicBERT, GTE). dtype: the engine's dtype (None: the model's;
    "auto": the backend's fastest within the fidelity rule, see `Encoder.from_pretrained`); outputs are cast
    back to the model's dtype for its head. strict: raise EngineUnsupported instead of falling back.
    A sentence-transformers SentenceTransformer (or SparseEncoder: its MLM head and pooling then run in torch; the
    fused path is `bertfast.SparseEncoder`) has its Transformer module's model optimized.
    """
    st = sys.modules.get("sentence_transformers")  # imported whenever `model` can be one
    if st is not None and isinstance(model, (st.SentenceTransformer, getattr(st, "SparseEncoder", ()))):
        return _optimize_sentence_transformer(model, backend, dtype, strict)
    base = getattr(model, "base_model", None)
    if base is None or not hasattr(base, "config"):
        raise ValueError(f"expected a transformers PreTrainedModel, got {type(model).__name__}")
    original = getattr(base, "_bertfast_original_class", type(base))
    encoder = Encoder.from_hf(base, backend=backend, dtype=dtype)
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
                        ("_bertfast_head_reads_first", head_reads_first)):
        object.__setattr__(base, name, value)
    return model


def _optimize_sentence_transformer(model, backend, dtype, strict):
    first = model[0] if len(model) else None
    hf = getattr(first, "auto_model", None)
    if hf is None or not hasattr(hf, "base_model"):
        reason = f"its first module is {type(first).__name__}, not a Transformer over a transformers model"
    elif getattr(model, "do_query_expansion", False) and getattr(model, "attend_to_expansion_tokens", None) is False:
        reason = ("a PyLate ColBERT reads the outputs of its query expansion, tokens no token attends to (attention "
                  "mask 0), and the engine computes no masked position: use bertfast.ColBERT.from_pylate(model)")
    else:
        try:
            optimize(hf, backend=backend, dtype=dtype, strict=strict)
            return model
        except (ConfigError, LoadError) as e:  # a family or config the engine does not serve
            reason = str(e)
    if strict:
        raise EngineUnsupported(f"bertfast cannot serve this SentenceTransformer: {reason}")
    warnings.warn(f"bertfast: cannot serve this SentenceTransformer ({reason}); it runs unchanged", stacklevel=3)
    return model


__all__ = ["optimize", "EngineUnsupported"]
