"""`bertfast validate`: check a backend's ops, or a whole checkpoint, against the eager reference.

Every check builds three outputs from the same inputs: the backend's, `bertfast.reference` in the
same dtype, and `bertfast.reference` in fp64 on CPU (the oracle). Inputs and weights are rounded to
the run dtype first and the oracle computes on those rounded values, so every error measured is the
computation's own. Errors are normalised by the oracle's magnitude:

    rel = max |out - oracle| / max |oracle|

and a check passes when the backend's error is no worse than twice the same-dtype reference's error
plus a small floor, and within the per-dtype tolerance table wherever the reference itself is. A
backend only ever sees the `Backend` interface: weights go through `backend.prepare` first and the
ops receive the prepared tensors, exactly as the engine does.

Exit codes: 0 all checks passed (skips allowed), 1 some check failed, 2 bad usage (unknown or
unavailable backend, unreadable model, nothing left to check).
"""

from __future__ import annotations

import math
import sys
import zlib
from dataclasses import dataclass
from typing import Callable

import torch

from bertfast.backends.cpu import isa
from bertfast.engine import run_layer
from bertfast.tools.validate.accuracy import DTYPE_IDS, FLOOR, TABLE, Errors, Row, errors, judge, tolerance  # noqa: F401

DEFAULT_DTYPES = "fp32,fp16,bf16"
OP_NAMES = ("embed", "qkv", "attention", "linear_gelu", "linear_residual", "layernorm", "pooler", "layer")


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2e}"


def format_table(rows: list[Row]) -> str:
    head = ("op", "shape", "dtype", "max abs err", "max rel err", "ref rel err", "tolerance", "pass")
    body = [(r.op, r.shape, r.dtype, _fmt(r.abs_err), _fmt(r.rel_err), _fmt(r.ref_err), _fmt(r.tol),
             r.status + (f"  {r.note}" if r.note else "")) for r in rows]
    widths = [max(len(str(c[i])) for c in [head] + body) for i in range(len(head) - 1)]

    def line(cells):
        return "  ".join(str(c).ljust(w) for c, w in zip(cells[:-1], widths)) + "  " + cells[-1]

    out = [line(head), line(tuple("-" * w for w in widths) + ("-" * 4,))]
    out += [line(b) for b in body]
    return "\n".join(out)


def summary(rows: list[Row]) -> str:
    counts = {s: sum(r.status == s for r in rows) for s in ("PASS", "FAIL", "SKIP")}
    return f"{counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped"


# ----------------------------------------------------------------------------------------------
# Tiny random models: each op case draws its weights from one, so they can go through prepare().


def tiny_config(hidden, heads, intermediate=None, vocab=50, max_pos=64, act="gelu", eps=1e-12):
    from bertfast.config import ACTIVATIONS, ModelConfig

    hf_act = {v: k for k, v in reversed(list(ACTIVATIONS.items()))}[act]
    return ModelConfig(family="bert", hidden_size=hidden, num_attention_heads=heads,
                       num_hidden_layers=1, intermediate_size=intermediate or 2 * hidden,
                       activation=act, layer_norm_eps=eps, vocab_size=vocab,
                       max_position_embeddings=max_pos, type_vocab_size=2, pad_token_id=0,
                       hidden_act=hf_act)


def random_weights(config, gen: torch.Generator):
    """fp64 CPU ModelWeights for `config`; scales keep every activation O(1)."""
    from bertfast.backends.weights import EmbeddingWeights, LayerWeights, ModelWeights

    H, I = config.hidden_size, config.intermediate_size

    def n(*shape, std=1.0, mean=0.0):
        # Drawn in fp32 (twice as fast as fp64 draws); every value is then exact in fp64.
        return torch.randn(*shape, generator=gen).double() * std + mean

    emb = EmbeddingWeights(word=n(config.vocab_size, H),
                           position=n(config.max_position_embeddings, H, std=0.5),
                           token_type=n(config.type_vocab_size, H, std=0.5),
                           ln_weight=n(H, std=0.1, mean=1.0), ln_bias=n(H, std=0.1))
    layer = LayerWeights(
        qkv_weight=n(3 * H, H, std=H ** -0.5), qkv_bias=n(3 * H, std=0.1),
        attn_out_weight=n(H, H, std=H ** -0.5), attn_out_bias=n(H, std=0.1),
        attn_ln_weight=n(H, std=0.1, mean=1.0), attn_ln_bias=n(H, std=0.1),
        ffn_in_weight=n(I, H, std=H ** -0.5), ffn_in_bias=n(I, std=0.1),
        ffn_out_weight=n(H, I, std=I ** -0.5), ffn_out_bias=n(H, std=0.1),
        ffn_ln_weight=n(H, std=0.1, mean=1.0), ffn_ln_bias=n(H, std=0.1))
    return ModelWeights(config, emb, [layer], n(H, H, std=H ** -0.5), n(H, std=0.1))


