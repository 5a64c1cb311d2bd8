"""LoRA adapters in the forward (`Encoder.load_adapter`, `adapter_ids=`, `encode(adapter=)`), per row.

- fp32 within 1e-5 (relative) of PEFT's own unmerged PeftModel on ragged batches mixing three adapters and base rows
  (PEFT's mixed-batch `adapter_names`, "__base__" for base rows), padded positions excluded, on every family the
  forward adapts, on the cpu and torch backends; DeBERTa's adapted position projections against PEFT per adapter;
  bf16 no worse than twice PEFT's own bf16 error.
- Batch invariance bit for bit: a row alone equals the same row inside a mixed batch of 481 tokens (past every row
  count of the native GEMM choosers: 32/33 rows, the AMX blocked kernels at 64/128), in fp32, bf16 and int8 (int8
  base, adapter fp32), on the default tier, portable, avx2, avx512_vnni-nobf16 and amx_emulated; base rows of a
  mixed batch equal the forward without adapters (BERT: the native whole layer) bit for bit. The native linear's LoRA
  terms on every epilogue.
- BERT's adapted layers run whole (`_C.Layer`, each GEMM's terms inside it), bit for bit the layers composed from the
  ops, in every dtype and on every tier, a row alone as in the mixed batch (the layer itself: test_adapters_layer.py).
- The triton backend under the interpreter: its kernels' addend; the segmented shrink and expand kernels (SGMV) against
  fp64, bit for bit whatever the tiles, two launches per slot whatever the number of adapters; a mixed batch against
  PEFT.
- The errors: unknown names, a wrong adapter_ids length, a duplicate or bad name, unload of an unknown name, another
  family's adapter.
"""

from __future__ import annotations

import contextlib
import copy
import warnings

import pytest
import torch

from bertfast import Encoder
from bertfast.accuracy import within
from bertfast.adapters import UnknownAdapter
from bertfast.backends import available_backends
from bertfast.backends.cpu import isa as isa_module
from conftest import rel_err
from helpers import families
from helpers.adapters import (CASES, LONG_LENGTHS, LONG_ROWS, TIER_IDS, TIERS, native_layer_calls, peft_names,
                              save_lora)
from helpers.caps import on_cap

CPU_REASON = available_backends("cpu").get("cpu")
needs_cpu = pytest.mark.skipif(CPU_REASON is not None, reason=f"backend 'cpu' unavailable: {CPU_REASON}")

NAMES = ("a", "b", "c")
LENGTHS = [7, 1, 12, 5, 9, 3, 11]
ROW_ADAPTERS = ["a", None, "b", "c", "a", None, "b"]
# DeBERTa-v2 without its query / key projections (whose factors also adapt the position projections: refused).
TARGETS = {**{f: t for f, (_, t) in CASES.items()}, "deberta-v2": ["value_proj", "dense"]}
FORWARD_FAMILIES = ["bert", "roberta", "distilbert", "modernbert", "albert", "mpnet", "electra", "deberta-v2",
                    "nomic_bert", "gte"]


def _peft_with_adapters(model, tmp_path, targets):
    """PeftModel with three random adapters of different ranks ("default", "b", "c") and their directories."""
    paths = [tmp_path / n for n in NAMES]
    pm = save_lora(model, paths[0], seed=0, r=4, lora_alpha=6, target_modules=targets)
    for i, (name, path) in enumerate(zip(NAMES[1:], paths[1:]), start=1):
        save_lora(model, path, seed=i, r=2 + i, lora_alpha=5, use_rslora=i == 2, target_modules=targets)
        pm.load_adapter(path, adapter_name=name)
    return pm.eval(), paths


def _batch(model, lengths, seed=1):
    return families.batch_for(model, lengths, seed=seed)


