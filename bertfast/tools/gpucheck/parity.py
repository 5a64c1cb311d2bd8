"""The parity suite of `bertfast gpucheck`: every supported family against its own transformers model.

Each family gets one small random model of one shape (hidden 128, 2 heads of 64, FFN 256, 128 positions; norms and
biases moved off their init so a dropped bias shows) and two batches: a ragged one with two 1-token rows and rows at
and just below the position limit, and a single token. The oracle is transformers' fp32 eager model on the same
device with TF32 off. fp32 must be within FP32_LIMIT relative error over real positions (IEEE dot products); fp16
and bf16 within the one accuracy rule against transformers' own error in the same dtype (2x it plus a floor,
`accuracy.tolerance`). On CUDA the engine runs twice, replaying CUDA graphs (its default) and launching eagerly.
Batch invariance: rows of the ragged batch (a 1-token row, a middle one, the longest) run alone, and every row of it
inside a batch of LARGE_BATCH_ROWS rows (~4k tokens, the GEMMs' large tiles), must give, bit for bit, what they gave
inside the ragged batch (one "invariance" row per family, dtype and mode).
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import asdict, dataclass

import torch

from bertfast.encoder import Encoder
from bertfast.accuracy import rel_error, tolerance

FP32_LIMIT = 1e-5
HIDDEN, HEADS, INTERMEDIATE, LAYERS, VOCAB, POSITIONS = 128, 2, 256, 2, 1000, 128
_SHAPE = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_attention_heads=HEADS, intermediate_size=INTERMEDIATE,
              num_hidden_layers=LAYERS, max_position_embeddings=POSITIONS)
_BERTLIKE = dict(_SHAPE, type_vocab_size=2, layer_norm_eps=1e-12, hidden_act="gelu")

# model_type -> (transformers class prefix, config fields)
FAMILIES: dict[str, tuple[str, dict]] = {
    "bert": ("Bert", _BERTLIKE),
    "roberta": ("Roberta", dict(_BERTLIKE, type_vocab_size=1, pad_token_id=1)),
    "distilbert": ("DistilBert", dict(vocab_size=VOCAB, dim=HIDDEN, n_heads=HEADS, hidden_dim=INTERMEDIATE,
                                      n_layers=LAYERS, max_position_embeddings=POSITIONS)),
    "albert": ("Albert", dict(_BERTLIKE, embedding_size=64, num_hidden_groups=1, inner_group_num=1)),
    "electra": ("Electra", dict(_BERTLIKE, embedding_size=64)),
    "mpnet": ("MPNet", {k: v for k, v in _BERTLIKE.items() if k != "type_vocab_size"}),
    # 3 layers: global, local (window 16 each side), local
    "modernbert": ("ModernBert", dict(_SHAPE, num_hidden_layers=3, local_attention=32, pad_token_id=0, bos_token_id=1,
                                      eos_token_id=2, cls_token_id=1, sep_token_id=2)),
    "nomic_bert": ("NomicBert", dict(_SHAPE, layer_norm_eps=1e-5)),
    "gte": ("Gte", dict(_SHAPE)),
    # deberta-v3's layout (shared keys, LayerNorm'd relative embeddings, no absolute positions); 32 log buckets
    "deberta-v2": ("DebertaV2", dict(_SHAPE, relative_attention=True, pos_att_type="p2c|c2p", share_att_key=True,
                                     position_buckets=32, max_relative_positions=POSITIONS, norm_rel_ebd="layer_norm",
                                     position_biased_input=False, layer_norm_eps=1e-7)),
}
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


class FamilySkipped(Exception):
    """This transformers has no model class for the family; the message says which."""


@dataclass
class ParityRow:
    family: str
    dtype: str
    mode: str  # "graphs", "eager" (CUDA) or "default"
    batch: str  # the real lengths ("alone:<lengths>" for an invariance row)
    status: str  # "PASS" | "FAIL" | "SKIP"
    rel_err: float | None = None
    ref_rel_err: float | None = None  # transformers' own error in this dtype (0 in fp32: it is the oracle)
    tol: float | None = None
    pooler_rel_err: float | None = None
    pooler_ref_rel_err: float | None = None
    note: str = ""


def build_model(family: str, seed: int = 0):
    """transformers' `<Family>Model` of FAMILIES[family], random weights, fp32, eval, on CPU."""
    import transformers

    prefix, fields = FAMILIES[family]
    config_cls, model_cls = (getattr(transformers, prefix + s, None) for s in ("Config", "Model"))
    if config_cls is None or model_cls is None:
        raise FamilySkipped(f"transformers {transformers.__version__} has no {prefix}Model")
    torch.manual_seed(seed)
    model = model_cls(config_cls(**fields, attn_implementation="eager")).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name.lower() or name.endswith("bias"):
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
    return model