# ----------------------------------------------------------------------------------------------
# The op sweep


@dataclass
class OpCase:
    """One op on one shape.

    make(gen, cast) -> inputs dict: draws fp64 values from `gen` and passes every float tensor
    through `cast` (rounding to the run dtype, moving to the device) before making any view, so
    non-contiguous layouts survive the cast. call(ops, weights, inputs) runs the op on `ops` (a
    backend or the reference module) with that ModelWeights' tensors.
    """

    op: str
    label: str
    config: object
    make: Callable
    call: Callable
    noncontig: bool = False
    quick: bool = False

    @property
    def seed(self) -> int:
        return zlib.crc32(f"{self.op}/{self.label}".encode())


def _lengths_to_cu(lengths):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return cu


def _embed_case(lengths, hidden, quick=False):
    # max_pos = the longest row, so the last position id sits at the table's limit.
    cfg = tiny_config(hidden, 1, vocab=97, max_pos=max(lengths))

    def make(gen, cast):
        T = sum(lengths)
        ids = torch.randint(0, cfg.vocab_size, (T,), generator=gen)
        ids[0], ids[-1] = 0, cfg.vocab_size - 1
        pos = torch.cat([torch.arange(n) for n in lengths])
        tt = torch.randint(0, cfg.type_vocab_size, (T,), generator=gen)
        dev = cast(torch.zeros(())).device
        return dict(ids=ids.to(dev), pos=pos.to(dev), tt=tt.to(dev))

    def call(ops, w, inp):
        return ops.embed(inp["ids"], inp["pos"], inp["tt"], w.embeddings, cfg.layer_norm_eps)

    label = f"lens{'-'.join(map(str, lengths))}-H{hidden}"
    return OpCase("embed", label, cfg, make, call, quick=quick)


def _x(gen, cast, T, K, noncontig, std=1.0, mean=0.0):
    """(T, K) activations; non-contiguous = a column slice of a wider buffer (row stride K + 16)."""
    width = K + 16 if noncontig else K
    base = cast(torch.randn(T, width, generator=gen, dtype=torch.float64) * std + mean)
    return base[:, :K] if noncontig else base


def _qkv_case(T, hidden, heads, noncontig=False, quick=False):
    cfg = tiny_config(hidden, heads)

    def make(gen, cast):
        return dict(x=_x(gen, cast, T, hidden, noncontig))

    def call(ops, w, inp):
        layer = w.layers[0]
        return tuple(ops.qkv(inp["x"], layer.qkv_weight, layer.qkv_bias, heads))

    label = f"T{T}-H{hidden}-h{heads}-d{hidden // heads}" + ("-strided" if noncontig else "")
    return OpCase("qkv", label, cfg, make, call, noncontig, quick)


