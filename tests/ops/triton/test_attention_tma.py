"""The Hopper TMA attention (bertfast.kernels.triton.attention_tma) under the Triton interpreter, which runs its
host-side descriptors (zero fill past T included) and the "ws" tile's device-side Q descriptor; the wgmma, TMA and
warp-specialised builds themselves are checked by `bertfast kernels`. Against the fp64 reference on ragged batches of
lengths 1, 63, 64, 65 and 130 (tails of the 64-key step and of the 128-row query tile, and boxes that run into the next
sequence and past T), head_dim 64 and 128, each tile; bit for bit against `attention.attention_varlen` run with its
GPU key step (the interpreter's own config steps 32 keys); a sequence alone equals, bit for bit, the same sequence in a
batch of more than twice the query tile; what it does not handle is refused before launch. fp16 only: the interpreter
cannot compute in bf16, and fp32 is refused."""

from __future__ import annotations

import contextvars
import math

import pytest
import torch

from bertfast import reference as ref
from bertfast.kernels.triton import attention as attention_mod
from bertfast.kernels.triton import attention_tma as tma_mod
from bertfast.kernels.triton.attention_tma import TILES, attention_tma

from .conftest import NoLaunch, assert_matches_reference, f64, rand

HEADS = 2
LENGTHS = [1, 63, 64, 65, 130]  # 323 tokens: more than twice the 128-row query tile
TILE_NAMES = [pytest.param(t, id=t) for t in TILES]
HEAD_DIMS = [pytest.param(d, id=f"d{d}") for d in tma_mod.HEAD_DIMS]
LARGEST_BLOCK_M = max(c.kwargs["BLOCK_M"] for per_d in TILES.values() for c in per_d.values())


def cu_of(lengths):
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    return torch.tensor(bounds, dtype=torch.int32)


def planes(T, d, seed=0, layout="planes"):
    """q, k, v (T, HEADS, d) fp16 as a model hands them over: "planes", views of one (3, T, heads, d) buffer (the QKV
    kernel's); "fused", the column blocks of a (T, 3, heads, d) projection (rows 3 * heads * d apart)."""
    x = rand(3, T, HEADS, d, dtype=torch.float16, seed=seed)
    if layout == "fused":
        x = x.transpose(0, 1).contiguous().transpose(0, 1)
        assert not x[0].is_contiguous()
    return x[0], x[1], x[2]


def gpu_step_attention_varlen(monkeypatch, *args):
    """attention_varlen with the tensor-core config it runs on a GPU (64-key steps) instead of the interpreter's."""
    gpu = attention_mod.MMA_CONFIGS[-1]
    assert gpu.kwargs["BLOCK_N"] == tma_mod.BLOCK_N
    monkeypatch.setattr(attention_mod._attention_kernel, "configs", [gpu])
    return attention_mod.attention_varlen(*args)


@pytest.mark.parametrize("tile", TILE_NAMES)
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_matches_reference(d, tile):
    cu = cu_of(LENGTHS)
    q, k, v = planes(int(cu[-1]), d, seed=d)
    scale = 1 / math.sqrt(d)
    ours = attention_tma(q, k, v, cu, max(LENGTHS), scale, tile=tile)
    assert ours.shape == (int(cu[-1]), HEADS * d) and ours.dtype == torch.float16
    assert_matches_reference(ours, ref.attention(q, k, v, cu, max(LENGTHS), scale),
                             ref.attention(*f64(q, k, v), cu, max(LENGTHS), scale), torch.float16, f"d{d} {tile}")


@pytest.mark.parametrize("layout", ["planes", "fused"])
@pytest.mark.parametrize("tile", TILE_NAMES)
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_bit_equal_to_attention_varlen(d, tile, layout, monkeypatch):
    # The same online softmax in the same order, 64 keys a step: the interpreter's numpy reduces a row's scores and
    # dots alike in both kernels (same row length, same key step), and the query tile (128 rows here, 64 there)
    # changes no row's arithmetic. An over-estimated max_seqlen only adds programs that store nothing.
    cu = cu_of([65, 0, 130, 1, 64])
    T = int(cu[-1])
    q, k, v = planes(T, d, seed=3, layout=layout)
    ours = attention_tma(q, k, v, cu, 200, 0.2, tile=tile)
    assert torch.equal(ours, gpu_step_attention_varlen(monkeypatch, q, k, v, cu, 130, 0.2))


@pytest.mark.parametrize("tile", TILE_NAMES)
def test_a_sequence_alone_equals_the_sequence_in_a_batch(tile):
    cu = cu_of(LENGTHS)
    assert int(cu[-1]) >= 2 * LARGEST_BLOCK_M
    q, k, v = planes(int(cu[-1]), 64, seed=5)
    batch = attention_tma(q, k, v, cu, max(LENGTHS), 0.125, tile=tile)
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        alone = attention_tma(q[s:e], k[s:e], v[s:e], cu_of([e - s]), e - s, 0.125, tile=tile)
        assert torch.equal(alone, batch[s:e]), f"sequence [{s}, {e})"


def test_the_tiles_never_depend_on_the_call():
    # Every tile steps keys as `_attention_block`'s tensor-core family does, fills wgmma's 64-row minimum per
    # warpgroup, and is looked up by (head_dim, dtype, name) alone.
    for name, per_d in TILES.items():
        assert set(per_d) == set(tma_mod.HEAD_DIMS)
        for d, config in per_d.items():
            assert config.kwargs["BLOCK_N"] == attention_mod.MMA_CONFIGS[0].kwargs["BLOCK_N"] == 64
            assert config.kwargs["BLOCK_M"] % 64 == 0 and config.num_warps >= 4
            for dtype in (torch.float16, torch.bfloat16):
                assert tma_mod.config_for(d, dtype, name) is config
    assert tma_mod.config_for(64, torch.float16) is TILES[tma_mod.DEFAULT_TILE][64]
    with pytest.raises(ValueError, match="unknown tile 'huge'"):
        tma_mod.config_for(64, torch.float16, "huge")
    with pytest.raises(ValueError, match="no tile for head_dim 64 in torch.float32"):
        tma_mod.config_for(64, torch.float32)