def _encoder(model, paths, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # bf16 measured slower on some tiers
        enc = Encoder.from_hf(model, **kw)
    for name, path in zip(NAMES, paths):
        enc.load_adapter(name, path)
    return enc


@pytest.fixture(scope="module")
def peft_models(tmp_path_factory):
    """family -> (transformers model, PeftModel with three adapters, their directories), built once."""
    built = {}

    def get(family):
        if family not in built:
            model = CASES[family][0]()
            built[family] = (model, *_peft_with_adapters(model, tmp_path_factory.mktemp(family), TARGETS[family]))
        return built[family]
    return get


def _backends():
    return [pytest.param(b, marks=needs_cpu) if b == "cpu" else b for b in ("cpu", "torch")]


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("family", FORWARD_FAMILIES)
def test_fp32_matches_peft_mixed_batch(family, backend, peft_models):
    model, pm, paths = peft_models(family)
    kwargs, mask = _batch(model, LENGTHS)
    with torch.no_grad():
        ref = pm(**kwargs, adapter_names=peft_names(ROW_ADAPTERS))
        base = model(**kwargs)
    enc = _encoder(model, paths, backend=backend, dtype=torch.float32)
    out = enc(**kwargs, adapter_ids=ROW_ADAPTERS)
    assert rel_err(out.last_hidden_state, ref.last_hidden_state, mask) <= 1e-5
    assert rel_err(out.last_hidden_state, base.last_hidden_state, mask) > 1e-2  # the adapters do change the rows
    if getattr(ref, "pooler_output", None) is not None and out.pooler_output is not None:
        assert rel_err(out.pooler_output, ref.pooler_output) <= 1e-5


@needs_cpu
@pytest.mark.parametrize("family", ["bert", "modernbert"])
def test_bf16_within_twice_peft_bf16(family, peft_models):
    model, pm, paths = peft_models(family)
    kwargs, mask = _batch(model, LENGTHS)
    names = peft_names(ROW_ADAPTERS)
    with torch.no_grad():
        ref = pm(**kwargs, adapter_names=names).last_hidden_state
        low = copy.deepcopy(pm).to(torch.bfloat16)(**kwargs, adapter_names=names).last_hidden_state
    out = _encoder(model, paths, backend="cpu", dtype=torch.bfloat16)(**kwargs, adapter_ids=ROW_ADAPTERS)
    ours, theirs = rel_err(out.last_hidden_state, ref, mask), rel_err(low, ref, mask)
    assert within(ours, theirs, torch.bfloat16, floor=0.0, cap=False), f"bf16 {ours:.3g} vs PEFT bf16 {theirs:.3g}"



@needs_cpu
@pytest.mark.parametrize("tier", TIERS, ids=TIER_IDS)
@pytest.mark.parametrize("family, dtype", [
    pytest.param("bert", torch.float32, id="bert-fp32"), pytest.param("bert", torch.bfloat16, id="bert-bf16"),
    pytest.param("bert", "int8", id="bert-int8"), pytest.param("modernbert", torch.float32, id="modernbert-fp32"),
    pytest.param("modernbert", torch.bfloat16, id="modernbert-bf16"),  # rotary, gated FFN: qkv's and ffn_in's addend
    pytest.param("deberta-v3", torch.float32, id="deberta-v3-fp32"),  # per-row position terms (shared keys)
    pytest.param("deberta-v3", torch.bfloat16, id="deberta-v3-bf16")])
def test_row_alone_equals_row_in_mixed_batch(family, dtype, tier, peft_models):
    if tier is not None and isa_module.unsupported(tier) is not None:
        pytest.skip(isa_module.unsupported(tier))
    model, _, paths = peft_models(family)
    kwargs, mask = _batch(model, LONG_LENGTHS, seed=3)
    lengths = mask.sum(1).tolist()
    assert int(mask.sum()) > 256
    with on_cap(tier) if tier else contextlib.nullcontext():
        enc = _encoder(model, paths, backend="cpu", dtype=dtype)
        together = enc(**kwargs, adapter_ids=LONG_ROWS).last_hidden_state
        plain = enc(**kwargs).last_hidden_state
        for b, n in enumerate(lengths):
            row = {k: v[b:b + 1, :n] for k, v in kwargs.items() if k != "attention_mask"}
            alone = enc(**row, adapter_ids=[LONG_ROWS[b]]).last_hidden_state[0]
            assert torch.equal(alone, together[b, :n]), f"row {b} ({n} tokens, {LONG_ROWS[b]}) differs alone"
            if LONG_ROWS[b] is None:  # a base row: the bits of the forward without adapters (whole layers)
                assert torch.equal(together[b, :n], plain[b, :n]), f"base row {b} differs from the plain forward"
            else:
                assert not torch.equal(together[b, :n], plain[b, :n])


@needs_cpu
@pytest.mark.parametrize("tier", TIERS, ids=TIER_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, "int8"], ids=["fp32", "bf16", "int8"])
def test_adapted_bert_layers_run_whole(dtype, tier, peft_models):
    """A BERT forward with adapters runs each layer whole (`_C.Layer`, handed each GEMM's `_C.LoraSlot`): the same
    bits as its layers composed from the ops (int8: the layers' carried codes too), and a row alone the same bits as
    in the mixed batch of 481 tokens."""
    if tier is not None and isa_module.unsupported(tier) is not None:
        pytest.skip(isa_module.unsupported(tier))
    model, _, paths = peft_models("bert")
    kwargs, mask = _batch(model, LONG_LENGTHS, seed=3)
    with on_cap(tier) if tier else contextlib.nullcontext():
        enc = _encoder(model, paths, backend="cpu", dtype=dtype)
        backend, layers = enc.engine.backend, model.config.num_hidden_layers
        b = LONG_ROWS.index("c")
        n = int(mask[b].sum())
        with native_layer_calls(backend) as calls:
            whole = enc(**kwargs, adapter_ids=LONG_ROWS).last_hidden_state
            row = {k: v[b:b + 1, :n] for k, v in kwargs.items() if k != "attention_mask"}
            alone = enc(**row, adapter_ids=["c"]).last_hidden_state[0]
        assert len(calls) == 2 * layers and all(c is not None and len(c) == 4 for c in calls)
        backend.whole_layer = lambda x, layer, lora=None: None  # the layers composed from the ops
        try:
            composed = enc(**kwargs, adapter_ids=LONG_ROWS).last_hidden_state
        finally:
            del backend.whole_layer
        plain = enc(**kwargs).last_hidden_state
    assert torch.equal(whole, composed)
    assert torch.equal(alone, whole[b, :n])
    assert not torch.equal(whole[b, :n], plain[b, :n])


