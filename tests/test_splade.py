"""SPLADE: the fused pooling op (`_C.sparse_pool` in fp32 and bf16 against `reference.sparse_pool` in fp64, batch
invariance on every tier, the AMX tiles' schedule) and `bertfast.SparseEncoder` against sentence-transformers'
`SparseEncoder.encode` on random checkpoints saved as sentence-transformers saves them."""

import json
import os
import subprocess
import sys
import warnings

os.environ["HF_HUB_OFFLINE"] = "1"  # nothing here may download; set before the hub libraries load

import pytest
import torch
import sentence_transformers as st

import bertfast
from bertfast import ConfigError, reference
from bertfast.accuracy import rel_error, within
from bertfast.backends import get_backend
from helpers.sentences import sentences
from helpers.splade import save_splade


def cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def op_inputs(lengths, V, K, seed=0, bias=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(lengths), K, generator=g, dtype=torch.float64)
    w = torch.randn(V, K, generator=g, dtype=torch.float64) / K ** 0.5
    b = torch.randn(V, generator=g, dtype=torch.float64) * 0.1 if bias else None
    return x, w, b, cu(lengths)


OP_CASES = [  # (lengths, vocab, hidden): lengths 0 and 1, tiles of 8 (fp32) and 16 (AMX) crossed, vocab not a
    # multiple of 48, odd K; K a multiple of 32 (bf16 on the AMX tiers' tiles) in one and in nine tile steps (K blocks
    # of 8 steps crossed)
    pytest.param([1], 48, 16, id="B1-S1-V48-K16"),
    pytest.param([3, 0, 9, 8, 17], 97, 37, id="B5-ragged-empty-V97-K37"),
    pytest.param([127, 129, 1], 1001, 64, id="B3-S129-V1001-K64"),
    pytest.param([17, 1, 33, 0, 5, 16], 97, 96, id="B6-ragged-empty-V97-K96"),
    pytest.param([1, 47, 31], 145, 288, id="B3-S47-V145-K288"),
]


