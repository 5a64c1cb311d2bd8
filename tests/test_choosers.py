"""The native choosers as tables: each row gives a chooser its arguments (the tier among them, so every tier is checked
on any CPU) and the path it must answer; the rows cover every branch and both sides of every threshold.

choose_attention (csrc/cpu/attention/attention.cpp), choose_gemm (csrc/cpu/gemm/linear.cpp), choose_int8
(csrc/cpu/int8/int8_linear.cpp), choose_sparse_pool (csrc/cpu/gemm/sparse_pool.cpp) and choose_position_scores
(csrc/cpu/attention/disentangled.cpp), through `bertfast._C.testing`.
Also: the main module exports the ops and the product's calls only; test and measurement knobs live in `_C.testing`.
"""

from __future__ import annotations

import pytest

_C = pytest.importorskip("bertfast._C", reason="the native extension bertfast._C is not built")

# (dtype, bf16_products, head_dim, has_bias, window, tier, avx512_bf16) -> path. Thresholds: head_dim <= 64; on amx, < 64.
ATTENTION = [
    # amx: tiles for the bf16 dtype's 64-wide heads and for the int8 path's products beside a bias or a window;
    # the AVX-512 kernels (Avx512 widening bf16, Int16) below 64 and for the int8 path's plain products
    ("bfloat16", False, 64, False, 0, "amx", True, "Amx"),
    ("bfloat16", False, 65, False, 0, "amx", True, "Avx512"),
    ("float32", True, 64, True, 128, "amx", True, "Amx"),
    ("float32", True, 65, True, 128, "amx", True, "Avx512"),
    ("float32", False, 64, False, 0, "amx", True, "Avx512"),
    ("bfloat16", False, 63, False, 0, "amx", True, "Avx512"),
    ("bfloat16", False, 32, True, 16, "amx", True, "Avx512"),
    ("float32", True, 64, False, 0, "amx", True, "Int16"),
    ("float32", True, 32, False, 0, "amx", True, "Int16"),
    ("float32", True, 64, True, 0, "amx", True, "Amx"),
    ("float32", True, 64, False, 16, "amx", True, "Amx"),
    ("bfloat16", False, 64, True, 16, "amx_emulated", True, "AmxEmulated"),
    ("bfloat16", False, 32, True, 16, "amx_emulated", True, "Avx512"),
    ("float32", True, 64, False, 0, "amx_emulated", False, "Int16"),
    ("float32", True, 64, True, 0, "amx_emulated", False, "AmxEmulated"),
    ("bfloat16", False, 65, False, 0, "amx_emulated", True, "Avx512"),
    ("float32", False, 32, False, 0, "amx_emulated", True, "Avx512"),
    # avx512_vnni with AVX-512 BF16: no bias; the bf16 dtype's kernel takes a window, the int8 path's none
    ("float32", True, 64, False, 0, "avx512_vnni", True, "Avx512Bf16"),
    ("float32", True, 65, False, 0, "avx512_vnni", True, "Avx512"),
    ("float32", True, 64, True, 0, "avx512_vnni", True, "Avx512"),
    ("float32", True, 64, False, 1, "avx512_vnni", True, "Avx512"),
    ("float32", False, 64, False, 0, "avx512_vnni", True, "Avx512"),
    ("bfloat16", False, 64, False, 0, "avx512_vnni", True, "Avx512Bf16"),
    ("bfloat16", False, 64, False, 16, "avx512_vnni", True, "Avx512Bf16"),
    ("bfloat16", False, 64, True, 0, "avx512_vnni", True, "Avx512"),
    ("bfloat16", False, 65, False, 0, "avx512_vnni", True, "Avx512"),
    # avx512_vnni without AVX-512 BF16: int16 products for the int8 path; the bf16 dtype widens to fp32
    ("float32", True, 64, False, 0, "avx512_vnni", False, "Int16"),
    ("float32", True, 65, False, 0, "avx512_vnni", False, "Avx512"),
    ("float32", True, 64, True, 0, "avx512_vnni", False, "Avx512"),
    ("float32", True, 64, False, 1, "avx512_vnni", False, "Avx512"),
    ("float32", False, 64, False, 0, "avx512_vnni", False, "Avx512"),
    ("bfloat16", False, 64, False, 0, "avx512_vnni", False, "Avx512"),
    # avx2 and portable: fp32 math whatever the layer
    ("bfloat16", False, 32, False, 0, "avx2", True, "Avx2"),
    ("float32", True, 64, True, 16, "avx2", False, "Avx2"),
    ("bfloat16", False, 32, False, 0, "portable", True, "Portable"),
    ("float32", True, 64, False, 0, "portable", False, "Portable"),
]

