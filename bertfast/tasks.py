"""The task-head table: every head transformers offers for the supported families, as data.

Per family and task (`HEADS`): per output field, which encoder output it reads (the pooler, token 0, each
row's first real token, the mean over its real tokens, or every real token; or one of these chosen by a config
field) and a short list of steps (linear by tensor name, activation, LayerNorm, tied decoder; a bias may be
absent where a config flag says so) that spell out the transformers forward pass in eval mode. `heads`
resolves a row against a checkpoint.
"""

from __future__ import annotations

from .kernels.activation import HF_NAMES
from .loading import LoadError


# ------------------------------------------------------------------------------------------------
# The table. Sources: what a head reads from the encoder.
POOLER = "pooler"  # pooler_output (B, H): tanh(dense(token 0)), computed by the engine
FIRST = "first"  # last_hidden_state[:, 0] (B, H)
TOKENS = "tokens"  # last_hidden_state at every real token (T, H)
FIRST_REAL = "first_real"  # each row's first real token (B, H): argmax of the mask, as ModernBERT's multiple choice
MEAN = "mean"  # the mean of last_hidden_state over each row's real tokens (B, H)


def by_config(field, default, choices):
    """A source chosen by config field `field` (`default` when absent): choices maps its values to sources."""
    return ("by_config", field, default, choices)


# Steps. Dimensions are symbols resolved from config.json: "H" hidden_size, "E" embedding_size,
# "L" num_labels, "V" vocab_size, or a literal int. A step's `bias` is True (always there) or a `flag`.
def flag(field, default):
    """The module has a bias iff config field `field` (`default` when absent) is true (ModernBERT's
    classifier_bias, norm_bias, decoder_bias)."""
    return ("flag", field, default)


# A module name may be a tuple of spellings: transformers' module, then the name checkpoint files use for it.
def lin(name, out="H", inp="H", bias=True):
    """nn.Linear `name` (`name.weight` [out, inp], `name.bias` [out] where it has one)."""
    return ("linear", name, out, inp, bias)


def act(kind):
    """Activation: "hidden_act" (the layers'), a config field in CONFIG_ACTIVATIONS, or a fixed name."""
    return ("act", kind)


def ln(name, dim="H", bias=True):
    """nn.LayerNorm `name` over `dim` (`name.bias` where it has one), eps = config.layer_norm_eps."""
    return ("layernorm", name, dim, bias)


def decoder(weight, biases, inp="H", bias=True):
    """Vocabulary projection [V, inp]. With tie_word_embeddings (the default) the weight is the word
    embedding matrix and `weight` is ignored, as transformers does; the bias is the first present of
    `biases` (transformers aliases the decoder's bias to the first). Untied: `weight` and the decoder's
    own bias (the last of `biases`) come first."""
    return ("decoder", weight, tuple(biases), inp, bias)


def choose(field, default, choices):
    """Steps chosen by config field `field` (`default` when absent): choices maps its values to step lists
    (DeBERTa's `legacy` MLM head)."""
    return ("choose", field, default, choices)


SQUEEZE = ("squeeze",)  # drop the trailing size-1 dim (ELECTRA discriminator: [T, 1] -> [T])
ELECTRA_SUMMARY = ("electra_summary",)  # ElectraSequenceSummary: expanded from the config at load

BERT_MLM = [lin("cls.predictions.transform.dense"), act("hidden_act"), ln("cls.predictions.transform.LayerNorm"),
            decoder("cls.predictions.decoder.weight", ["cls.predictions.bias", "cls.predictions.decoder.bias"])]
ALBERT_MLM = [lin("predictions.dense", "E"), act("hidden_act"), ln("predictions.LayerNorm", "E"),
              decoder("predictions.decoder.weight", ["predictions.bias", "predictions.decoder.bias"], "E")]
ROBERTA = {
    "SequenceClassification": {"logits": (FIRST, [lin("classifier.dense"), act("tanh"),
                                                  lin("classifier.out_proj", "L")])},
    "TokenClassification": {"logits": (TOKENS, [lin("classifier", "L")])},
    "QuestionAnswering": {"logits": (TOKENS, [lin("qa_outputs", "L")])},
    "MultipleChoice": {"logits": (POOLER, [lin("classifier", 1)])},
    "MaskedLM": {"logits": (TOKENS, [lin("lm_head.dense"), act("gelu"), ln("lm_head.layer_norm"),
                                     decoder("lm_head.decoder.weight", ["lm_head.bias", "lm_head.decoder.bias"])])},
}

# ModernBertPredictionHead: dense -> classifier_activation -> LayerNorm, under every ModernBERT task head.
MODERN = [lin("head.dense", bias=flag("classifier_bias", False)), act("classifier_activation"),
          ln("head.norm", bias=flag("norm_bias", False))]
