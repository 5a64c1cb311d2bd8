"""dtype="fp8" end to end on the triton backend, under the Triton interpreter: the accuracy rule of issue 55 (sentence
embeddings of the real all-MiniLM-L6-v2 against fp32; a classifier's argmax against fp32), batch invariance, and the
plumbing (the dtype's split, the backend "auto" picks, what `prepare` quantizes and refuses).

The interpreter runs the same kernels as the GPU (the codes by integer arithmetic, tl.dot on float8e4nv operands as
an fp32 matmul of the exactly decoded codes: tests/ops/triton/test_fp8.py), so the accuracy here is the scheme's; the
GPU's fp8 MMA accumulation is not exercised. MiniLM: one forward of 8 sentences, ~25 s on a 2-core CPU.
"""

from __future__ import annotations

import dataclasses
import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

import bertfast  # noqa: E402
from bertfast.backends import get_backend  # noqa: E402
from bertfast.backends.cuda.triton import TritonBackend  # noqa: E402
from bertfast.encoder import split_quantization  # noqa: E402
from bertfast.loading import load_hf_model  # noqa: E402

_ops = pytest.importorskip("bertfast.kernels.triton")
pytestmark = pytest.mark.skipif(not _ops.INTERPRET, reason="bertfast.kernels.triton was imported before "
                                "TRITON_INTERPRET=1 was set in this process, so its kernels were built for GPU")

from bertfast.kernels.triton import fp8  # noqa: E402
from conftest import hf_bert  # noqa: E402

SENTENCES = ["The cat sat on the mat.", "A quick brown fox jumps over the lazy dog.",
             "Vector search engines index embeddings.", "It rained all day in the mountains.",
             "She plays the violin beautifully.", "Stock markets fell sharply on Monday.",
             "How do I reset my password?", "The river flows into the sea."]
# The issue's rule for sentence embeddings. The scheme it specifies (e4m3, weights per output channel, activations per
# token, symmetric amax / 448) reaches mean cosine 0.9975 here (a torch emulation of it: 0.9977 over the 202 sentences
# of bertfast/tools/validate/sentences.py), so this holds as the regression bar below and the rule is kept as xfail.
# Finer activation scales (1x128 blocks), SmoothQuant and FFN-out in fp16 stay below 0.999 too: docs/backends.md.
ISSUE_MEAN_COSINE = 0.999
MEAN_COSINE = 0.997
MIN_COSINE = 0.995
ARGMAX_AGREEMENT = 0.99


@pytest.fixture(scope="module")
def minilm_cosines(minilm_path):
    fp32 = bertfast.Encoder.from_pretrained(minilm_path, backend="torch", dtype=torch.float32).encode(SENTENCES)
    encoder = bertfast.Encoder.from_pretrained(minilm_path, backend="triton", dtype="fp8")
    assert encoder.quantize == "fp8" and encoder.dtype == torch.float16
    ours = encoder.encode(SENTENCES)
    return torch.nn.functional.cosine_similarity(ours.double(), fp32.double(), dim=-1)


def test_minilm_sentence_embeddings(minilm_cosines):
    """all-MiniLM-L6-v2's embeddings of 8 sentences in fp8 vs fp32: measured mean 0.99754, min 0.99688 (this CPU,
    Triton 3.9's interpreter)."""
    assert minilm_cosines.mean() >= MEAN_COSINE and minilm_cosines.min() >= MIN_COSINE, minilm_cosines.tolist()


@pytest.mark.xfail(strict=True, reason="the issue's mean cosine >= 0.999 is beyond the specified scheme on MiniLM "
                   "(0.9975 measured; see docs/backends.md#fp8-e4m3)")
def test_minilm_meets_the_issue_rule(minilm_cosines):
    assert minilm_cosines.mean() >= ISSUE_MEAN_COSINE


