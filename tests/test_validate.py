"""`bertfast validate`: the torch backend passes the op sweep and the model check, and the checker
fails deliberately broken backends (naming the broken op, exiting non-zero) while passing a correct
backend that computes differently (fp32 epilogues, blocked accumulation)."""

from __future__ import annotations

import re

import pytest
import torch

from bertfast import reference
from bertfast.backends import REGISTRY
from bertfast.backends.torch import TorchBackend
from bertfast.tools.cli import main
from bertfast.accuracy import TABLE, judge
from bertfast.tools.validate.cases import OP_NAMES, op_cases
from bertfast.tools.validate.model_check import run_model_check
from bertfast.tools.validate.sweep import run_op_sweep

from conftest import hf_bert

ALL_DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
HEADER = ("op", "shape", "dtype", "max abs err", "max rel err", "ref rel err", "tolerance", "pass")
ROW = re.compile(r"^(\S+)\s+(\S+)\s+(fp32|fp16|bf16|fp64)\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)\s+(PASS|FAIL|SKIP)\b")


def table_rows(text: str) -> list[tuple]:
    return [m.groups() for m in map(ROW.match, text.splitlines()) if m]


# ----------------------------------------------------------------------------------------------
# Backends for the tests: broken ones the checker must catch, a correct-but-different one it must pass.


class BrokenLayerNormEps(TorchBackend):
    """LayerNorm with eps 1e-5 whatever it is given (BERT passes 1e-12)."""

    name = "broken-ln-eps"

    @staticmethod
    def layernorm(x, weight, bias, eps):
        return reference.layernorm(x, weight, bias, 1e-5)


class CrossSequenceAttention(TorchBackend):
    """Attention that lets every token see every other sequence's tokens (ignores cu_seqlens)."""

    name = "broken-attention"

    @staticmethod
    def attention(q, k, v, cu_seqlens, max_seqlen, scale, bias=None):
        whole = torch.tensor([0, q.shape[0]], dtype=torch.int32, device=q.device)
        return reference.attention(q, k, v, whole, q.shape[0], scale)


class TanhGeluForErfGelu(TorchBackend):
    """Uses the tanh approximation when asked for exact GELU (a ~1e-3 absolute difference)."""

    name = "broken-gelu"

    @staticmethod
    def linear(x, weight, bias, act="none", residual=None):
        return TorchBackend.linear(x, weight, bias, "gelu_tanh" if act == "gelu" else act, residual)


class CrashingQkv(TorchBackend):
    name = "crashing-qkv"

    @staticmethod
    def qkv(x, weight, bias, num_heads):
        raise RuntimeError("kernel launch failed")


class RejectsStrided(TorchBackend):
    """Refuses non-contiguous activations with a ValueError, as a strict launcher may."""

    name = "rejects-strided"

    @staticmethod
    def layernorm(x, weight, bias, eps):
        if not x.is_contiguous():
            raise ValueError("layernorm: x must be contiguous")
        return reference.layernorm(x, weight, bias, eps)


class Nowhere(TorchBackend):
    name = "nowhere"

    @classmethod
    def unavailable_reason(cls, device):
        return "needs hardware this machine does not have"


class PrepareRefusesBf16(TorchBackend):
    """Lists bf16 in `dtypes` but refuses it in prepare (as the triton backend does under the
    interpreter): the whole dtype is a skip."""

    name = "prepare-refuses-bf16"

    def prepare(self, weights):
        if weights.dtype == torch.bfloat16:
            raise ValueError("no bf16 on this device")
        return super().prepare(weights)


class PrepareRefusesHeadDim26(TorchBackend):
    """Refuses one head dim in prepare: that is a failure of those cases, not a skip."""

    name = "prepare-refuses-d26"

    def prepare(self, weights):
        if weights.config.head_dim == 26:
            raise ValueError("head dim 26 is not supported")
        return super().prepare(weights)


class Fp16Only(TorchBackend):
    name = "fp16-only"
    dtypes = (torch.float16,)


def _blocked_linear(x, weight, bias, block_k=32):
    """fp32 accumulation over K in blocks, as a tiled GEMM kernel sums."""
    acc = torch.zeros(x.shape[0], weight.shape[0], dtype=torch.float32, device=x.device)
    for k in range(0, x.shape[1], block_k):
        acc += x[:, k:k + block_k].float() @ weight[:, k:k + block_k].float().T
    return acc + bias.float()


