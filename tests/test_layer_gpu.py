"""The persistent layer on a GPU (`kernels.triton.layer`): the bits of the op-by-op kernels at the same token count,
a row alone (persistent) equal to the same row in a batch past `layer.MAX_TOKENS` (op by op), in fp32, fp16 and bf16
on a BERT-base-shaped layer stack; and the kernels one graphed b1 x s16 forward replays, counted by torch.profiler.

The test session runs Triton under the interpreter (tests/conftest.py), so the checks run in a child process with the
interpreter off, printing one JSON line each; skipped without CUDA. `tests/test_launches.py` checks the same under the
interpreter.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from helpers.gpu_child import compiled_rows

BUDGET = 30  # kernels per BERT-base forward (issue 55)


def _checks():
    """Child process body (CUDA, compiled kernels)."""
    import conftest
    from bertfast import Encoder
    from bertfast.kernels.triton import INTERPRET, layer

    assert not INTERPRET
    model = conftest.hf_bert(hidden_size=768, num_attention_heads=12, intermediate_size=3072, num_hidden_layers=2,
                             max_position_embeddings=512).cuda()
    lengths = [1, 130, 7, 67, 300, 45]
    for name in ("float32", "float16", "bfloat16"):
        enc = Encoder.from_hf(model, backend="triton", dtype=getattr(torch, name), graphs=False)

        def call(rows, max_tokens=layer.MAX_TOKENS):
            old, layer.MAX_TOKENS = layer.MAX_TOKENS, max_tokens
            try:
                ids, mask, types = (t.cuda() for t in conftest.ragged_batch(rows, vocab=97))
                return enc(ids, mask, types).last_hidden_state
            finally:
                layer.MAX_TOKENS = old

        small = lengths[:4]
        a, b = call(small), call(small, max_tokens=0)
        print(json.dumps({"check": "same-T", "dtype": name, "equal": torch.equal(a, b),
                          "max_diff": (a.float() - b.float()).abs().max().item()}), flush=True)
        batch = call(lengths)  # 550 tokens: op by op
        for row in (0, 1, 4):
            alone = call([lengths[row]])[0]
            same = torch.equal(alone, batch[row, :lengths[row]])
            print(json.dumps({"check": f"row{row}-across-threshold", "dtype": name, "equal": same}), flush=True)
    bert_base = conftest.hf_bert(hidden_size=768, num_attention_heads=12, intermediate_size=3072,
                                 num_hidden_layers=12, max_position_embeddings=512).cuda()
    enc = Encoder.from_hf(bert_base, backend="triton", dtype=torch.float16, graphs=True)
    ids, mask, types = (t.cuda() for t in conftest.ragged_batch([16], vocab=97))
    for _ in range(3):
        enc(ids, mask, types)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        enc(ids, mask, types)
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    print(json.dumps({"check": "kernels-b1xs16", "kernels": len(kernels),
                      "names": sorted({e.name for e in kernels})[:40]}), flush=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available())")
def test_persistent_layer_on_gpu():
    rows = compiled_rows("test_layer_gpu", "_checks")
    assert len(rows) == 3 * 4 + 1
    for row in rows[:-1]:
        assert row["equal"], row
    assert rows[-1]["kernels"] <= BUDGET, rows[-1]