@pytest.mark.parametrize("lengths,V,K", OP_CASES)
@pytest.mark.parametrize("pooling", ["max", "sum"])
@pytest.mark.parametrize("activation", ["relu", "log1p_relu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_sparse_pool_op(isa, lengths, V, K, pooling, activation, dtype):
    """Against the fp64 oracle on the operands' own values (x and weight rounded to dtype): within fp32
    accumulation's error (2x the fp32 reference's, plus 1e-6), the same nonzero entries. bf16 (on the AMX tiers'
    tiles where K % 32 == 0, widened to fp32 elsewhere) also against the oracle on the unrounded operands: the
    accuracy rule (2x the bf16 reference's error plus the floor; measured ~0.7x it)."""
    x, w, b, cu_seqlens = op_inputs(lengths, V, K)
    xr, wr = x.to(dtype).double(), w.to(dtype).double()
    oracle = reference.sparse_pool(xr, wr, b, cu_seqlens, pooling, activation)
    ref32 = reference.sparse_pool(xr.float(), wr.float(), b.float(), cu_seqlens, pooling, activation)
    cpu = get_backend("cpu", "cpu")
    ours = cpu.sparse_pool(x.to(dtype), cpu.pack(w.to(dtype)), b.float(), cu_seqlens, pooling, activation)
    assert ours.shape == (len(lengths), V) and ours.dtype == torch.float32
    assert rel_error(ours, oracle) <= max(2 * rel_error(ref32, oracle), 1e-6) + 1e-6
    assert torch.equal(ours > 0, oracle > 0)  # the same nonzero entries
    if dtype == torch.bfloat16:
        true = reference.sparse_pool(x, w, b, cu_seqlens, pooling, activation)
        low = reference.sparse_pool(x.bfloat16(), w.bfloat16(), b.bfloat16(), cu_seqlens, pooling, activation)
        assert within(rel_error(ours, true), rel_error(low, true), torch.bfloat16)
    empty = [i for i, n in enumerate(lengths) if n == 0]
    assert not ours[empty].any()  # a sequence without tokens pools to zeros


def test_sparse_pool_op_without_bias_and_errors():
    x, w, b, cu_seqlens = op_inputs([5, 2], 50, 8, bias=False)
    cpu = get_backend("cpu", "cpu")
    ours = cpu.sparse_pool(x.float(), w.float(), None, cu_seqlens)
    assert rel_error(ours, reference.sparse_pool(x, w, None, cu_seqlens)) <= 1e-6
    with pytest.raises(ValueError, match="pooling must be 'max' or 'sum'"):
        cpu.sparse_pool(x.float(), w.float(), None, cu_seqlens, "mean")
    with pytest.raises(ValueError, match="cu_seqlens"):
        cpu.sparse_pool(x.float(), w.float(), None, cu([5, 1]))
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        cpu.sparse_pool(x.half(), w.half(), None, cu_seqlens)


def invariance_inputs(V, K, dtype):
    """40 sequences of 1 to 45 tokens (920 in all), x and the weight in dtype, bias fp32."""
    lengths = [(7 * i) % 45 + 1 for i in range(40)]
    x, w, b, cu_seqlens = op_inputs(lengths, V, K)
    return x.to(dtype), w.to(dtype), b.float(), cu_seqlens, lengths


def check_alone_in_batch(x, packed, b, cu_seqlens, lengths, pooling, batch):
    cpu = get_backend("cpu", "cpu")
    for i in (0, 5, 39):
        alone = cpu.sparse_pool(x[cu_seqlens[i]:cu_seqlens[i + 1]], packed, b, cu([lengths[i]]), pooling)
        assert torch.equal(alone[0], batch[i])


@pytest.mark.parametrize("pooling", ["max", "sum"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_sparse_pool_batch_invariant(isa, pooling, dtype):
    """A sequence alone equals the same sequence inside a batch of 40 (920 tokens), bit for bit (tiles of 8 and
    16 tokens and blocks of 128 rows crossed; bf16 K = 64: the AMX tiers' tiles)."""
    x, w, b, cu_seqlens, lengths = invariance_inputs(200, 40 if dtype == torch.float32 else 64, dtype)
    cpu = get_backend("cpu", "cpu")
    packed = cpu.pack(w)
    check_alone_in_batch(x, packed, b, cu_seqlens, lengths, pooling,
                         cpu.sparse_pool(x, packed, b, cu_seqlens, pooling))


@pytest.mark.parametrize("pooling", ["max", "sum"])
def test_sparse_pool_tiles_invariant_to_batch_and_blocking(tiles, pooling):
    """On the AMX tiles (sparse_pool_amx.cpp), past every threshold of its schedule: 920 tokens (8 row blocks of at
    most 128), K = 256 (a thread's panels in groups of 42, the 1 MiB of weights kAmxGroupBytes holds) and 209 panels
    (V = 10007, the last one short): a sequence alone equals itself in the batch, and every blocking (K steps per
    block, rows per block, A staged or not) gives the same bits."""
    x, w, b, cu_seqlens, lengths = invariance_inputs(10007, 256, torch.bfloat16)
    cpu = get_backend("cpu", "cpu")
    packed = cpu.pack(w)
    batch = cpu.sparse_pool(x, packed, b, cu_seqlens, pooling)
    check_alone_in_batch(x, packed, b, cu_seqlens, lengths, pooling, batch)
    from bertfast import _C

    for steps, rows, stage in ((1, 32, False), (3, 256, False), (3, 64, True)):
        _C.testing.set_amx_blocking(steps, rows, stage)
        assert torch.equal(cpu.sparse_pool(x, packed, b, cu_seqlens, pooling), batch)


@pytest.fixture(scope="module")
def texts():
    return sentences(40, seed=3)


def st_model(path, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return st.SparseEncoder(path, device="cpu", **kwargs)


def check_parity(ours, theirs, tol=1e-5):
    """Values within tol (max error over max value) and the same nonzero indices, except where a logit's max is
    0 within fp32 rounding: relu keeps a 1e-8 on one side and zeroes it on the other (about one entry in a million
    on these random weights; sentence-transformers differs from itself that way across batch sizes)."""
    ours, theirs = ours.to_dense(), theirs.to_dense()
    assert ours.shape == theirs.shape
    assert rel_error(ours, theirs.double()) <= tol
    differ = (ours != 0) != (theirs != 0)
    assert int(differ.sum()) <= max(1, ours.numel() // 10 ** 6)
    assert float(torch.where(differ, torch.maximum(ours, theirs), 0).max()) <= 1e-6 * float(theirs.max())


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_encode_matches_sentence_transformers(splade_model, texts, backend):
    theirs = st_model(splade_model).encode(texts)
    ours = bertfast.SparseEncoder.from_pretrained(splade_model, backend=backend).encode(texts, batch_size=7)
    assert ours.is_sparse and ours.shape == (len(texts), 30522)
    check_parity(ours, theirs)
    # built coalesced (texts longest first in batches, rows back in text order, columns ascending): what coalesce()
    # of the same entries gives
    assert ours.is_coalesced()
    again = torch.sparse_coo_tensor(ours.indices().flip(1), ours.values().flip(0), ours.shape,
                                    check_invariants=True).coalesce()
    assert torch.equal(ours.indices(), again.indices()) and torch.equal(ours.values(), again.values())


@pytest.mark.parametrize("pooling,activation", [("sum", "relu"), ("max", "log1p_relu"), ("sum", "log1p_relu")])
def test_pooling_options(tmp_path, minilm_path, texts, pooling, activation):
    path = save_splade(tmp_path / "m", minilm_path, pooling=pooling, activation=activation, seed=1)
    check_parity(bertfast.SparseEncoder.from_pretrained(path, backend="cpu").encode(texts),
                 st_model(path).encode(texts))


def test_max_active_dims_and_output_forms(tmp_path, minilm_path, splade_model, texts):
    model, ours = st_model(splade_model), bertfast.SparseEncoder.from_pretrained(splade_model, backend="cpu")
    check_parity(ours.encode(texts, max_active_dims=16), model.encode(texts, max_active_dims=16))
    assert int((ours.encode(texts, max_active_dims=16).to_dense() != 0).sum(1).max()) == 16
    dense = ours.encode(texts, convert_to_sparse_tensor=False)
    assert not dense.is_sparse and torch.equal(dense, ours.encode(texts).to_dense())
    listed = ours.encode(texts[:3], convert_to_tensor=False)
    assert len(listed) == 3 and torch.equal(listed[1].to_dense(), dense[1])
    single = ours.encode(texts[2])
    assert single.shape == (30522,) and torch.equal(single.to_dense(), dense[2])
    # a checkpoint's own max_active_dims applies by default, as in sentence-transformers
    path = save_splade(tmp_path / "k", minilm_path, max_active_dims=5)
    ours_k = bertfast.SparseEncoder.from_pretrained(path, backend="cpu")
    check_parity(ours_k.encode(texts), st_model(path).encode(texts))
    with pytest.raises(ValueError, match="max_active_dims must be a positive integer"):
        ours.encode(texts, max_active_dims=0)


def test_in_memory_model_and_prompts(splade_model, texts):
    model = st_model(splade_model, prompts={"query": "query: "})
    ours = bertfast.SparseEncoder.from_sentence_transformers(model, backend="cpu")
    check_parity(ours.encode(texts), model.encode(texts))
    check_parity(ours.encode_query(texts), model.encode_query(texts))
    check_parity(ours.encode(texts, prompt="passage: "), model.encode(texts, prompt="passage: "))


def test_optimize_sparse_encoder(splade_model, texts):
    """bertfast.optimize(SparseEncoder): the encoder on the engine (its MLM head and pooling stay torch's)."""
    model = st_model(splade_model)
    theirs = model.encode(texts)
    assert bertfast.optimize(model, strict=True) is model
    assert type(model[0].auto_model.base_model).__mro__[1].__name__ == "_EngineForward"
    check_parity(model.encode(texts), theirs)


@pytest.mark.parametrize("dtype", [None, torch.bfloat16, "int8"], ids=["fp32", "bf16", "int8"])
def test_batch_invariant_encode(splade_model, texts, isa, dtype):
    """A text alone equals the same text in a batch of 40 and in batches of 6 on one or three worker threads, bit for
    bit, dense and sparse (cpu backend, every tier)."""
    ours = bertfast.SparseEncoder.from_pretrained(splade_model, backend="cpu", dtype=dtype)
    batch = ours.encode(texts, convert_to_sparse_tensor=False, batch_size=40)
    for i in (0, 17):
        assert torch.equal(ours.encode([texts[i]], convert_to_sparse_tensor=False)[0], batch[i])
    for workers in (1, 3):
        assert torch.equal(ours.encode(texts, convert_to_sparse_tensor=False, batch_size=6, workers=workers), batch)
        sparse = ours.encode(texts, batch_size=6, workers=workers)
        assert sparse.is_coalesced() and torch.equal(sparse.to_dense(), batch)
    with pytest.raises(ValueError, match="workers must be an integer >= 1"):
        ours.encode(texts, workers=0)


def test_low_precision(splade_model, texts):
    """bf16 and int8 encoders (the vocabulary GEMM bf16 under bf16, on AMX tiles on the AMX tiers; fp32 under int8),
    against fp32 sentence-transformers: bf16 within the accuracy rule (2x sentence-transformers' own bf16 error plus
    the floor; measured 5.3e-3 against its 8.5e-3 on avx512_vnni and amx_emulated); int8 within 2e-3 (measured
    5.3e-4)."""
    oracle = st_model(splade_model).encode(texts).to_dense().double()
    st_bf16 = st_model(splade_model, model_kwargs={"dtype": torch.bfloat16}).encode(texts).to_dense().float()
    bf16 = bertfast.SparseEncoder.from_pretrained(splade_model, backend="cpu", dtype=torch.bfloat16).encode(texts)
    assert within(rel_error(bf16.to_dense(), oracle), rel_error(st_bf16, oracle), torch.bfloat16)
    int8 = bertfast.SparseEncoder.from_pretrained(splade_model, backend="cpu", dtype="int8").encode(texts)
    assert rel_error(int8.to_dense(), oracle) <= 2e-3


def test_not_a_splade_checkpoint(tiny_text_model, tmp_path, splade_model):
    with pytest.raises(ConfigError, match="ForMaskedLM"):
        bertfast.SparseEncoder.from_pretrained(tiny_text_model)
    with pytest.raises(ConfigError, match="SpladePooling"):
        bertfast.SparseEncoder.from_sentence_transformers(st.SentenceTransformer(tiny_text_model, device="cpu"))


# Run in a fresh process: the peak RSS (VmHWM) is reset just before the measured call (/proc/self/clear_refs "5"),
# so neither loading nor anything else that process did counts; then a control materialises the (tokens x vocab)
# logits to show the measurement sees a tensor of that size.
PEAK_SCRIPT = """
import json, sys
import torch
import bertfast

def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":")) / 1024  # MiB

def grown(run):
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak to the current RSS
    before = status("VmRSS")
    out = run()
    return status("VmHWM") - before, out

model = bertfast.SparseEncoder.from_pretrained(sys.argv[1], backend="cpu")
ids = torch.randint(1000, 30000, (int(sys.argv[2]), int(sys.argv[3])), generator=torch.Generator().manual_seed(0))
mask = torch.ones_like(ids)
model.embed_tokens(ids[:2], mask[:2])  # warm up: threads, scratch buffers, first touch
grew, out = grown(lambda: model.embed_tokens(ids, mask))
hidden = model.encoder.config.hidden_size
x, w = torch.randn(ids.numel(), hidden), torch.randn(model.vocab_size, hidden)
control, _ = grown(lambda: x @ w.T)
print(json.dumps({"grew": grew, "control": control, "shape": list(out.shape)}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the peak RSS from Linux's /proc/self/status")
def test_peak_memory_never_holds_the_logits(splade_model):
    """SparseEncoder on the cpu backend pools in the vocabulary GEMM's epilogue: 64 rows of 64 tokens (4096 tokens x
    30522 vocabulary: 477 MiB of fp32 logits) raise the process's peak RSS by far less than that (measured 15 MiB,
    7.5 MiB of it the (64, 30522) output), while materialising those logits raises it by their size."""
    rows, width = 64, 64
    logits_mib = rows * width * 30522 * 4 / 2 ** 20
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    run = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, splade_model, str(rows), str(width)], env=env,
                         capture_output=True, text=True, timeout=120)
    if run.returncode != 0 and "clear_refs" in run.stderr:
        pytest.skip(f"the peak RSS cannot be reset here (/proc/self/clear_refs): {run.stderr.strip()[-200:]}")
    assert run.returncode == 0, run.stderr
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["shape"] == [rows, 30522]
    assert got["control"] >= 0.9 * logits_mib, got  # the measurement sees a (tokens x vocab) tensor
    assert got["grew"] <= logits_mib / 8, got  # ~60 MiB: four times the measured growth