def batch_lengths(limit: int) -> list[list[int]]:
    """The batches of one family whose longest allowed row has `limit` tokens: ragged with two 1-token rows and
    rows at and just below the limit, then a single token alone."""
    return [[limit, 1, 57, limit - 3, 1, 9], [1]]


def make_inputs(model, lengths: list[int], seed: int = 1) -> tuple[dict, torch.Tensor]:
    """Right-padded inputs for `model` (ids never the pad id; token types where the model takes them) and the
    (B, S) mask, on the model's device."""
    cfg = model.config
    device = next(model.parameters()).device
    g = torch.Generator().manual_seed(seed)
    S = max(lengths)
    mask = (torch.arange(S)[None, :] < torch.tensor(lengths)[:, None]).long()
    pad = getattr(cfg, "pad_token_id", 0) or 0
    ids = torch.where(mask.bool(), torch.randint(3, cfg.vocab_size, (len(lengths), S), generator=g),
                      torch.full((len(lengths), S), pad))
    inputs = {"input_ids": ids.to(device), "attention_mask": mask.to(device)}
    takes_types = "token_type_ids" in inspect.signature(model.forward).parameters
    if (getattr(cfg, "type_vocab_size", 0) or 0) > 1 and takes_types:
        inputs["token_type_ids"] = (torch.randint(0, cfg.type_vocab_size, ids.shape, generator=g) * mask).to(device)
    return inputs, mask


def _outputs(model_or_encoder, inputs):
    with torch.inference_mode():
        out = model_or_encoder(**inputs)
    return out.last_hidden_state, getattr(out, "pooler_output", None)


def _judge(row: ParityRow, dtype, ours, ref_lowp, oracle, mask) -> ParityRow:
    """Fill `row`'s errors and status: fp32 against FP32_LIMIT, fp16/bf16 against 2x transformers' own error."""
    def limit(ref_err):
        return FP32_LIMIT if dtype == torch.float32 else tolerance(ref_err, dtype)

    row.rel_err = rel_error(ours[0], oracle[0], mask)
    row.ref_rel_err = rel_error(ref_lowp[0], oracle[0], mask)
    row.tol = limit(row.ref_rel_err)
    ok = row.rel_err <= row.tol  # False for NaN
    if (ours[1] is None) != (oracle[1] is None):
        ok, row.note = False, f"pooler_output is {'missing' if ours[1] is None else 'extra'}"
    elif oracle[1] is not None:
        row.pooler_rel_err = rel_error(ours[1], oracle[1])
        row.pooler_ref_rel_err = rel_error(ref_lowp[1], oracle[1])
        ok = ok and row.pooler_rel_err <= limit(row.pooler_ref_rel_err)
    row.status = "PASS" if ok else "FAIL"
    return row


INVARIANCE_ROWS = (1, 2, 0)  # of batch_lengths()[0]: a 1-token row, a middle one, the longest
LARGE_BATCH_ROWS = 64  # the ragged batch again inside this many rows (~4k tokens): the GEMMs' large-M tiles


def large_batch(model, inputs: dict, limit: int, seed: int = 7) -> dict:
    """`inputs` (the ragged batch, padded to `limit` columns) followed by random rows up to LARGE_BATCH_ROWS in all
    (lengths in [1, limit], one at the limit), so each GEMM runs at an M bucket several tile configs above the
    small batches'."""
    g = torch.Generator().manual_seed(seed)
    extra = [limit] + torch.randint(1, limit + 1, (LARGE_BATCH_ROWS - 1 - len(inputs["input_ids"]),),
                                    generator=g).tolist()
    more, _ = make_inputs(model, extra, seed=seed)
    return {k: torch.cat([v, more[k]]) for k, v in inputs.items()}