# (dtype, m, k, tier, avx512_bf16, amx_gemm) -> path. Thresholds: fp32 streams up to kPackPasses = 4 passes of
# kMaxRows = 8 rows (m <= 32; portable: kPortablePackPasses = 2, m <= 16); bf16 on AMX tiles where k % kAmxK (32)
# == 0, blocked from kAmxBlockedRowsBf16 = 128 rows unless amx_gemm forces a kernel.
GEMM = [
    ("float32", 32, 768, "avx512_vnni", True, "auto", "StreamAvx512"),
    ("float32", 33, 768, "avx512_vnni", True, "auto", "BlockedAvx512"),
    ("float32", 32, 768, "amx", True, "auto", "StreamAvx512"),
    ("float32", 33, 768, "amx", True, "auto", "BlockedAvx512"),
    ("float32", 33, 768, "amx_emulated", False, "blocked", "BlockedAvx512"),
    ("float32", 1, 768, "avx2", False, "auto", "StreamAvx2"),
    ("float32", 4096, 768, "avx2", False, "auto", "StreamAvx2"),
    ("float32", 16, 768, "portable", False, "auto", "StreamPortable"),
    ("float32", 17, 768, "portable", False, "auto", "BlockedPortable"),
    ("bfloat16", 17, 768, "portable", False, "auto", "StreamPortable"),
    ("bfloat16", 4096, 768, "avx2", False, "auto", "StreamAvx2"),
    ("bfloat16", 32, 768, "avx512_vnni", False, "auto", "StreamAvx512"),
    ("bfloat16", 33, 768, "avx512_vnni", False, "auto", "BlockedBf16"),
    ("bfloat16", 33, 768, "avx512_vnni", True, "auto", "StreamAvx512"),
    ("bfloat16", 4096, 768, "avx512_vnni", True, "auto", "StreamAvx512"),
    ("bfloat16", 127, 768, "amx", True, "auto", "AmxStream"),
    ("bfloat16", 128, 768, "amx", True, "auto", "AmxBlocked"),
    ("bfloat16", 127, 768, "amx_emulated", True, "auto", "AmxStreamEmulated"),
    ("bfloat16", 128, 768, "amx_emulated", False, "auto", "AmxBlockedEmulated"),
    ("bfloat16", 1, 768, "amx", True, "blocked", "AmxBlocked"),
    ("bfloat16", 4096, 768, "amx", True, "stream", "AmxStream"),
    ("bfloat16", 4096, 784, "amx", True, "auto", "StreamAvx512"),
    ("bfloat16", 1, 784, "amx_emulated", True, "blocked", "StreamAvx512"),
]

# (m, k, tier, avx_vnni, amx_gemm) -> path. Thresholds: AMX-int8 where k % 64 == 0, blocked from
# kAmxBlockedRowsInt8 = 1 row (every M) unless amx_gemm forces a kernel; avx512_vnni streams up to kStreamRows = 16
# rows.
INT8 = [
    (1, 768, "amx", False, "auto", "AmxBlocked"),
    (64, 768, "amx", False, "auto", "AmxBlocked"),
    (1, 768, "amx_emulated", False, "auto", "AmxBlockedEmulated"),
    (63, 768, "amx_emulated", False, "stream", "AmxStreamEmulated"),
    (1, 768, "amx", False, "stream", "AmxStream"),
    (4096, 768, "amx", False, "stream", "AmxStream"),
    (16, 784, "amx", False, "auto", "VnniStream"),
    (17, 784, "amx_emulated", False, "blocked", "VnniBlocked"),
    (16, 768, "avx512_vnni", False, "auto", "VnniStream"),
    (17, 768, "avx512_vnni", False, "auto", "VnniBlocked"),
    (17, 768, "avx512_vnni", True, "blocked", "VnniBlocked"),
    (1, 768, "avx2", True, "auto", "AvxVnni"),
    (4096, 768, "avx2", True, "auto", "AvxVnni"),
    (1, 768, "avx2", False, "auto", "Avx2"),
    (4096, 768, "avx2", False, "auto", "Avx2"),
    (1, 768, "portable", True, "auto", "Portable"),
    (4096, 768, "portable", False, "auto", "Portable"),
]

# (dtype, k, tier) -> path. Thresholds: bf16 on AMX tiles where k % kAmxK (32) == 0 on the AMX tiers; AVX-512
# register tiles from avx512_vnni up, plain loops below (avx2 too); bf16 elsewhere widened to fp32 first.
SPARSE_POOL = [
    ("bfloat16", 256, "amx", "Amx"),
    ("bfloat16", 768, "amx_emulated", "AmxEmulated"),
    ("bfloat16", 784, "amx", "WideAvx512"),
    ("bfloat16", 40, "amx_emulated", "WideAvx512"),
    ("bfloat16", 256, "avx512_vnni", "WideAvx512"),
    ("bfloat16", 256, "avx2", "WidePortable"),
    ("bfloat16", 256, "portable", "WidePortable"),
    ("float32", 256, "amx", "Avx512"),
    ("float32", 256, "amx_emulated", "Avx512"),
    ("float32", 256, "avx512_vnni", "Avx512"),
    ("float32", 256, "avx2", "Portable"),
    ("float32", 37, "portable", "Portable"),
]