MODERN_POOLING = {"cls": FIRST, "mean": MEAN}  # config field classifier_pooling, default "cls"
# NomicBERT and GTE: pooler + classifier, per-token classifier (the same modules under the same names).
ROTARY_CLASSIFIERS = {
    "SequenceClassification": {"logits": (POOLER, [lin("classifier", "L")])},
    "TokenClassification": {"logits": (TOKENS, [lin("classifier", "L")])},
}

# family -> task -> {output field: (source, steps)}; the task is the class name after "<Family>For".
HEADS = {
    "bert": {
        "SequenceClassification": {"logits": (POOLER, [lin("classifier", "L")])},
        "TokenClassification": {"logits": (TOKENS, [lin("classifier", "L")])},
        "QuestionAnswering": {"logits": (TOKENS, [lin("qa_outputs", "L")])},
        "MultipleChoice": {"logits": (POOLER, [lin("classifier", 1)])},
        "MaskedLM": {"logits": (TOKENS, BERT_MLM)},
        "NextSentencePrediction": {"logits": (POOLER, [lin("cls.seq_relationship", 2)])},
        "PreTraining": {"prediction_logits": (TOKENS, BERT_MLM),
                        "seq_relationship_logits": (POOLER, [lin("cls.seq_relationship", 2)])},
    },
    "roberta": ROBERTA,
    "xlm-roberta": ROBERTA,
    "mpnet": ROBERTA,  # the same modules under the same names (MPNetClassificationHead, MPNetLMHead)
    "electra": {
        "SequenceClassification": {"logits": (FIRST, [lin("classifier.dense"), act("gelu"),
                                                      lin("classifier.out_proj", "L")])},
        "TokenClassification": {"logits": (TOKENS, [lin("classifier", "L")])},
        "QuestionAnswering": {"logits": (TOKENS, [lin("qa_outputs", "L")])},
        "MultipleChoice": {"logits": (FIRST, [ELECTRA_SUMMARY, lin("classifier", 1)])},
        "MaskedLM": {"logits": (TOKENS, [lin("generator_predictions.dense", "E"), act("gelu"),
                                         ln("generator_predictions.LayerNorm", "E"),
                                         decoder("generator_lm_head.weight", ["generator_lm_head.bias"], "E")])},
        "PreTraining": {"logits": (TOKENS, [lin("discriminator_predictions.dense"), act("hidden_act"),
                                            lin("discriminator_predictions.dense_prediction", 1), SQUEEZE])},
    },
    "albert": {
        "SequenceClassification": {"logits": (POOLER, [lin("classifier", "L")])},
        "TokenClassification": {"logits": (TOKENS, [lin("classifier", "L")])},
        "QuestionAnswering": {"logits": (TOKENS, [lin("qa_outputs", "L")])},
        "MultipleChoice": {"logits": (POOLER, [lin("classifier", 1)])},
        "MaskedLM": {"logits": (TOKENS, ALBERT_MLM)},
        "PreTraining": {"prediction_logits": (TOKENS, ALBERT_MLM),
                        "sop_logits": (POOLER, [lin("sop_classifier.classifier", "L")])},
    },
    "distilbert": {
        "SequenceClassification": {"logits": (FIRST, [lin("pre_classifier"), act("relu"), lin("classifier", "L")])},
        "TokenClassification": {"logits": (TOKENS, [lin("classifier", "L")])},
        "QuestionAnswering": {"logits": (TOKENS, [lin("qa_outputs", "L")])},
        "MultipleChoice": {"logits": (FIRST, [lin("pre_classifier"), act("relu"), lin("classifier", 1)])},
        "MaskedLM": {"logits": (TOKENS, [lin("vocab_transform"), act("hidden_act"), ln("vocab_layer_norm"),
                                         decoder("vocab_projector.weight", ["vocab_projector.bias"])])},
    },
    "modernbert": {
        "SequenceClassification": {"logits": (by_config("classifier_pooling", "cls", MODERN_POOLING),
                                              MODERN + [lin("classifier", "L")])},
        "TokenClassification": {"logits": (TOKENS, MODERN + [lin("classifier", "L")])},
        "QuestionAnswering": {"logits": (TOKENS, MODERN + [lin("classifier", "L")])},
        # "cls" here is each row's first real token (transformers takes the mask's argmax), not position 0
        "MultipleChoice": {"logits": (by_config("classifier_pooling", "cls", {**MODERN_POOLING, "cls": FIRST_REAL}),
                                      MODERN + [lin("classifier", 1)])},
        "MaskedLM": {"logits": (TOKENS, MODERN + [decoder("decoder.weight", ["decoder.bias"],
                                                          bias=flag("decoder_bias", True))])},
    },
    "nomic_bert": {
        **ROTARY_CLASSIFIERS,
        "MaskedLM": {"logits": (TOKENS, [lin("cls.predictions.transform.dense"), act("hidden_act"),
                                         ln("cls.predictions.transform.layer_norm"),
                                         decoder("cls.predictions.decoder.weight",
                                                 ["cls.predictions.bias", "cls.predictions.decoder.bias"])])},
    },
    "gte": {
        **ROTARY_CLASSIFIERS,
        "MaskedLM": {"logits": (TOKENS, [lin("lm_head.dense"), act("gelu"), ln(("lm_head.layer_norm", "lm_head.norm")),
                                         decoder("lm_head.decoder.weight", ["lm_head.decoder.bias"])])},
    },
}
# DeBERTa-v2: ContextPooler (token 0 -> dense -> pooler_hidden_act) under the sequence-level heads; the MLM head
# is BERT's (legacy, the default) or DebertaV2LMPredictionHead (legacy false: its own names, the word embeddings).
DEBERTA_POOLER = [lin("pooler.dense"), act("pooler_hidden_act")]
HEADS["deberta-v2"] = {
    "SequenceClassification": {"logits": (FIRST, DEBERTA_POOLER + [lin("classifier", "L")])},
    "TokenClassification": {"logits": (TOKENS, [lin("classifier", "L")])},
    "QuestionAnswering": {"logits": (TOKENS, [lin("qa_outputs", "L")])},
    "MultipleChoice": {"logits": (FIRST, DEBERTA_POOLER + [lin("classifier", 1)])},
    "MaskedLM": {"logits": (TOKENS, [choose("legacy", True, {
        True: BERT_MLM,
        False: [lin("lm_predictions.lm_head.dense"), act("hidden_act"), ln("lm_predictions.lm_head.LayerNorm"),
                decoder("lm_predictions.lm_head.decoder.weight", ["lm_predictions.lm_head.bias"])]})])},
}
# Class-name prefix of each family in transformers (`BertForMaskedLM`, `XLMRobertaModel`, ...).
CLASS_PREFIX = {"bert": "Bert", "roberta": "Roberta", "xlm-roberta": "XLMRoberta", "electra": "Electra",
                "albert": "Albert", "distilbert": "DistilBert", "mpnet": "MPNet", "modernbert": "ModernBert",
                "nomic_bert": "NomicBert", "gte": "Gte", "deberta-v2": "DebertaV2"}

