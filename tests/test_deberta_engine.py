"""DeBERTa-v2/v3 on the engine's backends against transformers and the oracle's ops.

The native ops on every ISA tier: the per-token position terms (`_C.position_scores`, a row's terms the same bits
whatever the batch) and the varlen attention adding c2p + p2c per (query, key) from them, against the reference ops
(fp32, bf16; both terms, one term; positions offset as columns are); their input checks. The encoder on the cpu
backend (every tier) and on triton (interpreter) against transformers' DebertaV2Model on ragged batches with a
1-token row and rows past the bucket horizon: v2 and v3 styles, one-term configs, 256 buckets with a 300-token
row, left padding and holes; bf16 within twice transformers' own bf16 error (32-wide heads: the position scores
on AMX tiles too); batch invariance (every family on every tier and dtype, int8 included: test_tiers.py; on triton,
the position-terms kernel and the encoder here).
`bertfast validate --model` on saved checkpoints: fp32 and bf16 stage by stage (cpu, torch), the int8 report (cpu).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from bertfast import Encoder, disentangled, reference
from bertfast.accuracy import TABLE, within
from bertfast.backends import DisentangledBias, available_backends
from bertfast.config import ModelConfig
from conftest import rel_err
from helpers.deberta import batch, build, save_tokenizer

CPU_REASON = available_backends("cpu").get("cpu")
needs_cpu = pytest.mark.skipif(CPU_REASON is not None, reason=f"backend 'cpu' unavailable: {CPU_REASON}")
TRITON_REASON = available_backends("cpu").get("triton")
needs_triton = pytest.mark.skipif(TRITON_REASON is not None, reason=f"backend 'triton' unavailable: {TRITON_REASON}")
DTYPES = [torch.float32, torch.bfloat16]


def _hf(model, ids, mask, types=None, dtype=torch.float32):
    kwargs = {} if types is None else dict(token_type_ids=types)
    with torch.no_grad():
        return copy.deepcopy(model).to(dtype)(ids, attention_mask=mask, **kwargs).last_hidden_state.float()


def _ours(model, ids, mask, types=None, **kw):
    kwargs = {} if types is None else dict(token_type_ids=types)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # bf16 slower than fp32 on some tiers
        enc = Encoder.from_hf(model, **kw)
    return enc(ids, attention_mask=mask, **kwargs).last_hidden_state.float()


def _terms(lengths, heads, d, rows, seed, dtype):
    """Random q, k (views of one fused (T, 3, heads, d) output), position projections (rows, heads * d), cu_seqlens
    and positions (each row's columns start at an offset, as after left padding)."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(sum(lengths), 3, heads, d, generator=g).to(dtype)
    pos = [torch.randn(rows, heads * d, generator=g).to(dtype) for _ in range(2)]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    positions = torch.cat([torch.arange(n) + i % 4 for i, n in enumerate(lengths)]).to(torch.int32)
    return qkv, pos, cu, positions


# --- the native ops on every tier ----------------------------------------------------------------------------------

# (lengths, head dim, table rows, slices run alone): rows not a multiple of the 16 lanes with an odd head dim; then
# the AVX-512 kernel's blocks crossed: 6-token register blocks, 192-token work chunks, 64-column chunks (130 rows).
POSITION_SCORE_CASES = [([300, 1, 77], 40, 37, ((300, 301), (0, 1), (150, 250))),
                        ([200, 3, 190], 64, 130, ((0, 1), (5, 11), (185, 200), (191, 193), (192, 390), (392, 393)))]


@needs_cpu
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("lengths,d,rows,alone", POSITION_SCORE_CASES, ids=["small", "blocks"])
def test_native_position_scores(isa, dtype, lengths, d, rows, alone):
    from bertfast import _C

    heads = 3
    qkv, (pos, _), _, _ = _terms(lengths, heads, d, rows, 0, dtype)
    q = qkv[:, 0]
    ours = _C.position_scores(q, pos, 0.125)
    expected, _ = disentangled.tables(q.double(), q.double(), pos.double(), None, 0.125)
    assert ours.dtype == torch.float32 and ours.shape == (q.shape[0], heads, rows)
    assert rel_err(ours, expected) <= (TABLE[torch.float32])
    for lo, hi in alone:  # a token's terms alone equal its terms inside the batch
        assert torch.equal(_C.position_scores(q[lo:hi], pos, 0.125), ours[lo:hi])


def vdpbf16ps_model(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x (M, K) bf16 times w (N, K) bf16 transposed, K even, as VDPBF16PS accumulates in the Intel SDM: per pair of K
    in order, the odd product then the even added to the fp32 accumulator, each add rounded once (a product of two
    bf16 is exact in fp32); denormal inputs read as zero."""
    tiny = torch.finfo(torch.float32).tiny
    a, b = (torch.where(t.float().abs() < tiny, 0.0, t.float()) for t in (x, w))
    acc = torch.zeros(x.shape[0], w.shape[0])
    for p in range(0, x.shape[1], 2):
        acc = acc + a[:, p + 1, None] * b[None, :, p + 1]
        acc = acc + a[:, p, None] * b[None, :, p]
    return acc


@needs_cpu
def test_native_position_scores_on_vdpbf16ps():
    """bf16 position scores on AVX-512 BF16 off the tiles (Zen 4/5's avx512_vnni tier; an amx tier's head dims that
    are not a multiple of 32): the SDM model's bits, so vdpbf16ps and not the widened fp32 blocks ran them, across
    6-token blocks, 192-token chunks and 64-column chunks; within the fp32 tolerance of the fp64 tables."""
    from bertfast import _C

    lengths, heads, d, rows = [200, 3, 190], 3, 40, 130
    path = _C.testing.position_scores_path("bfloat16", d, _C.isa(), _C.has_avx512_bf16())
    if path != "Avx512Bf16":  # no AVX-512 BF16, or a cap below avx512_vnni (the rule: test_choosers.py)
        pytest.skip(f"bf16 position scores take {path} on tier {_C.isa()} here")
    qkv, (pos, _), _, _ = _terms(lengths, heads, d, rows, 3, torch.bfloat16)
    q = qkv[:, 0]
    ours = _C.position_scores(q, pos, 0.125)
    model = torch.stack([vdpbf16ps_model(q[:, h], pos.view(rows, heads, d)[:, h]) for h in range(heads)], 1)
    assert torch.equal(ours, model * 0.125)
    expected, _ = disentangled.tables(q.double(), q.double(), pos.double(), None, 0.125)
    assert rel_err(ours, expected) <= TABLE[torch.float32]


def _index_and_positions(lengths, width, buckets, max_relative, holes=False):
    """A DistanceIndex over `width` columns (log buckets past buckets / 2), cu_seqlens and each row's columns:
    consecutive from an offset (left padding), or with holes (every fifth column skipped)."""
    cfg = ModelConfig.from_dict(dict(model_type="deberta-v2", hidden_size=8, num_attention_heads=1,
                                     num_hidden_layers=1, intermediate_size=8, vocab_size=8, relative_attention=True,
                                     pos_att_type=["c2p", "p2c"], position_buckets=buckets,
                                     max_relative_positions=max_relative))
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    rows = []
    for i, n in enumerate(lengths):
        cols = torch.arange(width)
        if holes:
            cols = cols[cols % 5 != 3]
        rows.append(cols[i % 3:i % 3 + n])
    positions = torch.cat(rows).to(torch.int32)
    assert int(positions.max()) < width
    return disentangled.distance_index(cfg, width), cu, positions, cfg


# (lengths, padded width, holes): full rows crossing the log-bucket horizon (distances past 8 share columns), left
# padding offsets, a 1-token row, masks with holes.
WINDOW_CASES = [([100, 1, 37, 64], 104, False), ([70, 2, 33], 90, True)]


@needs_cpu
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("lengths,width,holes", WINDOW_CASES, ids=["offsets", "holes"])
def test_native_position_scores_windows(isa, dtype, lengths, width, holes):
    """With `token_windows`, each token's entries inside its windows are the full table's, bit for bit, and the
    attention on the windowed tables (everything outside the windows NaN) is the attention on the full tables, bit
    for bit: no read outside a window, and the 16-lane tiles (affine ones) add what the scalar loop adds."""
    from bertfast import _C

    heads, d = 2, 24
    index, cu, positions, cfg = _index_and_positions(lengths, width, 16, 64, holes)
    rows = index.hi - index.lo
    qkv, (pk, pq), _, _ = _terms(lengths, heads, d, rows, 1, dtype)
    q, k, v = (qkv[:, i] for i in range(3))
    scale = cfg.attention_scale
    windows = disentangled.token_windows(index, positions, cu)
    full = [_C.position_scores(x, p, scale) for x, p in ((q, pk), (k, pq))]
    gaps = []
    for table, win, x, p in zip(full, windows, (q, k), (pk, pq)):
        inside = torch.arange(rows)[None, :]
        inside = (inside >= win[:, :1]) & (inside < win[:, 1:])  # (T, rows)
        assert inside.sum(1).max() < rows  # the windows leave columns out
        ours = _C.position_scores(x, p, scale, win)
        assert torch.equal(ours.transpose(1, 2)[inside], table.transpose(1, 2)[inside])
        gaps.append(table.masked_fill(~inside[:, None, :], float("nan")))
    kw = dict(rel_index=index.index, bias_positions=positions)
    expected = _C.attention(q, k, v, cu, max(lengths), scale, c2p=full[0], p2c=full[1], **kw)
    ours = _C.attention(q, k, v, cu, max(lengths), scale, c2p=gaps[0], p2c=gaps[1], **kw)
    assert not ours.isnan().any() and torch.equal(ours, expected)


@needs_cpu
def test_native_position_scores_window_errors():
    from bertfast import _C

    q, pos = torch.randn(3, 2, 16), torch.randn(6, 32)
    with pytest.raises(ValueError, match=r"windows must be \(tokens = 3, 2\) int32"):
        _C.position_scores(q, pos, 0.5, torch.zeros(3, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"windows\[1\] must be columns lo <= hi in \[0, rows = 6\]"):
        _C.position_scores(q, pos, 0.5, torch.tensor([[0, 6], [2, 7], [0, 0]], dtype=torch.int32))


ATTN_CASES = [([1], 32, ("c2p", "p2c")), ([129, 1, 70], 32, ("c2p", "p2c")), ([65, 17], 64, ("c2p",)),
              ([40, 3], 80, ("p2c",)), ([33, 8], 20, ("c2p", "p2c"))]


@needs_cpu
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("lengths, d, terms", ATTN_CASES,
                         ids=[f"L{'-'.join(map(str, c[0]))}-D{c[1]}-{'+'.join(c[2])}" for c in ATTN_CASES])
def test_native_attention_disentangled(isa, dtype, lengths, d, terms):
    from bertfast import _C

    heads, width = 3, max(lengths) + 4
    cfg = ModelConfig.from_dict(dict(model_type="deberta-v2", hidden_size=heads * d, num_attention_heads=heads,
                                     num_hidden_layers=1, intermediate_size=8, vocab_size=8, relative_attention=True,
                                     pos_att_type=list(terms), position_buckets=16, max_relative_positions=64))
    index = disentangled.distance_index(cfg, width)
    rows = index.hi - index.lo
    qkv, (pk, pq), cu, positions = _terms(lengths, heads, d, rows, len(lengths) * d, dtype)
    q, k, v = (qkv[:, i] for i in range(3))
    scale = cfg.attention_scale
    c2p, p2c = disentangled.tables(q, k, pk if "c2p" in terms else None, pq if "p2c" in terms else None, scale)
    bias = DisentangledBias(c2p, p2c, index.index, positions)
    ours = _C.attention(q, k, v, cu, max(lengths), scale, c2p=c2p, p2c=p2c, rel_index=index.index,
                        bias_positions=positions)
    wide = [t.double() for t in (q, k, v)]
    bias64 = DisentangledBias(*(None if t is None else t.double() for t in (c2p, p2c)), index.index, positions)
    expected = reference.attention(*wide, cu, max(lengths), scale, bias64)
    assert rel_err(reference.attention_loop(*wide, cu, scale, bias64), expected) <= 1e-12
    err = rel_err(ours, expected)
    if dtype == torch.float32:
        assert err <= TABLE[dtype]
    else:
        low = reference.attention(q, k, v, cu, max(lengths), scale, bias)
        assert within(err, rel_err(low, expected), dtype, floor=0.0, cap=False)


@needs_cpu
def test_native_disentangled_errors():
    from bertfast import _C

    q = torch.randn(5, 2, 16)
    cu = torch.tensor([0, 4, 5], dtype=torch.int32)
    pos = torch.arange(5, dtype=torch.int32)
    c2p, index = torch.randn(5, 2, 6), torch.tensor([0, 1, 2, 3, 4, 5, 5], dtype=torch.int32)
    call = lambda **kw: _C.attention(q, q, q, cu, 4, 0.25, **kw)  # noqa: E731
    with pytest.raises(ValueError, match="need rel_index, bias_positions"):
        call(c2p=c2p, bias_positions=pos)
    with pytest.raises(ValueError, match="exclude each other"):
        call(c2p=c2p, rel_index=index, bias_positions=pos, bias_table=torch.randn(2, 9))
    with pytest.raises(ValueError, match=r"c2p must be \(T = 5, heads = 2"):
        call(c2p=c2p[:, :1], rel_index=index, bias_positions=pos)
    with pytest.raises(ValueError, match="one number of columns"):
        call(c2p=c2p, p2c=torch.randn(5, 2, 7), rel_index=index, bias_positions=pos)
    with pytest.raises(ValueError, match=r"rel_index values must lie in \[0, 6\)"):
        call(c2p=c2p, rel_index=index + 1, bias_positions=pos)
    with pytest.raises(ValueError, match="sequence 0 span 6"):
        call(c2p=c2p, rel_index=index, bias_positions=torch.tensor([0, 1, 2, 6, 0], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"pos must be \(rows > 0, heads \* head_dim = 32\)"):
        _C.position_scores(q, torch.randn(4, 31), 0.5)
    with pytest.raises(ValueError, match="pos has dtype"):
        _C.position_scores(q, torch.randn(4, 32, dtype=torch.bfloat16), 0.5)


# --- the encoder on the cpu backend ---------------------------------------------------------------------------------

@needs_cpu
@pytest.mark.parametrize("style", ["v2", "v3", "c2p", "p2c"])
def test_cpu_fp32_matches_transformers(isa, style):
    model = build(style)
    types = model.config.type_vocab_size or None
    ids, mask, tt = batch(type_vocab=types or 0)
    tt = tt if types else None
    assert rel_err(_ours(model, ids, mask, tt, backend="cpu", dtype=torch.float32), _hf(model, ids, mask, tt),
                   mask) <= 1e-5


@needs_cpu
def test_cpu_past_256_buckets():
    model = build("v3-256", num_hidden_layers=1)
    ids, mask, _ = batch([300, 1, 140, 9])
    assert rel_err(_ours(model, ids, mask, backend="cpu", dtype=torch.float32), _hf(model, ids, mask), mask) <= 1e-5


@needs_cpu
@pytest.mark.parametrize("layout", ["left", "holes"])
def test_cpu_masks_match_transformers(layout):
    model = build("v3")
    ids, mask, _ = batch(layout=layout)
    assert rel_err(_ours(model, ids, mask, backend="cpu", dtype=torch.float32), _hf(model, ids, mask), mask) <= 1e-5


@needs_cpu
@pytest.mark.parametrize("style", ["v2", "v3"])
def test_cpu_bf16_within_twice_hf_bf16(isa, style):
    _check_cpu_bf16(build(style))


def _check_cpu_bf16(model):
    """The cpu backend's bf16 encoder within twice transformers' own bf16 error, both against transformers fp32."""
    ids, mask, tt = batch(type_vocab=model.config.type_vocab_size)
    tt = tt if model.config.type_vocab_size else None
    ref = _hf(model, ids, mask, tt)
    ours = rel_err(_ours(model, ids, mask, tt, backend="cpu", dtype=torch.bfloat16), ref, mask)
    theirs = rel_err(_hf(model, ids, mask, tt, torch.bfloat16), ref, mask)
    assert within(ours, theirs, torch.bfloat16, floor=0.0, cap=False), f"bf16 {ours:.3g} vs HF bf16 {theirs:.3g}"


@needs_cpu
@pytest.mark.parametrize("style", ["v2", "v3"])
def test_cpu_bf16_position_scores_on_tiles(tiles, style):
    """Heads 32 wide, so the position scores run on the AMX tiles (choose_position_scores): the bf16 encoder within
    twice transformers' own bf16 error (their invariance: test_tiers.py's 64-wide heads on amx_emulated)."""
    from bertfast import _C

    assert _C.testing.position_scores_path("bfloat16", 32, tiles) in ("Amx", "AmxEmulated")
    _check_cpu_bf16(build(style, num_attention_heads=2))


@needs_cpu
def test_cpu_int8_close_to_fp32():
    """int8 GEMMs (the attention and its position terms fp32): every real token's cosine to transformers' fp32
    above 0.99, the int8 model check of test_quant.py."""
    model = build("v3")
    ids, mask, _ = batch()
    real = mask.bool()
    ours, ref = _ours(model, ids, mask, backend="cpu", dtype="int8"), _hf(model, ids, mask)
    assert float(torch.nn.functional.cosine_similarity(ours[real], ref[real], dim=-1).min()) > 0.99


# --- the triton backend under the interpreter (tiny shapes: it interprets every program instance) ----------------

@needs_triton
@pytest.mark.parametrize("style", ["v2", "v3", "c2p", "p2c"])
def test_triton_fp32_matches_transformers(style):
    model = build(style, num_hidden_layers=1)
    types = model.config.type_vocab_size or None
    ids, mask, tt = batch([20, 1, 13], type_vocab=types or 0)
    tt = tt if types else None
    assert rel_err(_ours(model, ids, mask, tt, backend="triton", dtype=torch.float32), _hf(model, ids, mask, tt),
                   mask) <= 1e-5


@needs_triton
def test_triton_attention_terms_op_and_errors():
    from bertfast.kernels.triton.attention import attention_varlen

    heads, d, lengths = 2, 16, [9, 1, 5]
    cfg = ModelConfig.from_dict(dict(model_type="deberta-v2", hidden_size=heads * d, num_attention_heads=heads,
                                     num_hidden_layers=1, intermediate_size=8, vocab_size=8, relative_attention=True,
                                     pos_att_type=["c2p", "p2c"], position_buckets=4, max_relative_positions=16))
    index = disentangled.distance_index(cfg, 12)
    qkv, (pk, pq), cu, positions = _terms(lengths, heads, d, index.hi - index.lo, 3, torch.float32)
    q, k, v = (qkv[:, i] for i in range(3))
    for c2p_on, p2c_on in ((True, True), (True, False), (False, True)):
        c2p, p2c = disentangled.tables(q, k, pk if c2p_on else None, pq if p2c_on else None, 0.2)
        bias = DisentangledBias(c2p, p2c, index.index, positions)
        ours = attention_varlen(q, k, v, cu, max(lengths), 0.2, bias=bias)
        assert rel_err(ours, reference.attention(q, k, v, cu, max(lengths), 0.2, bias)) <= TABLE[torch.float32]
    c2p, _ = disentangled.tables(q, k, pk, None, 0.2)
    with pytest.raises(ValueError, match="need c2p or p2c"):
        attention_varlen(q, k, v, cu, max(lengths), 0.2, bias=DisentangledBias(None, None, index.index, positions))
    with pytest.raises(ValueError, match="one cols for both"):
        attention_varlen(q, k, v, cu, max(lengths), 0.2, bias=DisentangledBias(c2p, c2p[..., :-1].contiguous(),
                                                                                 index.index, positions))
    with pytest.raises(ValueError, match="width odd"):
        attention_varlen(q, k, v, cu, max(lengths), 0.2, bias=DisentangledBias(c2p, None, index.index[:-1], positions))


@needs_triton
def test_triton_position_scores_op():
    """The Triton `position_scores` against the fp64 reference, on q as the QKV kernel leaves it (a strided view)
    and an odd head dim; a token's entries the same bits alone, inside the batch, and with the projection rows in
    other columns (a wider batch reads more rows: [lo, hi) moves); its input checks."""
    from bertfast.kernels.triton.disentangled import BLOCK_M, BLOCK_N, position_scores

    heads, d, rows = 3, 20, BLOCK_N + 13  # rows past one column tile, tokens past two row tiles
    qkv, (pos, _), _, _ = _terms([2 * BLOCK_M + 11, 1, 7], heads, d, rows, 5, torch.float32)
    q = qkv[:, 0]
    ours = position_scores(q, pos, 0.125)
    expected, _ = disentangled.tables(q.double(), q.double(), pos.double(), None, 0.125)
    assert ours.dtype == torch.float32 and ours.shape == (q.shape[0], heads, rows) and ours.is_contiguous()
    assert rel_err(ours, expected) <= TABLE[torch.float32]
    for lo, hi in ((2 * BLOCK_M + 11, 2 * BLOCK_M + 12), (0, 1), (BLOCK_M - 3, BLOCK_M + 40)):
        assert torch.equal(position_scores(q[lo:hi], pos, 0.125), ours[lo:hi])
    assert torch.equal(position_scores(q, pos[9:70], 0.125), ours[..., 9:70])
    with pytest.raises(ValueError, match=r"pos must be \(rows > 0, heads \* d = 60\)"):
        position_scores(q, pos[:, 1:], 0.5)
    with pytest.raises(ValueError, match="pos has dtype"):
        position_scores(q, pos.half(), 0.5)


@needs_triton
@pytest.mark.parametrize("style, lengths", [("v3-256", [150, 1, 70, 9]), ("v2", [60, 1, 33])],
                         ids=["v3-256-L150-1-70-9", "v2-L60-1-33"])
def test_triton_batch_invariance(style, lengths):
    """Each row alone equals itself inside a ragged batch, bit for bit, under the interpreter: 230 tokens (past twice
    the position kernel's and the attention's 64-row tiles), 299 position rows (v3-256: past the kernel's 64-row
    column tile), and a narrower batch alone (fewer rows, each at another column)."""
    model = build(style, num_hidden_layers=1)
    types = model.config.type_vocab_size
    ids, mask, tt = batch(lengths, type_vocab=types)
    kwargs = dict(token_type_ids=tt) if types else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        enc = Encoder.from_hf(model, backend="triton", dtype=torch.float32)
    together = enc(ids, attention_mask=mask, **kwargs).last_hidden_state
    for i, n in enumerate(lengths):
        alone = enc(ids[i:i + 1, :n], attention_mask=mask[i:i + 1, :n],
                    **{k: v[i:i + 1, :n] for k, v in kwargs.items()}).last_hidden_state
        assert torch.equal(alone[0], together[i, :n]), f"row {i} ({n} tokens) changes with its batch"


# --- bertfast validate --model on saved checkpoints (the accuracy rule stage by stage; the int8 report) -----------

def _saved(path, style):
    """A saved random checkpoint of `style` with a DebertaV2Tokenizer covering validate's texts."""
    from bertfast.tools.validate import model_check, sentences

    vocab = save_tokenizer(path, list(model_check.SENTENCES) + sentences.sentences())
    build(style, vocab_size=vocab).save_pretrained(path)
    return str(path)


def _stage_rows(out, layers):
    stages = ["embeddings"] + [f"layer{i + 1}" for i in range(layers)]
    return [line.split() for line in out.splitlines() if line.split()[:1] and line.split()[0] in stages]


@pytest.mark.parametrize("backend", ["torch"] + (["cpu"] if CPU_REASON is None else []))
@pytest.mark.parametrize("style", ["v2", "v3"])
def test_validate_model(tmp_path, capsys, backend, style):
    from bertfast.tools.cli import main

    code = main(["validate", "--backend", backend, "--model", _saved(tmp_path, style), "--dtype", "fp32,bf16"])
    out = capsys.readouterr().out
    rows = _stage_rows(out, 2)
    assert code == 0 and len(rows) == 2 * 3 and all(r[-1] == "PASS" for r in rows), out
    assert "sentences-B6" in out  # the checkpoint's own tokenizer, not random ids


@needs_cpu
def test_validate_int8_report(tmp_path, capsys):
    from bertfast.tools.cli import main

    code = main(["validate", "--backend", "cpu", "--model", _saved(tmp_path, "v3"), "--dtype", "int8"])
    out = capsys.readouterr().out
    rows = _stage_rows(out, 2)
    assert code == 0 and len(rows) == 3 and all(r[2] == "int8" and "PASS" in r for r in rows), out
    assert "sentence embeddings (202 sentences" in out and out.rstrip().endswith("PASS"), out