class Fp32Epilogue(TorchBackend):
    """Correct, but not the reference's arithmetic: blocked fp32 accumulation, activation / residual
    / tanh in fp32, one rounding at the end; attention and LayerNorm computed in fp32 and rounded."""

    name = "fp32-epilogue"

    @staticmethod
    def qkv(x, weight, bias, num_heads):
        out = _blocked_linear(x, weight, bias).to(x.dtype).view(x.shape[0], 3, num_heads, -1)
        return out[:, 0], out[:, 1], out[:, 2]

    @staticmethod
    def linear(x, weight, bias, act="none", residual=None):
        out = reference.activation(_blocked_linear(x, weight, bias), act)
        return (out if residual is None else out + residual.float()).to(x.dtype)

    @staticmethod
    def attention(q, k, v, cu_seqlens, max_seqlen, scale, bias=None):
        return reference.attention(q.float(), k.float(), v.float(), cu_seqlens, max_seqlen, scale, bias).to(q.dtype)

    @staticmethod
    def layernorm(x, weight, bias, eps):
        return reference.layernorm(x.float(), weight.float(), bias.float(), eps).to(x.dtype)


@pytest.fixture
def registered(monkeypatch):
    """Register a test backend class under its name, so the CLI path (`--backend NAME`) reaches it."""

    def register(cls):
        monkeypatch.setitem(REGISTRY, cls.name, f"{__name__}:{cls.__name__}")
        return cls.name

    return register


# ----------------------------------------------------------------------------------------------
# The sweep


def test_torch_backend_sweep_passes_and_prints_the_table(capsys):
    code = main(["validate", "--backend", "torch"])
    out = capsys.readouterr().out
    assert code == 0, out
    lines = out.splitlines()
    header = next(line for line in lines if line.startswith("op "))
    assert re.split(r"\s{2,}", header.strip()) == list(HEADER)
    rows = table_rows(out)
    cases = op_cases()
    assert len(rows) == 3 * len(cases)
    assert {r[0] for r in rows} == set(OP_NAMES)
    assert {r[2] for r in rows} == {"fp32", "fp16", "bf16"}
    assert all(r[7] == "PASS" for r in rows)
    for op, shape, dtype, abs_err, rel_err, ref_err, tol, _ in rows:
        abs_err, rel, ref, tol = map(float, (abs_err, rel_err, ref_err, tol))
        table = TABLE[DTYPES[dtype]]
        assert abs_err >= 0 and 0 <= rel <= tol
        # Tolerance is 2x the reference's error plus a floor, capped by the table unless the
        # reference itself is beyond it.
        assert tol <= table or ref > table, (op, shape, dtype)
        assert tol >= min(2 * ref, table)
    assert f"{3 * len(cases)} passed, 0 failed, 0 skipped" in out


def test_sweep_covers_the_awkward_shapes():
    labels = {(c.op, c.label) for c in op_cases()}
    text = " ".join(label for _, label in labels)
    for length in ("T1-", "T7-", "T63-", "T65-", "T129-"):
        assert length in text
    for d in (26, 32, 64, 80, 128):
        assert any(op == "attention" and f"-d{d}" in lab for op, lab in labels), d
    assert ("attention", "cu0-1-17-80-81-h2-d32") in labels
    assert any(op == "attention" and "-0-" in lab for op, lab in labels)  # an empty sequence
    assert any(op == "layernorm" and "offset" in lab for op, lab in labels)
    for op in ("qkv", "attention", "linear_gelu", "linear_residual", "layernorm", "pooler"):
        assert any(c.op == op and c.noncontig for c in op_cases()), op
    for act in ("gelu", "gelu_tanh", "relu"):
        assert any(op == "linear_gelu" and lab.endswith(act) for op, lab in labels)
    quick = op_cases(quick=True)
    assert {c.op for c in quick} == set(OP_NAMES) and len(quick) < len(op_cases())


def test_noncontiguous_inputs_really_are_noncontiguous():
    for case in op_cases():
        if not case.noncontig:
            continue
        inputs = case.make(torch.Generator().manual_seed(0), lambda t: t.to(torch.float16))
        assert any(torch.is_tensor(t) and t.is_floating_point() and not t.is_contiguous()
                   for t in inputs.values()), case.label