def _attention_case(lengths, heads, head_dim, layout="contig", score_std=1.0, quick=False):
    """layout: 'contig' (T, heads, d) tensors, or 'qkv-views': q, k, v as the three slices of one
    (T, 3, heads, d) buffer, the layout a fused QKV projection naturally produces."""
    cfg = tiny_config(heads * head_dim, heads)
    cu = _lengths_to_cu(lengths)

    def make(gen, cast):
        T = cu[-1]
        dev = cast(torch.zeros(())).device
        # q is scaled so that scores q.k / sqrt(d) have std `score_std` (peaked softmax when large).
        if layout == "qkv-views":
            base = cast(torch.randn(T, 3, heads, head_dim, generator=gen, dtype=torch.float64)
                        * torch.tensor([score_std, 1.0, 1.0], dtype=torch.float64)[None, :, None, None])
            q, k, v = base[:, 0], base[:, 1], base[:, 2]
        else:
            q, k, v = (cast(torch.randn(T, heads, head_dim, generator=gen, dtype=torch.float64) * s)
                       for s in (score_std, 1.0, 1.0))
        return dict(q=q, k=k, v=v, cu_seqlens=torch.tensor(cu, dtype=torch.int32, device=dev),
                    max_seqlen=max(lengths))

    def call(ops, w, inp):
        return ops.attention(inp["q"], inp["k"], inp["v"], inp["cu_seqlens"], inp["max_seqlen"],
                             1.0 / math.sqrt(head_dim))

    label = f"cu{'-'.join(map(str, cu))}-h{heads}-d{head_dim}"
    if score_std != 1.0:
        label += f"-peaked{score_std:g}"
    if layout != "contig":
        label += "-" + layout
    return OpCase("attention", label, cfg, make, call, layout != "contig", quick)


def _linear_gelu_case(T, hidden, inter, act, noncontig=False, quick=False):
    cfg = tiny_config(hidden, 1, inter, act=act)

    def make(gen, cast):
        return dict(x=_x(gen, cast, T, hidden, noncontig))

    def call(ops, w, inp):
        layer = w.layers[0]
        return ops.linear(inp["x"], layer.ffn_in_weight, layer.ffn_in_bias, act)

    label = f"T{T}-K{hidden}-N{inter}-{act}" + ("-strided" if noncontig else "")
    return OpCase("linear_gelu", label, cfg, make, call, noncontig, quick)


def _linear_residual_case(T, hidden, inter, which, noncontig=False, quick=False):
    """which: 'attn_out' (K = N = hidden) or 'ffn_out' (K = inter, N = hidden)."""
    cfg = tiny_config(hidden, 1, inter)
    K = hidden if which == "attn_out" else inter

    def make(gen, cast):
        return dict(x=_x(gen, cast, T, K, noncontig), residual=_x(gen, cast, T, hidden, noncontig))

    def call(ops, w, inp):
        layer = w.layers[0]
        weight, bias = ((layer.attn_out_weight, layer.attn_out_bias) if which == "attn_out"
                        else (layer.ffn_out_weight, layer.ffn_out_bias))
        return ops.linear(inp["x"], weight, bias, "none", inp["residual"])

    label = f"T{T}-K{K}-N{hidden}-{which}" + ("-strided" if noncontig else "")
    return OpCase("linear_residual", label, cfg, make, call, noncontig, quick)


def _layernorm_case(T, hidden, offset=0.0, std=1.0, eps=1e-12, noncontig=False, quick=False):
    """offset: rows centred far from zero (a one-pass E[x^2] - E[x]^2 variance cancels there);
    std: small spreads make the result sensitive to using the right eps."""
    cfg = tiny_config(hidden, 1, eps=eps)

    def make(gen, cast):
        # Per-row offsets vary around `offset` so that no two rows share a mean.
        mean = offset + torch.randn(T, 1, generator=gen, dtype=torch.float64) * (0.1 * std)
        return dict(x=_x(gen, cast, T, hidden, noncontig, std=std, mean=mean))

    def call(ops, w, inp):
        layer = w.layers[0]
        return ops.layernorm(inp["x"], layer.attn_ln_weight, layer.attn_ln_bias, eps)

    label = f"T{T}-H{hidden}"
    if offset:
        label += f"-offset{offset:g}"
    if std != 1.0:
        label += f"-std{std:g}"
    label += f"-eps{eps:g}" + ("-strided" if noncontig else "")
    return OpCase("layernorm", label, cfg, make, call, noncontig, quick)