def test_empty_sequences_and_empty_batch():
    q, k, v = planes(0, 64)
    assert attention_tma(q, k, v, cu_of([0, 0]), 0, 0.1).shape == (0, HEADS * 64)
    cu = cu_of([5, 0, 0, 9])
    q, k, v = planes(14, 64, seed=7)
    assert_matches_reference(attention_tma(q, k, v, cu, 9, 0.1), ref.attention_loop(q, k, v, cu, 0.1),
                             ref.attention_loop(*f64(q, k, v), cu, 0.1), torch.float16, "empty sequences")


@pytest.mark.parametrize("case", ["d32", "d80", "fp32", "bias", "window", "row-stride", "base", "head-stride",
                                  "column-stride", "tile", "cu-int64", "cu-end", "max-seqlen-small", "mixed-dtype"])
def test_what_it_does_not_handle_raises_before_launch(case, monkeypatch):
    monkeypatch.setattr(tma_mod, "_attention_tma_kernel", NoLaunch())
    T = 8
    q, k, v = planes(T, 64)
    args = dict(q=q, k=k, v=v, cu_seqlens=cu_of([3, 5]), max_seqlen=5, scale=0.1)
    wide = rand(T, HEADS * 64 + 4, dtype=torch.float16)  # rows of 132 halves: 264 bytes, not a multiple of 16
    match = "attention_tma: "
    if case in ("d32", "d80"):
        d = int(case[1:])
        args.update(q=rand(T, HEADS, d, dtype=torch.float16), k=rand(T, HEADS, d, dtype=torch.float16),
                    v=rand(T, HEADS, d, dtype=torch.float16))
        match += rf"head_dim must be one of \(64, 128\), got {d}"
    elif case == "fp32":
        args.update(q=q.float(), k=k.float(), v=v.float())
        match += "fp16 or bf16 inputs only"
    elif case == "bias":
        args.update(bias=(torch.zeros(HEADS, 9), torch.zeros(T, dtype=torch.int32)))
        match += "a position bias is not supported"
    elif case == "window":
        args.update(window=4)
        match += "only window = 0"
    elif case == "row-stride":
        args.update(q=wide[:, :HEADS * 64].unflatten(1, (HEADS, 64)))
        match += r"q must be a \(T, heads \* d\) plane for TMA"
    elif case == "base":
        args.update(k=rand(T * HEADS * 64 + 8, dtype=torch.float16)[4:4 + T * HEADS * 64].view(T, HEADS, 64))
        match += r"k must be a \(T, heads \* d\) plane .* base 8 bytes past"
    elif case == "head-stride":
        args.update(v=rand(T, 64, HEADS, dtype=torch.float16).transpose(1, 2))
        match += r"v must be a \(T, heads \* d\) plane"
    elif case == "column-stride":
        args.update(q=rand(T, HEADS, 128, dtype=torch.float16)[..., ::2])
        match += r"q must be a \(T, heads \* d\) plane"
    elif case == "tile":
        args.update(tile="huge")
        match += "unknown tile"
    elif case == "cu-int64":
        args.update(cu_seqlens=cu_of([3, 5]).long())
        match += "cu_seqlens must be a 1-D int32 tensor"
    elif case == "cu-end":
        args.update(cu_seqlens=torch.tensor([0, 3, 9], dtype=torch.int32))
        match += "cu_seqlens must start at 0"
    elif case == "max-seqlen-small":
        args.update(max_seqlen=4)
        match += "max_seqlen = 4"
    elif case == "mixed-dtype":
        args.update(v=v.float())
        match += "v has dtype"
    with pytest.raises(ValueError, match=match):
        attention_tma(**args)


@pytest.mark.parametrize("capability,ok", [((8, 0), False), ((8, 9), False), ((7, 5), False), ((9, 0), True),
                                           ((10, 0), True)])
def test_a_gpu_before_hopper_is_refused(monkeypatch, capability, ok):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA Test GPU")
    tma_mod.check_arch("cpu")  # the interpreter: no GPU generation to check
    if ok:
        tma_mod.check_arch(torch.device("cuda", 0))
        return
    major, minor = capability
    with pytest.raises(ValueError, match=rf"sm_90\) or later .* NVIDIA Test GPU has {major}\.{minor} "
                                         rf"\(sm_{major}{minor}\)"):
        tma_mod.check_arch(torch.device("cuda", 0))


def test_the_ws_tile_keeps_an_allocator_the_caller_set():
    # Its Q descriptor is made on the device, in global scratch from Triton's allocator (a per-thread context
    # variable): one is set where the thread has none, and one the caller set is left alone.
    import triton
    from triton.runtime import _allocation

    def run():
        _allocation._allocator.set(_allocation.NullAllocator())
        tma_mod._ensure_allocator()
        assert _allocation._allocator.get() is tma_mod._scratch
        mine = lambda size, alignment, stream: None  # noqa: E731
        triton.set_allocator(mine)
        tma_mod._ensure_allocator()
        assert _allocation._allocator.get() is mine

    contextvars.copy_context().run(run)  # the test's settings end with it
