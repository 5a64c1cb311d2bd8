"""`bertfast demo`: encode a few sentences with a real checkpoint, check the engine, time it.

Prints the cosine-similarity matrix of the sentence embeddings, the engine's error against the
fp64 reference model, and the engine's latency next to Hugging Face's on the same batch.
"""

from __future__ import annotations

import statistics
import sys
import time

SENTENCES = [
    "The cat sits on the mat.",
    "A kitten is resting on a rug.",
    "Stock markets fell sharply after the central bank raised interest rates.",
    "Investors sold shares when borrowing costs went up.",
    "How do I bake sourdough bread at home?",
    "Recipe for homemade bread with a natural starter.",
]


def add_arguments(p):
    p.add_argument("--model", default=None, help="model directory (default: the embedded all-MiniLM-L6-v2)")
    p.add_argument("--backend", default="auto", help="backend: auto, torch, cpu, triton")
    p.add_argument("--dtype", default=None, help="fp32, bf16 or fp16 (default: the checkpoint's)")
    p.add_argument("--repeats", type=int, default=20, help="timed repetitions per engine")


def _median_ms(fn, repeats):
    fn()  # warm-up (first touch, one-time packing)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def run(args) -> int:
    import torch

    import bertfast
    from bertfast import reference

    path = args.model or bertfast.default_model_path()
    print(f"model: {path}")
    enc = bertfast.Encoder.from_pretrained(path, backend=args.backend, dtype=args.dtype)
    print(f"engine: {enc}")

    emb = enc.encode(SENTENCES, normalize=True)
    sim = emb @ emb.T
    print("\ncosine similarity of the sentence embeddings (mean pooling):")
    for i, s in enumerate(SENTENCES):
        row = " ".join(f"{v:5.2f}" for v in sim[i].tolist())
        print(f"  [{i}] {row}   {s}")

    ids, mask, types = enc.tokenize(SENTENCES)
    out = enc(ids, mask, types)
    ref_weights = bertfast.load_pretrained(path, dtype=torch.float64)
    ref_last, ref_pool, _ = reference.forward(ref_weights, ids, mask, types)
    real = mask.bool()
    err = ((out.last_hidden_state.double() - ref_last)[real].abs().max() / ref_last[real].abs().max()).item()
    print(f"\nengine vs fp64 reference, real tokens: max relative error {err:.2e}")
    tol = 1e-5 if enc.dtype == torch.float32 else 5e-2
    ok = err <= tol
    if ref_pool is not None:
        perr = ((out.pooler_output.double() - ref_pool).abs().max() / ref_pool.abs().max()).item()
        print(f"pooler_output: max relative error {perr:.2e}")
        ok = ok and perr <= tol

    n_tokens = int(mask.sum())
    print(f"\nlatency, batch of {len(SENTENCES)} sentences ({n_tokens} real tokens, padded to {ids.shape[1]}):")
    bf_ms = _median_ms(lambda: enc(ids, mask, types), args.repeats)
    print(f"  bertfast ({enc.backend}, {str(enc.dtype).replace('torch.', '')}): {bf_ms:8.2f} ms")
    try:
        from transformers import BertModel
    except ImportError:
        print("  transformers: not installed, comparison skipped (bash install.sh --test installs it)")
    else:
        hf = BertModel.from_pretrained(path, attn_implementation="sdpa", dtype=enc.dtype).eval()
        with torch.inference_mode():
            hf_ms = _median_ms(lambda: hf(input_ids=ids, attention_mask=mask, token_type_ids=types), args.repeats)
        print(f"  transformers BertModel (sdpa): {hf_ms:8.2f} ms   -> bertfast is {hf_ms / bf_ms:.2f}x")
    if not ok:
        print(f"FAIL: error above tolerance {tol:.0e}", file=sys.stderr)
        return 1
    print("\nOK")
    return 0