def _pooler_case(B, hidden, noncontig=False, quick=False):
    cfg = tiny_config(hidden, 1)

    def make(gen, cast):
        if noncontig:  # the CLS column of a padded (B, S, H) batch: row stride S * H
            return dict(cls=cast(torch.randn(B, 5, hidden, generator=gen, dtype=torch.float64))[:, 0])
        return dict(cls=cast(torch.randn(B, hidden, generator=gen, dtype=torch.float64)))

    def call(ops, w, inp):
        return ops.linear(inp["cls"], w.pooler_weight, w.pooler_bias, "tanh")

    label = f"B{B}-H{hidden}" + ("-strided" if noncontig else "")
    return OpCase("pooler", label, cfg, make, call, noncontig, quick)


def _layer_case(lengths, hidden, heads, inter, act="gelu", quick=False):
    """A whole encoder layer (the backend's `layer` op, which a backend may run in one piece) on a
    ragged batch."""
    cfg = tiny_config(hidden, heads, inter, act=act)
    cu = _lengths_to_cu(lengths)

    def make(gen, cast):
        dev = cast(torch.zeros(())).device
        return dict(x=_x(gen, cast, cu[-1], hidden, False),
                    cu_seqlens=torch.tensor(cu, dtype=torch.int32, device=dev), max_seqlen=max(lengths))

    def call(ops, w, inp):
        return run_layer(ops, inp["x"], w.layers[0], inp["cu_seqlens"], inp["max_seqlen"], heads,
                         1.0 / math.sqrt(hidden // heads), cfg.layer_norm_eps, act)

    label = f"cu{'-'.join(map(str, cu))}-H{hidden}-h{heads}-I{inter}-{act}"
    return OpCase("layer", label, cfg, make, call, quick=quick)


def op_cases(quick: bool = False) -> list[OpCase]:
    """The built-in sweep. `quick` keeps the cases marked quick: still every op and the awkward
    shapes (length 1, a non-block length, an odd head dim, ragged cu_seqlens with an empty row)."""
    cases = [
        _embed_case([1, 7, 65], 64, quick=True),
        _embed_case([129, 63], 80),
        _qkv_case(1, 64, 2, quick=True),
        _qkv_case(65, 312, 12),  # head dim 26
        _qkv_case(129, 80, 1),
        _qkv_case(7, 128, 1),
        _qkv_case(63, 64, 2, noncontig=True, quick=True),
        _attention_case([1, 16, 63, 1], 2, 32, quick=True),  # cu_seqlens [0, 1, 17, 80, 81]
        _attention_case([0, 1, 16, 0, 63, 1], 2, 64, layout="qkv-views", quick=True),  # empty rows
        _attention_case([7, 65], 2, 26, quick=True),
        _attention_case([63, 129], 1, 64),
        _attention_case([65], 1, 80),
        _attention_case([1, 7, 129], 1, 128),
        _attention_case([7, 65], 2, 32, score_std=8.0),
        _linear_residual_case(1, 64, 128, "attn_out", quick=True),
        _linear_residual_case(65, 80, 200, "ffn_out", quick=True),
        _linear_residual_case(129, 312, 1200, "ffn_out"),
        _linear_residual_case(63, 64, 128, "ffn_out", noncontig=True, quick=True),
        _layernorm_case(1, 64, quick=True),
        _layernorm_case(65, 384, offset=100.0, quick=True),
        _layernorm_case(129, 312, std=0.01, quick=True),
        _layernorm_case(7, 80, offset=10.0, std=0.1, eps=1e-5),
        _layernorm_case(63, 64, noncontig=True, quick=True),
        _pooler_case(1, 64, quick=True),
        _pooler_case(5, 80),
        _pooler_case(3, 64, noncontig=True, quick=True),
        _layer_case([1, 16, 0, 5], 64, 2, 128, quick=True),
        _layer_case([7, 65], 312, 12, 1200, "gelu_tanh"),  # head dim 26
        _layer_case([129], 160, 2, 320, "relu"),  # head dim 80
    ]
    for act in ("gelu", "gelu_tanh", "relu"):
        cases += [_linear_gelu_case(1, 64, 256, act, quick=act == "gelu"),
                  _linear_gelu_case(65, 80, 200, act, quick=True),
                  _linear_gelu_case(129, 312, 1200, act)]
    cases.append(_linear_gelu_case(63, 64, 256, "gelu", noncontig=True, quick=True))
    cases = [c for c in cases if c.quick] if quick else cases
    return sorted(cases, key=lambda c: OP_NAMES.index(c.op))


def _error_note(e: BaseException) -> str:
    msg = str(e).splitlines()[0] if str(e) else ""
    return f"{type(e).__name__}: {msg}"[:160]


def check_op_case(backend, case: OpCase, dtype: torch.dtype, device, master=None) -> Row:
    """Run one case in one dtype through `backend`, the reference in `dtype`, and fp64.

    master: the case's fp64 weights when the caller already drew them (they depend on the case only).
    """
    from bertfast.backends.torch import TorchBackend

    reference = TorchBackend()  # the oracle's ops behind the backend contract
    name = DTYPE_IDS[dtype]
    if master is None:
        master = random_weights(case.config, torch.Generator().manual_seed(case.seed))
    w_lowp = master.to(dtype=dtype, device=device)
    w_fp64 = w_lowp.to(dtype=torch.float64, device="cpu")

    def inputs(cast):
        return case.make(torch.Generator().manual_seed(case.seed + 1), cast)

    to_run = lambda t: t.to(dtype=dtype, device=device)  # noqa: E731
    to_oracle = lambda t: t.to(dtype=dtype).to(dtype=torch.float64, device="cpu")  # noqa: E731
    with torch.no_grad():
        oracle = case.call(reference, w_fp64, inputs(to_oracle))
        ref_lowp = case.call(reference, w_lowp, inputs(to_run))
        # Any exception is a failed check, reported in its row, not a crashed sweep.
        try:
            prepared = backend.prepare(w_lowp)
        except Exception as e:
            return Row(case.op, case.label, name, "FAIL", note=f"prepare: {_error_note(e)}")
        try:
            ours = case.call(backend, prepared, inputs(to_run))
        except ValueError as e:
            if case.noncontig:
                # A clear rejection of a strided input is allowed; a wrong answer is not.
                return Row(case.op, case.label, name, "SKIP", note=f"rejected: {_error_note(e)}")
            return Row(case.op, case.label, name, "FAIL", note=_error_note(e))
        except Exception as e:
            return Row(case.op, case.label, name, "FAIL", note=_error_note(e))
    return judge(case.op, case.label, dtype, ours, ref_lowp, oracle)


def dtype_skip_reason(backend, dtype, device="cpu") -> str | None:
    """Why `backend` does not run `dtype` on `device` at all, or None.

    Asks `check_dtype`, then `prepare` on an ordinary tiny model (hidden 64, 2 heads of 32): a
    backend may refuse a dtype only on some devices (the Triton interpreter has no bf16), and says
    so in prepare. A refusal there is a statement about the dtype; a refusal of a particular
    case's shapes later is a failure of that case.
    """
    try:
        backend.check_dtype(dtype)
        probe = random_weights(tiny_config(64, 2), torch.Generator().manual_seed(0))
        backend.prepare(probe.to(dtype=dtype, device=device))
    except ValueError as e:
        return str(e)
    return None


def run_op_sweep(backend, dtypes, device="cpu", quick=False, ops=None, progress=None) -> list[Row]:
    """All op cases for every dtype, ordered by dtype then op; a dtype the backend does not support
    gives one SKIP row. progress(row), if given, is called as each check finishes."""
    cases = [c for c in op_cases(quick) if ops is None or c.op in ops]
    runnable = []
    rows = []
    for dtype in dtypes:
        reason = dtype_skip_reason(backend, dtype, device)
        if reason is None:
            runnable.append(dtype)
        else:
            rows.append(Row("*", "*", DTYPE_IDS[dtype], "SKIP", note=reason))
    # Case-major, so that each case's weights are drawn once for all dtypes.
    for case in cases:
        master = random_weights(case.config, torch.Generator().manual_seed(case.seed))
        for dtype in runnable:
            row = check_op_case(backend, case, dtype, device, master)
            rows.append(row)
            if progress is not None:
                progress(row)
    order = {DTYPE_IDS[d]: i for i, d in enumerate(dtypes)}
    return sorted(rows, key=lambda r: order[r.dtype])  # stable: cases keep their order per dtype


# ----------------------------------------------------------------------------------------------
# The model check


SENTENCES = (
    "Hi.",
    "The quick brown fox jumps over the lazy dog.",
    "bertfast runs BERT-family encoders on packed tokens, so padding costs nothing.",
    "A sentence embedding model maps text to a vector; similar meanings land close together, "
    "which is what semantic search, clustering and deduplication rely on.",
    "Ok",
    "Validation compares every layer with a float64 oracle.",
)

RANDOM_LENGTHS = (1, 23, 7, 64, 2)


def model_batch(directory: str, config, seed: int = 0):
    """(input_ids, attention_mask, token_type_ids) (B, S) int64, ragged; and a label for the table.

    Real sentences through the directory's tokenizer (padded as it pads) when it has one; random
    ids, right padded, otherwise (a row of 64 tokens reaches the position limit of small models).
    """
    tokenizer = None
    try:
        from bertfast.tokenization import load_tokenizer

        tokenizer = load_tokenizer(directory, config.max_position_embeddings)
    except ImportError:
        pass
    if tokenizer is not None:
        enc = tokenizer.encode_batch(list(SENTENCES))
        ids = torch.tensor([e.ids for e in enc], dtype=torch.int64)
        mask = torch.tensor([e.attention_mask for e in enc], dtype=torch.int64)
        types = torch.tensor([e.type_ids for e in enc], dtype=torch.int64)
        if int(ids.max()) >= config.vocab_size:
            raise ValueError(f"the tokenizer in {directory} produces ids up to {int(ids.max())}, "
                             f"beyond the model's vocab_size {config.vocab_size}")
        return ids, mask, types.clamp_max(config.type_vocab_size - 1), "sentences"
    g = torch.Generator().manual_seed(seed)
    lengths = [min(n, config.max_position_embeddings) for n in RANDOM_LENGTHS]
    B, S = len(lengths), max(lengths)
    mask = (torch.arange(S)[None, :] < torch.tensor(lengths)[:, None]).long()
    ids = torch.randint(0, config.vocab_size, (B, S), generator=g) * mask
    types = torch.randint(0, config.type_vocab_size, (B, S), generator=g) * mask
    return ids, mask, types, "random-ids"


def run_model_check(backend, weights, directory: str, dtypes, device="cpu") -> list[Row]:
    """Each dtype: the backend's engine vs the reference forward, after the embeddings, after every
    layer (rows "layer1".."layerN" = hidden_states[1:]) and for the pooler, on real positions only.

    weights: the checkpoint's ModelWeights (any dtype; rounded to each run dtype, and the oracle
    runs in fp64 on those rounded weights).
    """
    from bertfast import reference
    from bertfast.engine import Engine

    ids, mask, types, what = model_batch(directory, weights.config)
    B, S = ids.shape
    shape = f"{what}-B{B}-S{S}-T{int(mask.sum())}"
    real = mask.bool()
    rows = []
    for dtype in dtypes:
        name = DTYPE_IDS[dtype]
        reason = dtype_skip_reason(backend, dtype, device)
        if reason is not None:
            rows.append(Row("model", shape, name, "SKIP", note=reason))
            continue
        w_lowp = weights.to(dtype=dtype, device=device)
        w_fp64 = w_lowp.to(dtype=torch.float64, device="cpu")
        on_dev = [t.to(device) for t in (ids, mask, types)]
        with torch.no_grad():
            _, pooled64, states64 = reference.forward(w_fp64, ids, mask, types, output_hidden_states=True)
            _, pooled_ref, states_ref = reference.forward(w_lowp, *on_dev, output_hidden_states=True)
            try:
                engine = Engine(w_lowp, backend)
                _, pooled, states = engine.forward(*on_dev, output_hidden_states=True)
            except Exception as e:
                rows.append(Row("model", shape, name, "FAIL", note=_error_note(e)))
                continue
        if states is None or len(states) != len(states64):
            got = "none" if states is None else len(states)
            rows.append(Row("model", shape, name, "FAIL",
                            note=f"engine returned {got} hidden states, expected {len(states64)}"))
            continue
        stages = ["embeddings"] + [f"layer{i + 1}" for i in range(len(states64) - 1)]
        for stage, ours, ref_t, orc in zip(stages, states, states_ref, states64):
            if tuple(ours.shape) != (B, S, weights.config.hidden_size):
                rows.append(Row(stage, shape, name, "FAIL", note=f"hidden state shape {tuple(ours.shape)}"))
                continue
            rows.append(judge(stage, shape, dtype, ours[real.to(ours.device)],
                              ref_t[real.to(ref_t.device)], orc[real]))
        if pooled64 is not None:
            if pooled is None:
                rows.append(Row("pooler", shape, name, "FAIL", note="engine returned no pooler output"))
            else:
                rows.append(judge("pooler", shape, dtype, pooled, pooled_ref, pooled64))
    return rows


# ----------------------------------------------------------------------------------------------
# Command


def add_arguments(parser) -> None:
    parser.add_argument("--backend", default="auto",
                        help="backend to check: triton, cpu, torch or auto (default: auto)")
    parser.add_argument("--dtype", default=DEFAULT_DTYPES,
                        help=f"comma-separated dtypes to check (default: {DEFAULT_DTYPES}; 'auto': the backend's "
                             "choice on this CPU tier or GPU); 'int8' alone, "
                             "with --model: the int8 accuracy report (per layer and sentence embeddings vs fp32)")
    parser.add_argument("--model", default=None, metavar="DIR",
                        help="check a whole checkpoint layer by layer instead of the op sweep "
                             "('default' = the embedded all-MiniLM-L6-v2)")
    parser.add_argument("--device", default=None,
                        help="device to run the backend on (default: cuda when available, else cpu)")
    parser.add_argument("--quick", action="store_true", help="a smaller op sweep (still every op)")
    parser.add_argument("--ops", default=None,
                        help=f"comma-separated subset of ops to sweep ({', '.join(OP_NAMES)})")
    parser.add_argument("-v", "--verbose", action="store_true", help="print each op check as it finishes")


def _usage_error(msg: str) -> int:
    print(f"bertfast validate: {msg}", file=sys.stderr)
    return 2


def parse_dtypes(text: str, backend=None, device: str = "cpu") -> list[torch.dtype]:
    """Comma-separated dtype names; "auto" is `backend`'s choice on `device` (Backend.precision)."""
    from bertfast.loading import resolve_dtype

    names = [s.strip() for s in text.split(",") if s.strip()]
    if not names:
        raise ValueError("--dtype is empty (expected e.g. fp32,fp16,bf16)")
    if "auto" in names and backend is None:
        raise ValueError("--dtype auto needs a backend to ask")
    auto = backend.precision(torch.device(device).type).auto if "auto" in names else None
    return list(dict.fromkeys(auto if n == "auto" else resolve_dtype(n) for n in names))


def run(args) -> int:
    from bertfast.backends import BackendUnavailable, get_backend

    if "int8" in [d.strip() for d in args.dtype.split(",")]:
        return run_int8(args)
    try:
        ops = None
        if args.ops:
            ops = [s.strip() for s in args.ops.split(",") if s.strip()]
            unknown = [o for o in ops if o not in OP_NAMES]
            if unknown:
                raise ValueError(f"unknown op(s) {', '.join(unknown)}; ops are {', '.join(OP_NAMES)}")
        if args.model is not None and (args.ops or args.quick):
            raise ValueError("--ops and --quick shape the op sweep; they do not apply with --model")
        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        torch.device(device)  # raises on a malformed device string
    except (ValueError, RuntimeError) as e:
        return _usage_error(str(e))
    try:
        backend = get_backend(args.backend, device)
        dtypes = parse_dtypes(args.dtype, backend, device)
    except (ValueError, BackendUnavailable) as e:
        return _usage_error(str(e))
    return run_with_backend(backend, args, dtypes=dtypes, device=device, ops=ops)


def run_with_backend(backend, args, dtypes=None, device="cpu", ops=None, out=None) -> int:
    """The command body for an already constructed backend (tests pass their own)."""
    out = out or sys.stdout
    dtypes = dtypes if dtypes is not None else parse_dtypes(getattr(args, "dtype", DEFAULT_DTYPES), backend, device)
    model = getattr(args, "model", None)
    weights = directory = None
    if model is not None:
        try:
            from bertfast.loading import load_pretrained

            directory = _model_dir(model)
            weights = load_pretrained(directory)
        except (ValueError, RuntimeError, OSError) as e:
            return _usage_error(str(e))
        what = (f"model {directory} ({weights.config.num_hidden_layers} layers, hidden "
                f"{weights.config.hidden_size}, {weights.config.num_attention_heads} heads)")
    else:
        what = "quick op sweep" if getattr(args, "quick", False) else "op sweep"
    dnames = ", ".join(DTYPE_IDS[d] for d in dtypes)
    print(f"bertfast validate: {what}, backend {backend.name!r} on {device}, dtypes {dnames}", file=out)
    if device == "cpu":
        print(isa.describe(), file=out)
    print("rel = max|out - fp64 oracle| / max|oracle|; ref = the reference's own rel error in the same "
          "dtype; tolerance = 2 * ref + floor, capped by the dtype table (fp32 1e-5, fp16 1e-2, "
          "bf16 2e-2) unless the reference itself is above it", file=out)
    if weights is None:
        def progress(r):
            print(f"  {r.op} {r.shape} {r.dtype}: {r.status}", file=out, flush=True)

        progress = progress if getattr(args, "verbose", False) else None
        rows = run_op_sweep(backend, dtypes, device, getattr(args, "quick", False), ops, progress)
    else:
        try:
            rows = run_model_check(backend, weights, directory, dtypes, device)
        except ValueError as e:  # e.g. a tokenizer whose ids do not fit the model
            return _usage_error(str(e))
    print(format_table(rows), file=out)
    print(summary(rows), file=out)
    if not any(r.status in ("PASS", "FAIL") for r in rows):
        print("bertfast validate: nothing was checked (every dtype or case was skipped)", file=out)
        return 2
    return 1 if any(r.status == "FAIL" for r in rows) else 0


def run_int8(args, out=None) -> int:
    """`--dtype int8 --model DIR`: the int8 accuracy report (bertfast.tools.validate.int8_report)."""
    from bertfast.tools.validate import int8_report as quant_report
    from bertfast.backends import BackendUnavailable, get_backend
    from bertfast.loading import load_pretrained

    out = out or sys.stdout
    if [d.strip() for d in args.dtype.split(",") if d.strip()] != ["int8"]:
        return _usage_error("--dtype int8 runs alone (it is compared with fp32 itself)")
    if args.model is None:
        return _usage_error("--dtype int8 needs --model DIR: the int8 report checks a whole checkpoint")
    if args.ops or args.quick:
        return _usage_error("--ops and --quick shape the op sweep; they do not apply with --model")
    device = args.device or "cpu"
    try:
        backend = get_backend(args.backend, device, quantize="int8")
        directory = _model_dir(args.model)
        weights = load_pretrained(directory, torch.float32)
    except (ValueError, BackendUnavailable, RuntimeError, OSError) as e:
        return _usage_error(str(e))
    print(f"bertfast validate: int8 report for model {directory}, backend {backend.name!r} on {device}; "
          "rel = max|out - fp64 oracle| / max|oracle| (oracle on the fp32 weights); ref = the fp32 "
          "reference's own rel error; a stage passes with min token cosine >= "
          f"{quant_report.LAYER_MIN_COSINE}", file=out)
    rows = quant_report.layer_rows(backend, weights, directory, device)
    print(format_table(rows), file=out)
    print(summary(rows), file=out)
    failed = any(r.status == "FAIL" for r in rows)
    rep = quant_report.sentence_report(directory, args.backend)
    if rep is None:
        print("sentence embeddings: skipped (the checkpoint has no tokenizer)", file=out)
    else:
        print(quant_report.format_sentence_report(rep), file=out)
        failed = failed or not rep["passed"]
    return 1 if failed else 0


def _model_dir(model: str) -> str:
    if model == "default":
        from bertfast import default_model_path

        return default_model_path()
    return model