def _invariance(enc, inputs, batch_out, mask, large=None) -> tuple[bool, float, str]:
    """Each row of INVARIANCE_ROWS run alone against its slice of `batch_out`, and every row of the batch against
    its slice of the large batch `large` (when given: the batch's rows lead it): (all bit for bit, the largest
    difference, what differs)."""
    equal, worst, differing = True, 0.0, []

    def compare(a, b, what):
        nonlocal equal, worst
        if not torch.equal(a, b):
            equal = False
            differing.append(what)
            worst = max(worst, (a.double() - b.double()).abs().max().item())

    for i in INVARIANCE_ROWS:
        n = int(mask[i].sum())
        alone = _outputs(enc, {k: v[i:i + 1, :n] for k, v in inputs.items()})[0][0, :n]
        compare(alone, batch_out[i, :n], str(n))
    if large is not None:
        big = _outputs(enc, large)[0]
        for i, n in enumerate(mask.sum(1).tolist()):
            compare(big[i, :n], batch_out[i, :n], f"{n} (in {int(large['attention_mask'].sum())} tokens)")
    return equal, worst, ",".join(differing)


def run_parity(device: str = "cuda", backend: str = "triton", dtypes=("fp32", "fp16", "bf16"), families=None,
               progress=None) -> list[ParityRow]:
    """Every (family, dtype, mode, batch) as a ParityRow; progress(row) after each when given. A family this
    transformers lacks gives one SKIP row; an exception in the engine a FAIL row naming it."""
    if device.startswith("cuda"):  # the oracle computes in IEEE fp32
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    modes = {"graphs": None, "eager": False} if device.startswith("cuda") else {"default": None}
    rows: list[ParityRow] = []

    def add(row):
        rows.append(row)
        if progress is not None:
            progress(row)

    for family in families or FAMILIES:
        try:
            model = build_model(family).to(device)
        except FamilySkipped as e:
            add(ParityRow(family, "*", "*", "*", "SKIP", note=str(e)))
            continue
        limit = Encoder.from_hf(model, backend="torch").config.max_sequence_length
        batches = [make_inputs(model, lengths, seed=i + 1) for i, lengths in enumerate(batch_lengths(limit))]
        oracles = [_outputs(model, inputs) for inputs, _ in batches]
        for name in dtypes:
            dtype = DTYPES[name]
            hf_lowp = model if dtype == torch.float32 else copy.deepcopy(model).to(dtype)
            refs = [_outputs(hf_lowp, inputs) for inputs, _ in batches]
            for mode, graphs in modes.items():
                try:
                    enc = Encoder.from_hf(model, backend=backend, dtype=dtype, graphs=graphs)
                except Exception as e:
                    add(ParityRow(family, name, mode, "*", "FAIL", note=f"build: {type(e).__name__}: {e}"[:300]))
                    continue
                batch_out = None
                for (inputs, mask), oracle, ref in zip(batches, oracles, refs):
                    row = ParityRow(family, name, mode, "x".join(map(str, mask.sum(1).tolist())), "FAIL")
                    try:
                        ours = _outputs(enc, inputs)
                        batch_out = ours[0] if batch_out is None else batch_out
                        add(_judge(row, dtype, ours, ref, oracle, mask))
                    except Exception as e:
                        row.note = f"{type(e).__name__}: {e}"[:300]
                        add(row)
                inputs, mask = batches[0]
                lengths = mask.sum(1).tolist()
                row = ParityRow(family, name, mode, "alone:" + "x".join(str(lengths[i]) for i in INVARIANCE_ROWS)
                                + f"+in{LARGE_BATCH_ROWS}rows", "FAIL")
                try:
                    if batch_out is None:
                        raise RuntimeError("the batch itself failed")
                    equal, diff, differing = _invariance(enc, inputs, batch_out, mask,
                                                         large_batch(model, inputs, limit))
                    row.status = "PASS" if equal else "FAIL"
                    row.note = ("invariance: bit for bit" if equal else
                                f"invariance: rows of length {differing} differ alone (max |diff| {diff:.3g})")
                except Exception as e:
                    row.note = f"invariance: {type(e).__name__}: {e}"[:300]
                add(row)
            del hf_lowp
    return rows


def summarize(rows: list[ParityRow]) -> dict:
    """Counts, the failing rows, and the worst error per dtype (relative to its tolerance)."""
    counts = {s: sum(r.status == s for r in rows) for s in ("PASS", "FAIL", "SKIP")}
    worst = {}
    for r in rows:
        if r.rel_err is not None and r.tol:
            key = r.dtype
            if key not in worst or r.rel_err / r.tol > worst[key]["ratio"]:
                worst[key] = {"ratio": r.rel_err / r.tol, "family": r.family, "mode": r.mode, "rel_err": r.rel_err,
                              "tol": r.tol}
    return {"counts": counts, "failed": [asdict(r) for r in rows if r.status == "FAIL"], "worst_vs_tolerance": worst}