@pytest.mark.parametrize("backend_cls, broken_op, dtypes", [
    pytest.param(BrokenLayerNormEps, "layernorm", ALL_DTYPES, id="layernorm-wrong-eps"),
    pytest.param(CrossSequenceAttention, "attention", ALL_DTYPES, id="attention-crosses-sequences"),
    pytest.param(TanhGeluForErfGelu, "linear_gelu", [torch.float32], id="gelu-tanh-for-erf-fp32"),
])
def test_sweep_fails_a_broken_backend(backend_cls, broken_op, dtypes):
    rows = run_op_sweep(backend_cls(), dtypes, ops=[broken_op, "pooler"])
    failed = [r for r in rows if r.status == "FAIL"]
    assert failed, "the checker passed a broken backend"
    assert {r.op for r in failed} == {broken_op}
    assert {DTYPES[r.dtype] for r in failed} == set(dtypes)
    others = [r for r in rows if r.op != broken_op]
    assert others and all(r.status == "PASS" for r in others)


def test_cli_exits_nonzero_on_a_broken_backend(registered, capsys):
    name = registered(BrokenLayerNormEps)
    code = main(["validate", "--backend", name, "--dtype", "fp32", "--ops", "layernorm,pooler"])
    out = capsys.readouterr().out
    assert code == 1
    rows = table_rows(out)
    assert {r[0] for r in rows} == {"layernorm", "pooler"}
    assert any(r[0] == "layernorm" and r[7] == "FAIL" for r in rows)
    pooler = [r for r in rows if r[0] == "pooler"]
    assert pooler and all(r[7] == "PASS" for r in pooler)
    assert re.search(r"\d+ passed, [1-9]\d* failed", out)


def test_a_correct_backend_with_different_arithmetic_passes():
    """Guards against tolerances so tight that a legitimate fused kernel would fail them."""
    ops = [op for op in OP_NAMES if op != "embeddings"]  # the one op it leaves to the reference
    rows = run_op_sweep(Fp32Epilogue(), [torch.float32, torch.bfloat16], ops=ops)
    # fp16 matmuls are slow on CPU: the quick sweep holds the same floor logic at less cost.
    rows += run_op_sweep(Fp32Epilogue(), [torch.float16], quick=True, ops=ops)
    assert rows and all(r.status == "PASS" for r in rows), [r for r in rows if r.status != "PASS"]


def test_an_op_that_raises_is_a_failure_and_the_sweep_goes_on():
    rows = run_op_sweep(CrashingQkv(), [torch.float32], ops=["qkv", "pooler"])
    qkv, pooler = [r for r in rows if r.op == "qkv"], [r for r in rows if r.op == "pooler"]
    assert qkv and all(r.status == "FAIL" and "kernel launch failed" in r.note for r in qkv)
    assert pooler and all(r.status == "PASS" for r in pooler)


def test_rejecting_a_strided_input_with_valueerror_is_a_skip_with_the_reason():
    rows = run_op_sweep(RejectsStrided(), [torch.float32], ops=["layernorm"])
    skipped = [r for r in rows if r.status == "SKIP"]
    assert skipped and all("strided" in r.shape and "must be contiguous" in r.note for r in skipped)
    plain = [r for r in rows if "strided" not in r.shape]
    assert plain and all(r.status == "PASS" for r in plain)


def test_unsupported_dtypes_are_skipped_with_the_reason(registered, capsys):
    name = registered(Fp16Only)
    code = main(["validate", "--backend", name, "--quick", "--dtype", "fp32,fp16"])
    out = capsys.readouterr().out
    assert code == 0, out
    skip = [r for r in table_rows(out) if r[7] == "SKIP"]
    assert len(skip) == 1 and skip[0][2] == "fp32"
    assert "does not support dtype torch.float32" in out
    fp16 = [r for r in table_rows(out) if r[2] == "fp16"]
    assert fp16 and all(r[7] == "PASS" for r in fp16)
    # Nothing left to check is a usage error, not a pass.
    assert main(["validate", "--backend", name, "--dtype", "bf16"]) == 2


def test_a_dtype_refused_by_prepare_is_skipped_but_a_refused_shape_fails():
    rows = run_op_sweep(PrepareRefusesBf16(), [torch.float32, torch.bfloat16], ops=["pooler"])
    assert [(r.dtype, r.status) for r in rows if r.dtype == "bf16"] == [("bf16", "SKIP")]
    assert "no bf16 on this device" in rows[-1].note
    rows = run_op_sweep(PrepareRefusesHeadDim26(), [torch.float32], ops=["qkv", "attention"])
    failed = [r for r in rows if r.status == "FAIL"]
    assert failed and all("-d26" in r.shape and "head dim 26" in r.note for r in failed)
    assert all(r.status == "PASS" for r in rows if "-d26" not in r.shape)