# Activations a head may name: the layer's, plus tanh and identity (ELECTRA summary).
HEAD_ACTIVATIONS = {**HF_NAMES, "gelu_tanh": "gelu_tanh", "tanh": "tanh", "linear": None}
# Config fields that name a head's activation, with transformers' defaults.
CONFIG_ACTIVATIONS = {"summary_activation": "gelu", "classifier_activation": "gelu", "pooler_hidden_act": "gelu"}


def supported_architectures(family: str | None = None) -> list[str]:
    """Supported transformers class names (all families, or one): base models and task models."""
    families = [family] if family else list(HEADS)
    return [CLASS_PREFIX[f] + name for f in families
            for name in ["Model"] + [f"For{task}" for task in HEADS[f]]]


def source_of(source, d: dict, family: str, task: str) -> str:
    """A table source; one chosen by a config field (`by_config`) is looked up in the config dict `d`."""
    if not isinstance(source, tuple):
        return source
    _, field, default, choices = source
    value = d.get(field) or default
    if value not in choices:
        raise LoadError(f"{family} {task}: config field {field!r} = {value!r} is not supported "
                        f"(supported: {', '.join(map(repr, choices))})")
    return choices[value]


def reads_first_token(family: str, arch: str, d: dict) -> bool:
    """Whether the head of architecture `arch` (a class name; unknown ones: False) reads position 0 itself
    (RoBERTa-style classifiers, ModernBERT's "cls" pooling); config dict `d`."""
    try:
        task = task_of(family, arch)
    except LoadError:
        return False
    return task is not None and any(source_of(source, d, family, task) == FIRST
                                    for source, _ in HEADS[family][task].values())


def task_of(family: str, arch: str) -> str | None:
    """'BertForMaskedLM' -> 'MaskedLM'; the base model -> None; anything else raises LoadError."""
    prefix = CLASS_PREFIX[family]
    if arch == prefix + "Model":
        return None
    task = arch[len(prefix) + 3:] if arch.startswith(prefix + "For") else None
    if task not in HEADS[family]:
        raise LoadError(
            f"architecture {arch!r} is not supported for model_type {family!r} "
            f"(supported: {', '.join(supported_architectures(family))})"
        )
    return task
