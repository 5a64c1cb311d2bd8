"""LoRA adapters per row on a GPU (the triton backend's segmented shrink and expand kernels, `kernels.triton.lora`,
and the GEMM kernels' addend; the word table's term, `adapters_embeddings`): a BERT-base-shaped two-layer model, four
adapters of rank 16 on the word embeddings, query, key, value and every dense, a ragged batch of 550 tokens mixing
them with base rows.

- fp32 within 1e-5 (relative) of the float64 forward of each row's merged model (W + scale B A);
- fp16 and bf16 within twice the error of that merged model run by transformers in the same dtype (PEFT may be absent
  on the GPU machine);
- a row alone equals the same row in the mixed batch, bit for bit (the batch crosses the GEMMs' autotune buckets).

The session runs Triton under the interpreter (tests/conftest.py), so the checks run in a child process with the
interpreter off, printing one JSON line each; skipped without CUDA. `tests/test_adapters_forward.py` checks the same
kernels under the interpreter.
"""

from __future__ import annotations

import copy
import json
import os
import tempfile

import pytest
import torch

from bertfast.adapters_peft import write_peft_dir
from helpers.gpu_child import compiled_rows

RANK, ALPHA = 16, 32
TARGETS = ("word_embeddings", "query", "key", "value", "dense")
LENGTHS = [1, 130, 7, 67, 300, 45]
ROWS = ["a", None, "b", "c", "d", "a"]


def _write_lora(model, path: str, seed: int) -> dict:
    """A PEFT LoRA directory for `model` (written without PEFT, which the GPU machine may lack): returns
    {module name: (A, B)} of the factors it holds."""
    g = torch.Generator().manual_seed(seed)
    factors, tables = {}, set()
    for name, module in model.named_modules():
        if name.split(".")[-1] not in TARGETS or "pooler" in name:
            continue
        if isinstance(module, torch.nn.Embedding):  # A (r, V), B (E, r)
            tables.add(name)
            factors[name] = (torch.randn(RANK, module.num_embeddings, generator=g) * 0.05,
                             torch.randn(module.embedding_dim, RANK, generator=g) * 0.05)
        elif isinstance(module, torch.nn.Linear):
            factors[name] = (torch.randn(RANK, module.in_features, generator=g) * 0.05,
                             torch.randn(module.out_features, RANK, generator=g) * 0.05)
    write_peft_dir(path, factors, rank=RANK, alpha=ALPHA, target_modules=TARGETS, tables=tables)
    return factors


def _merged(model, factors, dtype):
    merged = copy.deepcopy(model).to(torch.float64)
    modules = dict(merged.named_modules())
    with torch.no_grad():
        for name, (A, B) in factors.items():
            w = modules[name].weight
            delta = (ALPHA / RANK) * (B.double().to(w.device) @ A.double().to(w.device))
            w += delta.T if isinstance(modules[name], torch.nn.Embedding) else delta
    return merged.to(dtype).eval()


def _checks(device="cuda", dtypes=("float32", "float16", "bfloat16"), hidden=768):
    """Child process body (CUDA, compiled kernels; a dry run on CPU under the interpreter with a small `hidden` and
    the interpreter's dtypes)."""
    import conftest
    from bertfast import Encoder

    model = conftest.hf_bert(hidden_size=hidden, num_attention_heads=hidden // 64, intermediate_size=4 * hidden,
                             num_hidden_layers=2, max_position_embeddings=512).to(device)
    ids, mask, types = (t.to(device) for t in conftest.ragged_batch(LENGTHS, vocab=97))
    with tempfile.TemporaryDirectory() as root:
        names = sorted({n for n in ROWS if n is not None})
        paths = {n: os.path.join(root, n) for n in names}
        factors = {n: _write_lora(model, paths[n], seed=i) for i, n in enumerate(names)}

        def by_row(dtype):  # each row through its own merged model (the base model for base rows)
            models = {n: _merged(model, factors[n], dtype) for n in names}
            models[None] = copy.deepcopy(model).to(dtype).eval()
            out = torch.zeros(*ids.shape, model.config.hidden_size, dtype=torch.float64, device=device)
            with torch.no_grad():
                for row, n in enumerate(ROWS):
                    L = LENGTHS[row]
                    h = models[n](input_ids=ids[row:row + 1, :L], attention_mask=mask[row:row + 1, :L],
                                  token_type_ids=types[row:row + 1, :L]).last_hidden_state
                    out[row, :L] = h[0].double()
            return out

        keep = mask.bool()
        ref = by_row(torch.float64)

        def err(out):
            diff = (out.double() - ref)[keep].abs().max()
            return (diff / ref[keep].abs().max()).item()

        for name in dtypes:
            dtype = getattr(torch, name)
            enc = Encoder.from_hf(model, backend="triton", dtype=dtype, graphs=False)
            for n in names:
                enc.load_adapter(n, paths[n])
            out = enc(ids, mask, types, adapter_ids=ROWS).last_hidden_state
            bound = 1e-5 if dtype == torch.float32 else 2 * err(by_row(dtype))
            print(json.dumps({"check": "parity", "dtype": name, "err": err(out), "bound": bound}), flush=True)
            for row in (0, 1, 4):
                L = LENGTHS[row]
                alone = enc(ids[row:row + 1, :L], mask[row:row + 1, :L], types[row:row + 1, :L],
                            adapter_ids=[ROWS[row]]).last_hidden_state[0]
                print(json.dumps({"check": f"row{row}-alone", "dtype": name,
                                  "equal": torch.equal(alone, out[row, :L])}), flush=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available())")
def test_adapters_on_gpu():
    rows = compiled_rows("test_adapters_gpu", "_checks")
    assert len(rows) == 3 * 4
    for row in rows:
        assert row["err"] <= row["bound"] if row["check"] == "parity" else row["equal"], row