@needs_cpu
@pytest.mark.parametrize("M", [5, 300], ids=["M5-stream", "M300-blocked"])
@pytest.mark.parametrize("segments, N", [(1, 70), (3, 96)], ids=["one-run", "three-runs"])
def test_lora_terms_same_bits_in_every_epilogue(segments, N, M):
    """The LoRA term a row gets is the same bits in every epilogue form, dtype and tier (lora.h: four fma chains in
    a fixed order, ((d_0 + d_1) + (d_2 + d_3))): with zero weights each output is bias + term, so the fp32, bf16 and
    int8 linears (int8: runs of rows on one factor sharing B^T loads; fp32: a row at a time) on every tier must agree
    bit for bit. Runs of 7 rows per factor (2 at M 5), base rows between, ranks 4, 6 and 21 (k past the last four)."""
    from bertfast.backends.cpu import linear as cpu_linear, quant
    from bertfast.backends.cpu.backend import CpuBackend
    g = torch.Generator().manual_seed(0)
    K = 40
    x, bias = torch.randn(M, K, generator=g), torch.randn(N, generator=g).bfloat16().float()
    backend = CpuBackend()
    factors = []
    for r in (4, 6, 21):
        A, B = torch.randn(segments * r, K, generator=g) * 0.1, torch.zeros(N, segments * r)
        for s in range(segments):
            B[s * N // segments:(s + 1) * N // segments, s * r:(s + 1) * r] = torch.randn(N // segments, r, generator=g)
        factors.append(backend.pack_lora(A, B, segments))
    run = 2 if M < 20 else 7
    index = (torch.arange(M, dtype=torch.int32) // run + 1) % 4 - 1
    groups = [(i, (index == i).nonzero().flatten()) for i in range(len(factors))]
    outs = {}
    for tier in TIERS:
        if tier is not None and isa_module.unsupported(tier) is not None:
            continue
        with on_cap(tier) if tier else contextlib.nullcontext():
            term = backend.lora(x, index, factors, groups)
            outs[f"{tier} fp32"] = cpu_linear.linear(x, cpu_linear.PackedLinear(torch.zeros(N, K)), bias, "none",
                                                     None, term)
            zero16 = cpu_linear.PackedLinear(torch.zeros(N, K).bfloat16())
            outs[f"{tier} bf16"] = cpu_linear.linear(x.bfloat16(), zero16, bias.bfloat16(), "none", None, term)
            outs[f"{tier} int8"] = quant.linear(x, quant.QuantLinear.from_float(torch.zeros(N, K)), bias, "none",
                                                None, term)
    first = next(iter(outs.values()))
    assert first[index >= 0].abs().max() > 0 and torch.equal(first[index < 0], bias.expand(M, N)[index < 0])
    differ = [name for name, out in outs.items() if not torch.equal(out, first.to(out.dtype))]  # bf16: rounded once
    assert not differ, differ


@needs_cpu
@pytest.mark.parametrize("tier", TIERS, ids=TIER_IDS)
@pytest.mark.parametrize("act", ["none", "gelu", "relu", "gelu_tanh"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, "int8"], ids=["fp32", "bf16", "int8"])
@pytest.mark.parametrize("M", [5, 300], ids=["M5-stream", "M300-blocked"])
@pytest.mark.parametrize("segments, N", [(1, 70), (3, 96)], ids=["one-run", "three-runs"])
def test_linear_lora_term_before_activation(segments, N, M, dtype, act, tier):
    """The cpu backend's linear with LoRA terms (`Backend.lora`: the shrink now, B in the epilogue):
    act(x W^T + b + (x A_f^T) B_f^T) + residual for each row's factor f (none for base rows), fp32 whatever the
    operands' dtype; B block-diagonal over three runs of outputs (as q | k | v) or one; a row's bits are its own
    (M-invariant). Every epilogue: streaming and blocked, the 16-lane and the generic activations, the int8 kernels
    of each tier."""
    if tier is not None and isa_module.unsupported(tier) is not None:
        pytest.skip(isa_module.unsupported(tier))
    with on_cap(tier) if tier else contextlib.nullcontext():
        _check_linear_lora(segments, N, M, dtype, act)


def _check_linear_lora(segments, N, M, dtype, act):
    from bertfast.backends.cpu import linear as cpu_linear, quant
    from bertfast.backends.cpu.backend import CpuBackend
    from bertfast.kernels import activation
    g = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(*shape, generator=g) for shape in ((M, 40), (N, 40), (N,)))
    res = torch.randn(M, N, generator=g)
    pairs = []
    for r in (4, 8, 20):  # ranks under, at and past the shrink's 16 lanes
        A = torch.randn(segments * r, 40, generator=g) * 0.1
        B = torch.zeros(N, segments * r)
        for s in range(segments):  # each run of outputs reads its own r ranks
            B[s * N // segments:(s + 1) * N // segments, s * r:(s + 1) * r] = torch.randn(N // segments, r, generator=g)
        pairs.append((A, B))
    backend = CpuBackend()
    factors = [backend.pack_lora(A, B, segments) for A, B in pairs] + [None]  # the last adapter leaves the slot
    index = torch.randint(-1, len(factors), (M,), generator=g, dtype=torch.int32)
    groups = [(i, (index == i).nonzero().flatten()) for i in range(len(factors))]

    def run(rows):
        term = backend.lora(x[rows], index[rows], factors, groups)
        if dtype == "int8":
            return quant.linear(x[rows], quant.QuantLinear.from_float(w), b, act, res[rows], term)
        return cpu_linear.linear(x[rows], cpu_linear.PackedLinear(w.to(dtype)), b.to(dtype), act, res[rows], term)

    ours = run(slice(None))
    if dtype == "int8":
        ref = quant.linear_reference(x, quant.QuantLinear.from_float(w), b, "none", None, torch.float64)
    else:
        ref = x.to(dtype).double() @ w.to(dtype).double().T + b.to(dtype).double()
    delta = torch.zeros(M, N, dtype=torch.float64)
    for i, (A, B) in enumerate(pairs):
        rows = index == i
        delta[rows] = (x[rows].double() @ A.double().T) @ B.double().T
    ref = activation.apply(ref + delta, act) + res.double()
    assert ours.dtype == torch.float32
    tol = 1e-5 if dtype == torch.float32 else 2e-2 if dtype == torch.bfloat16 else 1e-5
    assert rel_err(ours, ref) <= tol
    assert torch.equal(run(slice(0, 3)), ours[:3])


@needs_cpu
def test_encode_per_text_adapters(tiny_text_model, tmp_path):
    """encode(adapter=...): one name for all texts, or one per text; a text's vector is its own adapter's, bit for
    bit whatever the other texts."""
    import transformers
    save_lora(transformers.BertModel.from_pretrained(tiny_text_model), tmp_path / "q", r=4, lora_alpha=8,
              target_modules=["query", "value", "dense"])
    enc = Encoder.from_pretrained(tiny_text_model, backend="cpu", dtype=torch.float32)
    enc.load_adapter("q", tmp_path / "q")
    texts = ["a first text", "another, rather longer text of a few more words", "short"]
    base, tuned = enc.encode(texts), enc.encode(texts, adapter="q")
    mixed = enc.encode(texts, adapter=["q", None, "q"], batch_size=2)
    assert torch.equal(mixed[1], base[1]) and torch.equal(mixed[0], tuned[0]) and torch.equal(mixed[2], tuned[2])
    threaded = enc.encode(texts, adapter=["q", None, "q"], batch_size=1, workers=2)  # batches on two threads
    assert torch.equal(threaded, mixed)
    assert not torch.allclose(base[0], tuned[0], atol=1e-3)
    with pytest.raises(KeyError, match="no adapter named 'nope'"):
        enc.encode(texts, adapter="nope")
    with pytest.raises(ValueError, match="2 entries for 3 rows"):
        enc.encode(texts, adapter=["q", None])


@needs_cpu
def test_errors(peft_models, tmp_path):
    model, _, paths = peft_models("bert")
    kwargs, _ = _batch(model, [3, 5])
    enc = _encoder(model, paths[:1], backend="cpu", dtype=torch.float32)
    assert enc.adapters == ["a"]
    with pytest.raises(ValueError, match="already loaded"):
        enc.load_adapter("a", paths[1])
    for bad in ("", "x:y", None):
        with pytest.raises(ValueError, match="non-empty string without ':'"):
            enc.load_adapter(bad, paths[1])
    with pytest.raises(UnknownAdapter, match="no adapter named 'b' is loaded"):
        enc(**kwargs, adapter_ids=["a", "b"])
    with pytest.raises(ValueError, match="3 entries for 2 rows"):
        enc(**kwargs, adapter_ids=["a", None, None])
    with pytest.raises(ValueError, match="one adapter name or None per row"):
        enc(**kwargs, adapter_ids="a")
    with pytest.raises(KeyError, match="no adapter named 'zz'"):
        enc.unload_adapter("zz")
    enc.unload_adapter("a")
    assert enc.adapters == []
    with pytest.raises(KeyError, match="no adapter named 'a'"):
        enc(**kwargs, adapter_ids=["a", None])
    other = families.build("distilbert")  # another family's adapter on this base
    save_lora(other, tmp_path / "other", r=2, lora_alpha=2, target_modules=["q_lin"])
    from bertfast.loading import LoadError
    with pytest.raises(LoadError):
        enc.load_adapter("o", tmp_path / "other")
    assert enc.adapters == []


@needs_cpu
@pytest.mark.parametrize("case", ["deberta-v2", "deberta-v3"])
def test_deberta_position_projections_match_peft(case, tmp_path):
    """DeBERTa-v2's own pos_key_proj / pos_query_proj adapted (v2), and v3's shared key / query projections (whose
    factors adapt the position terms too): each row's c2p / p2c terms from its adapter's tables. PEFT's mixed batch
    cannot split the relative embeddings by row, so the reference is PEFT per adapter on the whole batch."""
    build, targets = CASES[case]
    model = build()
    pm, paths = _peft_with_adapters(model, tmp_path, targets)
    kwargs, mask = _batch(model, LENGTHS)
    ref = torch.zeros_like(model(**kwargs).last_hidden_state)
    with torch.no_grad():
        for name, peft_name in zip(NAMES, ("default", "b", "c")):
            pm.set_adapter(peft_name)
            rows = [i for i, a in enumerate(ROW_ADAPTERS) if a == name]
            ref[rows] = pm(**kwargs).last_hidden_state[rows]
        with pm.disable_adapter():
            rows = [i for i, a in enumerate(ROW_ADAPTERS) if a is None]
            ref[rows] = pm(**kwargs).last_hidden_state[rows]
    enc = _encoder(model, paths, backend="cpu", dtype=torch.float32)
    assert any(s.startswith("pos_") for s in enc._adapters["a"].layers[0])
    out = enc(**kwargs, adapter_ids=ROW_ADAPTERS).last_hidden_state
    assert rel_err(out, ref, mask) <= 1e-5


TRITON_REASON = available_backends("cpu").get("triton")
needs_triton = pytest.mark.skipif(TRITON_REASON is not None, reason=f"backend 'triton' unavailable: {TRITON_REASON}")


@needs_triton
@pytest.mark.parametrize("rotary", [False, True], ids=["plain", "rotary"])
def test_triton_kernels_add_the_addend_before_activation(rotary):
    """The Triton kernels' addend (`_gemm_epilogue`, the gated and rotary kernels' own epilogues) under the
    interpreter: act(x W^T + b + addend) + residual, the gate's halves each with theirs, q and k rotated after it."""
    from bertfast import reference
    from bertfast.backends.contract import Rotary
    from bertfast.kernels.triton import linear as tlinear, qkv as tqkv
    g = torch.Generator().manual_seed(0)
    T, H, heads = 9, 32, 2
    x, w, b = torch.randn(T, H, generator=g), torch.randn(3 * H, H, generator=g), torch.randn(3 * H, generator=g)
    addend, res = torch.randn(T, 3 * H + 5, generator=g)[:, 2:3 * H + 2], torch.randn(T, 3 * H, generator=g)
    pre = x.double() @ w.double().T + b.double() + addend.double()
    if not rotary:
        ours = tlinear.linear(x, w, b, "gelu", res, addend=addend)
        assert rel_err(ours, torch.nn.functional.gelu(pre) + res.double()) <= 1e-5
        gated = tlinear.linear_gated(x, w[:2 * H], b[:2 * H], "silu", addend=addend[:, :2 * H].contiguous())
        a_half, b_half = pre[:, :H], pre[:, H:2 * H]
        assert rel_err(gated, torch.nn.functional.silu(a_half) * b_half) <= 1e-5
    angles = torch.rand(T, H // heads // 2, generator=g) * 3
    rot = Rotary(angles.cos(), angles.sin()) if rotary else None
    q, k, v = tqkv.qkv(x, w, b, heads, rotary=rot, addend=addend)
    rq, rk, rv = reference.qkv(x.double(), w.double(), b.double(), heads,
                               None if rot is None else Rotary(rot.cos.double(), rot.sin.double()))
    d = pre - (x.double() @ w.double().T + b.double())  # the addend alone, through the same split and rotation
    dq, dk, dv = d.view(T, 3, heads, -1).unbind(1)
    if rot is not None:
        dq, dk = reference.rotate(dq, Rotary(rot.cos.double(), rot.sin.double())), reference.rotate(
            dk, Rotary(rot.cos.double(), rot.sin.double()))
    for ours, ref in ((q, rq + dq), (k, rk + dk), (v, rv + dv)):
        assert rel_err(ours, ref) <= 1e-5


@needs_triton
@pytest.mark.parametrize("family", ["bert", "modernbert", "electra"])
def test_triton_backend_matches_peft(family, peft_models):
    """The triton backend (under the interpreter here): fp32 within 1e-5 of PEFT's mixed batch, and a row alone
    equals the same row in the batch, bit for bit."""
    model, pm, paths = peft_models(family)
    lengths = [5, 1, 7, 3]
    kwargs, mask = _batch(model, lengths)
    names = ["a", None, "b", "c"]
    with torch.no_grad():
        ref = pm(**kwargs, adapter_names=peft_names(names)).last_hidden_state
    enc = _encoder(model, paths, backend="triton", dtype=torch.float32)
    out = enc(**kwargs, adapter_ids=names).last_hidden_state
    assert rel_err(out, ref, mask) <= 1e-5
    row = {k: v[2:3, :7] for k, v in kwargs.items() if k != "attention_mask"}
    assert torch.equal(enc(**row, adapter_ids=["b"]).last_hidden_state[0], out[2, :7])


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_triton_segmented_lora_kernels(dtype):
    """The shrink and expand kernels (`kernels.triton.lora`) through the backend's `lora`: each row's (x A^T) B^T of
    its own adapter within 1e-5 of fp64 (ranks 4, 20, 7 padded to 16s; an adapter without the slot; base rows zero),
    runs longer than a tile (32 rows) and cut at every offset; a run alone gets the bits it has in the batch, and
    the pooler's batch rows (an index tensor) the bits of the same tokens."""
    from bertfast.backends.cuda.triton import TritonBackend
    from bertfast.kernels.triton import lora as tlora
    backend = TritonBackend()
    g = torch.Generator().manual_seed(0)
    T, K, N = 101, 48, 96
    x = torch.randn(T, K, generator=g).to(dtype)
    pairs = [(torch.randn(r, K, generator=g), torch.randn(N, r, generator=g)) for r in (4, 20, 7)]
    factors = [backend.pack_lora(A, B, 3) for A, B in pairs] + [None]
    spans = [(0, slice(0, 5)), (1, slice(9, 75)), (2, slice(75, 76)), (0, slice(76, 90)), (3, slice(90, 95))]
    out = backend.lora(x, None, factors, spans)
    ref = torch.zeros(T, N, dtype=torch.float64)
    for p, rows in spans:
        if factors[p] is not None:
            A, B = pairs[p]
            ref[rows] = (x[rows].double() @ A.double().T) @ B.double().T
    assert out.dtype == torch.float32 and out.shape == (T, N)
    assert rel_err(out, ref) <= 1e-5
    assert torch.equal(out[5:9], torch.zeros(4, N)) and torch.equal(out[95:], torch.zeros(T - 95, N))
    for start in (9, 10, 40, 41, 43):  # the run from each offset: another cut into tiles, the same bits
        alone = backend.lora(x[start:75], None, factors, [(1, slice(0, 75 - start))])
        assert torch.equal(alone, out[start:75])
    pooled = backend.lora(x[:12], None, factors, [(1, torch.tensor([10, 2])), (0, torch.tensor([4]))])
    assert torch.equal(pooled[10], out[10]) and torch.equal(pooled[4], out[4])
    assert torch.equal(pooled[[0, 1, 3, 5, 6, 7, 8, 9, 11]], torch.zeros(9, N))
    with pytest.raises(ValueError, match="pointer table"):
        tlora.lora_terms(x, tlora.tiles([(0, 0, T)], x.device), tlora.table(factors[:1]), factors, N)


@needs_triton
def test_triton_lora_launches_do_not_grow_with_adapters(peft_models):
    """A forward mixing three adapters and base rows launches the same kernels as one whose rows all use one adapter:
    per adapted slot one shrink and one expand, whatever the number of adapters (SGMV)."""
    from bertfast.tools.launches import count_launches
    model, _, paths = peft_models("bert")
    enc = _encoder(model, paths, backend="triton", dtype=torch.float32)
    lengths = [5, 1, 7, 3, 4]
    kwargs, _ = _batch(model, lengths)
    layers = model.config.num_hidden_layers
    counts = []
    for names in (["a", None, "b", "c", "b"], ["a"] * 5):
        enc(**kwargs, adapter_ids=names)  # tables built once per forward and adapter set
        with torch.inference_mode(), count_launches() as launches:
            enc(**kwargs, adapter_ids=names)
        counts.append(launches)
    mixed, single = counts
    assert mixed.triton["_shrink_kernel"] == mixed.triton["_expand_kernel"] == 4 * layers + 1  # + the pooler
    assert mixed.triton == single.triton, (mixed.summary(), single.summary())
