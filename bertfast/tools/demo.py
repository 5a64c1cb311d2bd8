"""`bertfast demo`: encode a few sentences with a real checkpoint, check the engine, time it.

Prints the cosine-similarity matrix of the sentence embeddings, the engine's error against the
fp64 reference model, and the engine's latency next to Hugging Face's on the same batch.
"""

from __future__ import annotations

import sys

from bertfast.tools.bench.measure import interleaved, quantile, timer

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
    p.add_argument("--dtype", default=None, help="fp32, bf16, fp16, int8, or auto (the fastest within the "
                   "fidelity rule on this CPU tier or GPU) (default: the checkpoint's)")
    p.add_argument("--repeats", type=int, default=20, help="timed repetitions per engine")


def _interleaved_median_ms(fns, repeats):
    """Median ms per function over `repeats` interleaved rounds, after one warm-up call each (first
    touch, one-time packing): the one timer of bertfast.tools.bench.measure."""
    times = interleaved({str(i): timer(fn) for i, fn in enumerate(fns)}, repeats, warmup=1)
    return [quantile(t, 0.5) * 1e3 for t in times.values()]


def run(args) -> int:
    import torch

    import bertfast
    from bertfast import reference
    from bertfast.backends.cpu import isa

    path = args.model or bertfast.default_model_path()
    print(isa.describe())
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
    label = f"bertfast ({enc.backend}, {str(enc.dtype).replace('torch.', '')})"
    try:
        from transformers import AutoModel
        from transformers.utils import logging as hf_logging
    except ImportError:
        (bf_ms,) = _interleaved_median_ms([lambda: enc(ids, mask, types)], args.repeats)
        print(f"  {label}: {bf_ms:8.2f} ms")
        print("  transformers: not installed, comparison skipped (bash install.sh --demo installs it)")
    else:
        hf_logging.disable_progress_bar()
        hf = AutoModel.from_pretrained(path, attn_implementation="sdpa", dtype=enc.dtype).eval()

        def run_hf():
            with torch.inference_mode():
                hf(input_ids=ids, attention_mask=mask, token_type_ids=types)

        bf_ms, hf_ms = _interleaved_median_ms([lambda: enc(ids, mask, types), run_hf], args.repeats)
        print(f"  {label}: {bf_ms:8.2f} ms")
        print(f"  transformers (sdpa):     {hf_ms:8.2f} ms   -> bertfast is {hf_ms / bf_ms:.2f}x faster")
    if not ok:
        print(f"FAIL: error above tolerance {tol:.0e}", file=sys.stderr)
        return 1
    print("\nOK")
    return 0
