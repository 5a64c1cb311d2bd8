"""The int8 accuracy report behind `bertfast validate --model DIR --dtype int8`: the int8 engine vs
fp32, layer by layer (`layer_rows`: min token cosine per stage, errors vs the fp64 oracle beside the fp32
reference's own) and on sentence embeddings of the fixed `sentences` set (`sentence_report`: cosine and
top-1 neighbour agreement), against the targets below; why these checks and targets:
docs/int8.md#accuracy-report.
"""

from __future__ import annotations

import torch

from bertfast.accuracy import Row, errors
from bertfast.tools.validate.model_check import model_batch
from bertfast.tools.validate.sentences import sentences as fixed_sentences

# Acceptance targets (issue 8): sentence-level on real text, and a floor per layer and token.
SENTENCE_MEAN_COSINE = 0.995
SENTENCE_MIN_COSINE = 0.98
NEIGHBOUR_AGREEMENT = 0.95
LAYER_MIN_COSINE = 0.98


def _min_cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=-1).min())


def layer_rows(backend, weights, directory: str, device="cpu"):
    """A Row per stage (embeddings, layer1..N, pooler) of the int8 engine vs the fp64 oracle."""
    from bertfast import reference
    from bertfast.engine import Engine

    ids, mask, types, what = model_batch(directory, weights.config)
    B, S = ids.shape
    shape = f"{what}-B{B}-S{S}-T{int(mask.sum())}"
    real = mask.bool()
    w32 = weights.to(dtype=torch.float32, device=device)
    w64 = w32.to(dtype=torch.float64, device="cpu")
    on_dev = [t.to(device) for t in (ids, mask, types)]
    with torch.no_grad():
        _, pooled64, states64 = reference.forward(w64, ids, mask, types, output_hidden_states=True)
        _, pooled32, states32 = reference.forward(w32, *on_dev, output_hidden_states=True)
        _, pooled, states = Engine(w32, backend).forward(*on_dev, output_hidden_states=True)
    stages = ["embeddings"] + [f"layer{i + 1}" for i in range(len(states64) - 1)]
    rows = []
    triples = [(st, o[real.to(o.device)].cpu(), r[real.to(r.device)].cpu(), orc[real])
               for st, o, r, orc in zip(stages, states, states32, states64)]
    if pooled64 is not None and pooled is not None:
        triples.append(("pooler", pooled.cpu(), pooled32.cpu(), pooled64))
    for stage, ours, ref32, orc in triples:
        cos = _min_cos(ours, orc)
        ok = cos >= LAYER_MIN_COSINE
        e = errors(ours, orc)
        rows.append(Row(stage, shape, "int8", "PASS" if ok else "FAIL", e.abs_err, e.rel_err,
                        errors(ref32, orc).rel_err, None, f"min token cos {cos:.5f}"))
    return rows


def sentence_report(directory: str, backend: str = "auto", sentences=None) -> dict | None:
    """Cosine of int8 vs fp32 sentence embeddings over `sentences` (default: the fixed set), and
    top-1 neighbour agreement. None when the checkpoint has no tokenizer."""
    from bertfast.encoder import Encoder

    texts = list(sentences) if sentences is not None else fixed_sentences()
    fp32 = Encoder.from_pretrained(directory, backend="torch", dtype=torch.float32)
    try:
        fp32.tokenizer
    except ValueError:
        return None
    int8 = Encoder.from_pretrained(directory, backend=backend, dtype="int8")
    rep = compare_embeddings(fp32.encode(texts, normalize=True), int8.encode(texts, normalize=True), texts)
    return {**rep, "backend": int8.backend}


def compare_embeddings(fp32: torch.Tensor, int8: torch.Tensor, texts) -> dict:
    """The sentence figures and verdict for L2-normalised embeddings (N, H) of the same `texts`: cosine
    of int8 vs fp32 per sentence (mean, min, the worst sentence) and top-1 neighbour agreement."""
    a, b = fp32.double(), int8.double()
    cos = (a * b).sum(dim=1)

    def top1(e):
        sim = e @ e.t()
        sim.fill_diagonal_(-2.0)
        return sim.argmax(dim=1)

    agree = float((top1(a) == top1(b)).double().mean())
    worst = int(cos.argmin())
    return {"n": len(texts), "mean_cosine": float(cos.mean()), "min_cosine": float(cos.min()),
            "worst_sentence": texts[worst], "neighbour_agreement": agree,
            "passed": bool(cos.mean() >= SENTENCE_MEAN_COSINE and cos.min() >= SENTENCE_MIN_COSINE
                           and agree >= NEIGHBOUR_AGREEMENT)}


def format_sentence_report(rep: dict) -> str:
    verdict = "PASS" if rep["passed"] else "FAIL"
    return (f"sentence embeddings ({rep['n']} sentences, mean pooling, int8 on backend {rep['backend']!r} vs "
            f"fp32 reference): cosine mean {rep['mean_cosine']:.5f} (target >= {SENTENCE_MEAN_COSINE}), "
            f"min {rep['min_cosine']:.5f} (>= {SENTENCE_MIN_COSINE}; worst: {rep['worst_sentence']!r}), "
            f"top-1 neighbour agreement {100 * rep['neighbour_agreement']:.1f}% "
            f"(>= {100 * NEIGHBOUR_AGREEMENT:.0f}%): {verdict}")


__all__ = ["layer_rows", "sentence_report", "compare_embeddings", "format_sentence_report", "SENTENCE_MEAN_COSINE",
           "SENTENCE_MIN_COSINE", "NEIGHBOUR_AGREEMENT", "LAYER_MIN_COSINE"]