# (dtype, head_dim, tier, AVX-512 BF16) -> path. Thresholds: bf16 on AMX tiles where head_dim % kAmxK (32) == 0 on
# the AMX tiers, else on vdpbf16ps where AVX-512 BF16 is there and head_dim is even; AVX-512 register blocks from
# avx512_vnni up, the plain loops compiled for AVX2 on avx2; bf16 elsewhere widened.
POSITION_SCORES = [
    ("bfloat16", 64, "amx", True, "Amx"),
    ("bfloat16", 32, "amx_emulated", True, "AmxEmulated"),
    ("bfloat16", 96, "amx_emulated", True, "AmxEmulated"),
    ("bfloat16", 48, "amx", True, "Avx512Bf16"),
    ("bfloat16", 24, "amx_emulated", True, "Avx512Bf16"),
    ("bfloat16", 25, "amx", True, "Avx512"),
    ("bfloat16", 64, "avx512_vnni", True, "Avx512Bf16"),
    ("bfloat16", 2, "avx512_vnni", True, "Avx512Bf16"),
    ("bfloat16", 63, "avx512_vnni", True, "Avx512"),
    ("bfloat16", 64, "avx512_vnni", False, "Avx512"),
    ("bfloat16", 64, "avx2", True, "Avx2"),
    ("bfloat16", 64, "portable", True, "Portable"),
    ("float32", 64, "amx", True, "Avx512"),
    ("float32", 64, "amx_emulated", True, "Avx512"),
    ("float32", 64, "avx512_vnni", True, "Avx512"),
    ("float32", 64, "avx2", True, "Avx2"),
    ("float32", 33, "portable", True, "Portable"),
]


def _id(row) -> str:
    return "-".join(str(v) for v in row)


# chooser's `_C.testing` function -> its table
TABLES = {"attention_path": ATTENTION, "gemm_path": GEMM, "int8_path": INT8, "sparse_pool_path": SPARSE_POOL,
          "position_scores_path": POSITION_SCORES}


@pytest.mark.parametrize("chooser,row", [(name, row) for name, table in TABLES.items() for row in table],
                         ids=lambda v: v if isinstance(v, str) else _id(v))
def test_chooser_table(chooser, row):
    *args, expected = row
    assert getattr(_C.testing, chooser)(*args) == expected


@pytest.mark.parametrize("table, paths", [
    (ATTENTION, {"Portable", "Avx2", "Avx512", "Avx512Bf16", "Int16", "Amx", "AmxEmulated"}),
    (GEMM, {"StreamPortable", "StreamAvx2", "StreamAvx512", "BlockedPortable", "BlockedAvx512", "BlockedBf16",
            "AmxStream", "AmxStreamEmulated", "AmxBlocked", "AmxBlockedEmulated"}),
    (INT8, {"AmxStream", "AmxStreamEmulated", "AmxBlocked", "AmxBlockedEmulated", "VnniStream", "VnniBlocked",
            "AvxVnni", "Avx2", "Portable"}),
    (SPARSE_POOL, {"Portable", "Avx512", "WidePortable", "WideAvx512", "Amx", "AmxEmulated"}),
    (POSITION_SCORES, {"Portable", "Avx2", "Avx512", "Avx512Bf16", "Amx", "AmxEmulated"}),
], ids=["attention", "gemm", "int8", "sparse_pool", "position_scores"])
def test_every_path_has_a_row(table, paths):
    assert {row[-1] for row in table} == paths


def test_choosers_refuse_unknown_names():
    with pytest.raises(ValueError, match="unknown ISA tier 'sse4'"):
        _C.testing.gemm_path("float32", 1, 64, "sse4")
    with pytest.raises(ValueError, match="dtype must be"):
        _C.testing.attention_path("float16", False, 64, False, 0, "avx2")
    with pytest.raises(ValueError, match="unknown AMX GEMM kernel 'fast'"):
        _C.testing.int8_path(1, 64, "amx", amx_gemm="fast")


# The main module: the ops, the classes they use, and what the product calls (ISA tiers, threads, the profiler of
# bertfast/profiling.py). A knob for tests or measurement goes to `_C.testing`, never here.
MAIN_EXPORTS = {
    "embeddings", "layernorm", "attention", "position_scores", "rotary_", "glu", "pack_linear", "linear",
    "sparse_pool", "pool_rows", "quantize_rows", "pack_int8", "quant_linear", "LoraTerm", "LoraSlot", "lora_shrink",
    "LayerWeights", "LayerCarry", "Layer", "WordPiece",
    "isa", "detected_isa", "requested_cap", "set_isa", "isa_supported", "has_avx512_bf16", "set_avx512_bf16", "has_avx_vnni",
    "num_threads", "set_num_threads", "profile_enable", "profile_counters",
    "testing",
}
TESTING_EXPORTS = {
    "amx_gemm", "set_amx_gemm", "amx_blocking", "set_amx_blocking", "activation_cache_stats", "bf16_conversions",
    "set_avx_vnni", "attention_path", "gemm_path", "int8_path", "sparse_pool_path",
    "position_scores_path",
}


def _public(module) -> set[str]:
    return {name for name in dir(module) if not name.startswith("_")}


def test_main_module_exports_the_ops_and_the_products_calls_only():
    assert _public(_C) == MAIN_EXPORTS


def test_testing_submodule_exports_the_knobs():
    assert _public(_C.testing) == TESTING_EXPORTS
