"""The triton backend's launch budget and its persistent layer, under the Triton interpreter.

A BERT forward of up to `layer.MAX_TOKENS` tokens runs each layer as one persistent kernel (`kernels.triton.layer`):
the launch counter (`tools.launches`) checks the kernels per forward against issue 55's budget of 30, and the
persistent path is checked bit for bit against the op-by-op kernels it replaces, also across the token threshold
that chooses between them (a row alone vs the same row in a batch past it).
"""

from __future__ import annotations

import dataclasses
import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

import bertfast  # noqa: E402
from bertfast.kernels import triton as ops  # noqa: E402
from bertfast.kernels.triton import layer  # noqa: E402
from bertfast.tools.launches import count_launches, forward_launches  # noqa: E402

pytestmark = pytest.mark.skipif(not ops.INTERPRET, reason="bertfast.kernels.triton was imported before "
                                "TRITON_INTERPRET=1 was set in this process, so its kernels were built for GPU")

BUDGET = 30  # kernels per BERT-base forward (issue 55)
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.float16, id="fp16")]


def _model(layers=2, hidden=32, heads=2, inter=64, act="gelu", seed=0):
    torch.manual_seed(seed)
    cfg = transformers.BertConfig(vocab_size=50, hidden_size=hidden, num_hidden_layers=layers,
                                  num_attention_heads=heads, intermediate_size=inter, hidden_act=act,
                                  max_position_embeddings=256)
    model = transformers.BertModel(cfg).eval()
    with torch.no_grad():  # biases and LayerNorms off their defaults, so every term of the layer counts
        for name, p in model.named_parameters():
            if name.endswith("bias") or "LayerNorm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def _batch(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    S = max(lengths)
    mask = (torch.arange(S)[None, :] < torch.tensor(lengths)[:, None]).long()
    return torch.randint(1, 50, (len(lengths), S), generator=g) * mask, mask


def _op_by_op(monkeypatch):
    monkeypatch.setattr(layer, "MAX_TOKENS", 0)


def test_small_forward_fits_the_launch_budget(monkeypatch):
    """BERT-base's 12 layers, b1 x s16: the layer stack is the embedding kernel, the counters' memset and one kernel
    per layer; the device's whole share of the call (pad and pooler included, the host's packing not) <= 30."""
    enc = bertfast.Encoder.from_hf(_model(layers=12), backend="triton", dtype=torch.float32)
    ids, mask = _batch([16])
    call, stack = forward_launches(enc, ids, mask)
    assert stack.triton == {"_bert_layer_kernel": 12, "_embedding_kernel": 1}, stack.summary()
    assert stack.kernels == 14 and stack.host_reads == 0, stack.summary()
    with torch.inference_mode(), count_launches() as pack:
        enc.engine._pack_on_device(ids, mask, None, None)
    device = call.kernels - pack.kernels
    assert device <= BUDGET, f"{device} kernels per forward past the packing: {call.summary()}"
    _op_by_op(monkeypatch)  # what the persistent layer replaces: the counter sees past the budget
    _, ops_stack = forward_launches(enc, ids, mask)
    assert ops_stack.kernels == 1 + 7 * 12 and ops_stack.triton["_bert_layer_kernel"] == 0, ops_stack.summary()


@pytest.mark.parametrize("dtype", DTYPES)
def test_persistent_layer_has_the_bits_of_the_ops(monkeypatch, dtype):
    """Ragged rows (length 1, several query blocks, token counts off every tile and LayerNorm item): last and every
    hidden state equal the op-by-op kernels' bit for bit."""
    enc = bertfast.Encoder.from_hf(_model(act="gelu_new"), backend="triton", dtype=dtype)
    ids, mask = _batch([1, 130, 7, 67])
    with count_launches() as launches:
        whole = enc(ids, attention_mask=mask, output_hidden_states=True)
    assert launches.triton["_bert_layer_kernel"] == 2
    _op_by_op(monkeypatch)
    with count_launches() as launches:
        composed = enc(ids, attention_mask=mask, output_hidden_states=True)
    assert launches.triton["_bert_layer_kernel"] == 0 and launches.triton["_attention_kernel"] == 2
    for a, b in zip(whole.hidden_states, composed.hidden_states):
        assert torch.equal(a, b)
    assert torch.equal(whole.pooler_output, composed.pooler_output)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_row_keeps_its_bits_across_the_token_threshold(dtype):
    """A row alone runs the persistent layer; in a batch of more than MAX_TOKENS tokens, the op-by-op kernels: the
    same bits."""
    enc = bertfast.Encoder.from_hf(_model(), backend="triton", dtype=dtype)
    lengths = [45, 200, 190, 150]
    assert sum(lengths) > layer.MAX_TOKENS >= max(lengths)
    ids, mask = _batch(lengths)
    with count_launches() as launches:
        batch = enc(ids, attention_mask=mask).last_hidden_state
    assert launches.triton["_bert_layer_kernel"] == 0
    for row in (0, 1):
        n = lengths[row]
        with count_launches() as launches:
            alone = enc(ids[row:row + 1, :n], attention_mask=mask[row:row + 1, :n]).last_hidden_state
        assert launches.triton["_bert_layer_kernel"] == 2
        assert torch.equal(alone[0], batch[row, :n])


def test_bert_layer_refuses_what_it_cannot_run():
    w = bertfast.loading.load_hf_model(_model(layers=1), torch.float32)
    lw = w.layers[0]
    cu = torch.tensor([0, 4], dtype=torch.int32)
    work = torch.zeros(1 + layer.PHASES, dtype=torch.int32)
    x = torch.randn(4, 32)
    with pytest.raises(ValueError, match=r"do not fit the persistent layer \(1\.\.512 contiguous tokens"):
        layer.bert_layer(torch.randn(layer.MAX_TOKENS + 1, 32), lw, cu, 4, 2, 0.25, 1e-12, "gelu", work)
    with pytest.raises(ValueError, match="work must be 8 int32 counters"):
        layer.bert_layer(x, lw, cu, 4, 2, 0.25, 1e-12, "gelu", work[:4])
    with pytest.raises(ValueError, match="needs every weight and bias"):
        layer.bert_layer(x, dataclasses.replace(lw, qkv_bias=None), cu, 4, 2, 0.25, 1e-12, "gelu", work)
    y = layer.bert_layer(x, lw, cu, 4, 2, 0.25, 1e-12, "gelu", work)
    # Every phase's items finished (QKV: 2 column tiles of 64; attention: 2 heads), and each of the interpreter's two
    # programs claimed once past the last of the 9 items.
    assert y.shape == (4, 32) and work.tolist() == [9 + 2, 2, 2, 1, 1, 1, 1, 1]


def test_count_launches_counts_kernels_not_views():
    x, w, b = torch.randn(8, 32), torch.ones(32), torch.zeros(32)
    with count_launches() as launches:
        y = ops.layernorm.layernorm(x, w, b, 1e-5)
        y.view(4, 64).t()[0]  # views: no kernel
        torch.empty(3)  # an allocation: no kernel
        (y + 1).sum().item()  # two kernels and a host read
    assert launches.triton == {"_layernorm_kernel": 1}
    assert launches.torch == {"add": 1, "sum": 1} and launches.host_reads == 1
    assert launches.kernels == 3