def test_classifier_argmax_agrees_with_fp32(tmp_path):
    """A random BertForSequenceClassification (3 labels): argmax of 256 short rows in fp8 vs the transformers model in
    fp32 (measured: all agree); and a row's logits alone are the bits it gets inside the batch."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=97, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=128, max_position_embeddings=40, num_labels=3)
    model = transformers.BertForSequenceClassification(cfg).eval()
    with torch.no_grad():  # random init leaves LayerNorm at identity and biases at zero: perturb them
        for name, p in model.named_parameters():
            if "LayerNorm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(tmp_path)
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(2, 7, (256,), generator=g)
    mask = (torch.arange(int(lengths.max()))[None] < lengths[:, None]).long()
    ids = torch.randint(1, 97, mask.shape, generator=g) * mask
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).logits
    ours = bertfast.load(tmp_path, backend="triton", dtype="fp8")
    assert ours.encoder.quantize == "fp8"
    logits = ours(ids, mask).logits
    agreement = (logits.argmax(-1) == want.argmax(-1)).double().mean().item()
    assert agreement >= ARGMAX_AGREEMENT, f"argmax agreement {agreement:.4f}"
    for i in (0, 255):
        n = int(lengths[i])
        alone = ours(ids[i:i + 1, :n], mask[i:i + 1, :n]).logits
        assert torch.equal(alone[0], logits[i]), f"row {i}: alone != inside the batch"


# ---- plumbing ----


def test_split_quantization_and_auto():
    assert split_quantization("fp8") == (torch.float16, "fp8")
    assert split_quantization(torch.float8_e4m3fn) == (torch.float16, "fp8")
    assert isinstance(get_backend("auto", "cuda", "fp8"), TritonBackend)
    assert get_backend("triton", "cpu", "fp8").quantize == "fp8"
    with pytest.raises(ValueError, match="fp8"):  # auto on CPU: the cpu and torch backends offer no fp8
        get_backend("auto", "cpu", "fp8")
    with pytest.raises(ValueError, match="fp8"):
        get_backend("torch", "cpu", "fp8")


def _weights(dtype=torch.float16, **config):
    weights = load_hf_model(hf_bert(), dtype)
    return dataclasses.replace(weights, config=dataclasses.replace(weights.config, **config)) if config else weights


def test_prepare_quantizes_the_four_gemms():
    prepared = TritonBackend(quantize="fp8").prepare(_weights())
    for layer in prepared.layers:
        for name in TritonBackend.FP8_GEMMS:
            w = getattr(layer, name)
            assert isinstance(w, fp8.Fp8Weight) and w.codes.dtype == torch.float8_e4m3fn
        assert layer.qkv_bias.dtype == torch.float16 and layer.attn_ln_weight.dtype == torch.float16
    assert torch.is_tensor(prepared.pooler_weight) and prepared.embeddings.word.dtype == torch.float16


@pytest.mark.parametrize("dtype,config,match", [
    pytest.param(torch.float32, {}, "float16 weights", id="fp32-weights"),
    pytest.param(torch.float16, {"rope_theta": 10000.0}, "rotary", id="rotary"),
    pytest.param(torch.float16, {"gated_ffn": True}, "gated", id="gated"),
])
def test_prepare_refuses(dtype, config, match):
    with pytest.raises(ValueError, match=match):
        TritonBackend(quantize="fp8").prepare(_weights(dtype, **config))


def test_prepare_checks_the_gpu_generation(monkeypatch):
    """`prepare` asks fp8.check_arch about the weights' device before quantizing anything (the check itself, with a
    monkeypatched capability: tests/ops/triton/test_fp8.py)."""
    seen = []

    def refuse(device):
        seen.append(torch.device(device))
        raise ValueError("fp8 (e4m3) needs a GPU of compute capability 8.9 or later")

    monkeypatch.setattr(fp8, "check_arch", refuse)
    monkeypatch.setattr(fp8, "quantize_weight", lambda w: pytest.fail("quantized before the check"))
    with pytest.raises(ValueError, match="8.9 or later"):
        TritonBackend(quantize="fp8").prepare(_weights())
    assert seen == [torch.device("cpu")]