def test_judge_fails_nan_and_does_not_trust_an_overflowing_reference():
    oracle = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    nan = judge("op", "s", torch.float16, torch.tensor([float("nan"), -2.0, 0.5]).half(), oracle.half(), oracle)
    assert nan.status == "FAIL" and "non-finite" in nan.note
    off = torch.tensor([1.0, -2.0, 0.6]).half()  # 5% of max |oracle| off
    overflow = judge("op", "s", torch.float16, off, torch.tensor([float("inf"), -2.0, 0.5]).half(), oracle)
    assert overflow.status == "FAIL" and overflow.tol == TABLE[torch.float16]


@pytest.mark.parametrize("argv, message", [
    pytest.param(["--backend", "nope"], "unknown backend 'nope'", id="unknown-backend"),
    pytest.param(["--backend", "torch", "--dtype", "fp8"], "dtype 'fp8' is not supported", id="bad-dtype"),
    pytest.param(["--backend", "torch", "--ops", "softmax"], "unknown op(s) softmax", id="bad-op"),
    pytest.param(["--backend", "torch", "--model", "/nonexistent/model"], "does not exist", id="missing-model"),
    pytest.param(["--backend", "torch", "--model", "default", "--ops", "qkv"], "do not apply with --model",
                 id="ops-with-model"),
])
def test_bad_usage_exits_2_with_a_message(argv, message, capsys):
    assert main(["validate", *argv]) == 2
    assert message in capsys.readouterr().err


def test_unavailable_backend_exits_2(registered, capsys):
    assert main(["validate", "--backend", registered(Nowhere)]) == 2
    assert "needs hardware this machine does not have" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------
# The model check


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    """A random 2-layer BERT (head dim 26, 40 positions) saved without a tokenizer."""
    path = tmp_path_factory.mktemp("tiny-bert")
    hf_bert(seed=3, hidden_size=78, num_attention_heads=3, max_position_embeddings=40).save_pretrained(path)
    return str(path)


def test_model_check_on_a_tiny_random_checkpoint(tiny_checkpoint, capsys):
    code = main(["validate", "--backend", "torch", "--model", tiny_checkpoint])
    out = capsys.readouterr().out
    assert code == 0, out
    rows = table_rows(out)
    stages = ["embeddings", "layer1", "layer2", "pooler"]
    assert [r[0] for r in rows] == stages * 3
    assert all(r[1].startswith("random-ids-") for r in rows)  # no tokenizer in the directory
    assert all(r[7] == "PASS" for r in rows)
    assert "2 layers, hidden 78, 3 heads" in out


def test_model_check_localises_a_broken_op_to_its_layers(tiny_checkpoint):
    from bertfast.loading import load_pretrained

    weights = load_pretrained(tiny_checkpoint)
    rows = run_model_check(CrossSequenceAttention(), weights, tiny_checkpoint, [torch.float32])
    status = {r.op: r.status for r in rows}
    assert status == {"embeddings": "PASS", "layer1": "FAIL", "layer2": "FAIL", "pooler": "FAIL"}


def test_model_check_exit_code_on_a_broken_backend(tiny_checkpoint, registered, capsys):
    name = registered(CrossSequenceAttention)
    assert main(["validate", "--backend", name, "--model", tiny_checkpoint, "--dtype", "fp16"]) == 1
    assert "FAIL" in capsys.readouterr().out


def test_model_check_on_the_default_model(minilm_path, capsys):
    # fp16 is covered on the tiny checkpoint; on CPU it is the slow dtype for a 6-layer model.
    code = main(["validate", "--backend", "torch", "--model", "default", "--dtype", "fp32,bf16"])
    out = capsys.readouterr().out
    assert code == 0, out
    rows = table_rows(out)
    assert len(rows) == 2 * (1 + 6 + 1)
    assert all(r[1].startswith("sentences-") for r in rows)  # the real tokenizer was used
    assert all(r[7] == "PASS" for r in rows)


def test_a_command_that_cannot_load_says_why(monkeypatch, capsys):
    """A command whose module fails to import exits 2 naming the import error (on one host `bertfast validate` said
    only "not available in this build")."""
    import bertfast.tools.cli as cli

    monkeypatch.setitem(cli.COMMANDS, "nothere", ("bertfast.tools.no_such_module", "a command that cannot load"))
    assert cli.main(["nothere"]) == 2
    err = capsys.readouterr().err
    assert "bertfast nothere: not available in this build" in err
    assert "No module named 'bertfast.tools.no_such_module'" in err


# ----------------------------------------------------------------------------------------------
# The model check with a LoRA adapter (--adapter)


class DroppedLora(TorchBackend):
    """Computes every LoRA term and then adds nothing (the base model's output on the adapter's rows)."""

    name = "broken-lora"

    def lora(self, x, index, factors, groups):
        return torch.zeros_like(super().lora(x, index, factors, groups))


@pytest.fixture(scope="module")
def tiny_lora(tiny_checkpoint, tmp_path_factory):
    """A PEFT LoRA on every slot of the tiny checkpoint (its pooler included), both factors random."""
    import transformers
    from helpers.adapters import save_lora

    path = tmp_path_factory.mktemp("tiny-lora")
    save_lora(transformers.BertModel.from_pretrained(tiny_checkpoint).eval(), path, seed=4, r=4, lora_alpha=8,
              target_modules=["query", "key", "value", "dense"])
    return str(path)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_model_check_with_an_adapter(tiny_checkpoint, tiny_lora, backend, capsys):
    """Every other row on the adapter, judged against the reference forward with it: every stage passes in fp32 and bf16."""
    code = main(["validate", "--backend", backend, "--model", tiny_checkpoint, "--adapter", tiny_lora,
                 "--dtype", "fp32,bf16"])
    out = capsys.readouterr().out
    assert code == 0, out
    rows = table_rows(out)
    assert [r[0] for r in rows] == ["embeddings", "layer1", "layer2", "pooler"] * 2
    assert all(r[1].endswith("-lora3of5") and r[7] == "PASS" for r in rows)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_model_check_with_an_embedding_table_adapter(tiny_checkpoint, tmp_path, backend, capsys):
    """LoRA on the word, position and token-type tables (and query): every stage passes against the reference forward
    with the tables' terms, in fp32 and bf16 (either side without the terms fails from the embeddings on)."""
    import transformers
    from helpers.adapters import save_lora

    save_lora(transformers.BertModel.from_pretrained(tiny_checkpoint).eval(), tmp_path, seed=5, r=4, lora_alpha=8,
              target_modules=["word_embeddings", "position_embeddings", "token_type_embeddings", "query"])
    code = main(["validate", "--backend", backend, "--model", tiny_checkpoint, "--adapter", str(tmp_path),
                 "--dtype", "fp32,bf16"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert all(r[1].endswith("-lora3of5") and r[7] == "PASS" for r in table_rows(out))


def test_model_check_fails_a_backend_that_drops_the_adapter(tiny_checkpoint, tiny_lora, registered, capsys):
    """A backend running the base model on the adapter's rows fails from the first adapted layer on; the embeddings,
    which the adapter does not touch, pass."""
    code = main(["validate", "--backend", registered(DroppedLora), "--model", tiny_checkpoint, "--adapter",
                 tiny_lora, "--dtype", "fp32"])
    out = capsys.readouterr().out
    assert code == 1, out
    status = {r[0]: r[7] for r in table_rows(out)}
    assert status == {"embeddings": "PASS", "layer1": "FAIL", "layer2": "FAIL", "pooler": "FAIL"}, out


def test_adapter_usage_errors(tiny_checkpoint, tiny_lora, tmp_path, capsys):
    assert main(["validate", "--backend", "torch", "--adapter", tiny_lora]) == 2
    assert "--adapter needs --model DIR" in capsys.readouterr().err
    assert main(["validate", "--model", tiny_checkpoint, "--adapter", tiny_lora, "--dtype", "int8"]) == 2
    assert "the int8 report takes none" in capsys.readouterr().err
    other = tmp_path / "other"
    hf_bert(seed=5, hidden_size=64, num_attention_heads=4, max_position_embeddings=40).save_pretrained(other)
    assert main(["validate", "--backend", "torch", "--model", str(other), "--adapter", tiny_lora]) == 2
    err = capsys.readouterr().err
    assert "shape" in err and "bertfast validate:" in err, err
