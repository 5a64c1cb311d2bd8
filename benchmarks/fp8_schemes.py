"""fp8 (e4m3) GEMM schemes on all-MiniLM-L6-v2, emulated in torch: each layer GEMM computed as
`Q(x) @ Q(W).T + bias` with `Q` the symmetric e4m3 rounding through `torch.float8_e4m3fn` (scale amax / 448 over
the scheme's group), everything else fp32; mean cosine and min cosine of the mean-pooled sentence embeddings
against transformers' unquantized fp32 model over the sentences of bertfast/tools/validate/sentences.py.
docs/backends.md#fp8-e4m3 has the numbers and what they mean.

    python3 benchmarks/fp8_schemes.py [--schemes today,act1x128,...] [--sentences 202] [--model DIR] [--json OUT]

A scheme names, for each of a layer's four GEMMs (QKV, attention out, FFN in, FFN out), how its input and its
weights are rounded: e4m3 per token / per 1xN block of K / per output channel / per 128x128 weight tile, fp16
(both operands), or not at all (fp32). The forward below is BERT's, written out so that each GEMM is one call
(QKV fused, as the engine packs it); before any scheme counts it must reproduce transformers' own embeddings.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F
import transformers

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # runnable from a source checkout

import bertfast  # noqa: E402
from bertfast.backends.cpu.isa import proc_cpuinfo  # noqa: E402
from bertfast.tools.validate.sentences import sentences  # noqa: E402

E4M3_MAX = 448.0
SITES = ("qkv", "attn_out", "ffn_in", "ffn_out")
REPRODUCE_ATOL = 1e-4  # the written-out fp32 forward against transformers', max abs on the pooled embeddings


def e4m3(x: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """x rounded to e4m3 at scale amax / 448 (amax broadcast over x's groups), returned in fp32."""
    amax = torch.where(amax > 0, amax, torch.full_like(amax, E4M3_MAX))  # an all-zero group keeps its zeros
    codes = (x * (E4M3_MAX / amax)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return codes.float() * (amax / E4M3_MAX)


def per_row(x: torch.Tensor) -> torch.Tensor:
    """One scale a row: per token for activations (T, K), per output channel for weights (N, K)."""
    return e4m3(x, x.abs().amax(-1, keepdim=True))


def per_block(n: int):
    """One scale a row and block of n along K (activations 1 x n)."""
    def q(x: torch.Tensor) -> torch.Tensor:
        rows, k = x.shape
        xb = F.pad(x, (0, -k % n)).reshape(rows, -1, n)
        return e4m3(xb, xb.abs().amax(-1, keepdim=True)).reshape(rows, -1)[:, :k]
    return q


def per_tile(w: torch.Tensor, n: int = 128) -> torch.Tensor:
    """One scale a 128 x 128 weight tile (N and K multiples of 128, as MiniLM's are)."""
    rows, k = w.shape
    wt = w.reshape(rows // n, n, k // n, n)
    return e4m3(wt, wt.abs().amax(dim=(1, 3), keepdim=True)).reshape(rows, k)


def two_terms(q):
    """x as two e4m3 terms, the codes of x and of its residue (twice the MMAs)."""
    def q2(x: torch.Tensor) -> torch.Tensor:
        hi = q(x)
        return hi + q(x - hi)
    return q2


def exact(x: torch.Tensor) -> torch.Tensor:
    return x


def fp16(x: torch.Tensor) -> torch.Tensor:
    return x.half().float()


FP32, FP16, TODAY = (exact, exact), (fp16, fp16), (per_row, per_row)  # (activations, weights)


def each(mode, sites=SITES, rest=FP32) -> dict:
    return {s: mode if s in sites else rest for s in SITES}


# name: (what the table says, {site: (activation rounding, weight rounding)})
SCHEMES = {
    "today": ("today: activations per token, weights per output channel", each(TODAY)),
    **{f"today-{s}": (f"today's, {s} alone (the rest fp32)", each(TODAY, (s,))) for s in SITES},
    "act1x128": ("activations 1x128, weights per output channel", each((per_block(128), per_row))),
    "act1x128-w128x128": ("activations 1x128, weights per 128x128 tile", each((per_block(128), per_tile))),
    "act1x64": ("activations 1x64, weights per output channel", each((per_block(64), per_row))),
    "act1x32": ("activations 1x32, weights per output channel", each((per_block(32), per_row))),
    "ffn-out-fp16": ("QKV, attn out, FFN in today's; FFN out fp16", {**each(TODAY), "ffn_out": FP16}),
    "act1x128-ffn-out-fp16": ("the same with 1x128 activations",
                              {**each((per_block(128), per_row)), "ffn_out": FP16}),
    "weights-only": ("only the weights, per output channel", each((exact, per_row))),
    "acts-only": ("only the activations, per token", each((per_row, exact))),
    "acts-only-1x32": ("only the activations, per 1x32 block", each((per_block(32), exact))),
    "w2-act1x32": ("weights as two e4m3 terms, activations 1x32", each((per_block(32), two_terms(per_row)))),
    "qkv-attn-out": ("only QKV and attn out today's; FFN fp16", each(TODAY, ("qkv", "attn_out"), FP16)),
    "attn-out": ("only attn out today's; the rest fp16", each(TODAY, ("attn_out",), FP16)),
}


def pack(model) -> list[dict]:
    """Each layer's GEMMs as (weight (N, K), bias (N,)) fp32, Q, K and V fused into one."""
    layers = []
    for layer in model.encoder.layer:
        a = layer.attention.self
        layers.append({
            "qkv": (torch.cat([a.query.weight, a.key.weight, a.value.weight]),
                    torch.cat([a.query.bias, a.key.bias, a.value.bias])),
            "attn_out": (layer.attention.output.dense.weight, layer.attention.output.dense.bias),
            "ffn_in": (layer.intermediate.dense.weight, layer.intermediate.dense.bias),
            "ffn_out": (layer.output.dense.weight, layer.output.dense.bias),
        })
    return layers


def embed(model, packed, batch, scheme: dict) -> torch.Tensor:
    """Mean-pooled embeddings (B, H) fp32 with each layer GEMM rounded as scheme says."""
    def gemm(site, x, i):
        xq, wq = scheme[site]
        w, b = packed[i][site]
        return (xq(x.reshape(-1, x.shape[-1])) @ wq(w).T + b).reshape(*x.shape[:-1], -1)

    heads = model.config.num_attention_heads
    mask = batch["attention_mask"].bool()
    x = model.embeddings(input_ids=batch["input_ids"], token_type_ids=batch["token_type_ids"])
    B, S, H = x.shape
    for i, layer in enumerate(model.encoder.layer):
        q, k, v = gemm("qkv", x, i).view(B, S, 3, heads, H // heads).permute(2, 0, 3, 1, 4)
        ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :])
        x = layer.attention.output.LayerNorm(gemm("attn_out", ctx.transpose(1, 2).reshape(B, S, H), i) + x)
        inner = layer.intermediate.intermediate_act_fn(gemm("ffn_in", x, i))
        x = layer.output.LayerNorm(gemm("ffn_out", inner, i) + x)
    m = mask[..., None].float()
    return (x * m).sum(1) / m.sum(1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--schemes", default=",".join(SCHEMES), help="comma-separated, of: " + ", ".join(SCHEMES))
    ap.add_argument("--sentences", type=int, default=len(sentences()), help="the first N validate sentences")
    ap.add_argument("--model", default=None, help="a BERT checkpoint directory (default: the embedded MiniLM)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None, help="write the rows and the setting here")
    args = ap.parse_args()
    names = [n for n in args.schemes.split(",") if n]
    unknown = [n for n in names if n not in SCHEMES]
    if unknown or not names:
        ap.error(f"--schemes: unknown {', '.join(unknown) or '(none given)'}; known: {', '.join(SCHEMES)}")
    if not 1 <= args.sentences <= len(sentences()):
        ap.error(f"--sentences must be in 1..{len(sentences())}, got {args.sentences}")

    torch.set_num_threads(args.threads)
    path = args.model or bertfast.default_model_path()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.BertModel.from_pretrained(path, dtype=torch.float32).eval()
    texts = sentences()[:args.sentences]
    batch = tok(texts, padding=True, truncation=True, max_length=256, return_tensors="pt")
    with torch.inference_mode():
        hidden = model(**batch).last_hidden_state
        m = batch["attention_mask"][..., None].float()
        ref = ((hidden * m).sum(1) / m.sum(1)).double()
        packed = pack(model)
        err = (embed(model, packed, batch, each(FP32)).double() - ref).abs().max().item()
        if err > REPRODUCE_ATOL:
            raise SystemExit(f"the written-out fp32 forward is {err:.2e} from transformers' (> {REPRODUCE_ATOL}): "
                             "the model is not the BERT this script writes out")
        print(f"{path}, {len(texts)} sentences, {args.threads} threads, "
              f"{proc_cpuinfo()[0]}, torch {torch.__version__}; fp32 forward reproduced to {err:.1e}")
        print(f"{'scheme':22s} {'what':62s} {'mean cos':>9s} {'min cos':>9s} {'s':>4s}")
        rows = []
        for name in names:
            what, scheme = SCHEMES[name]
            t0 = time.perf_counter()
            cos = F.cosine_similarity(embed(model, packed, batch, scheme).double(), ref, dim=-1)
            rows.append({"scheme": name, "what": what, "mean_cosine": cos.mean().item(),
                         "min_cosine": cos.min().item(), "seconds": time.perf_counter() - t0})
            r = rows[-1]
            print(f"{name:22s} {what:62s} {r['mean_cosine']:9.5f} {r['min_cosine']:9.5f} {r['seconds']:4.0f}",
                  flush=True)
    if args.json:
        setting = {"model": path, "sentences": len(texts), "threads": args.threads, "cpu": proc_cpuinfo()[0],
                   "torch": torch.__version__, "transformers": transformers.__version__, "reproduce_err": err}
        with open(args.json + ".tmp", "w") as f:
            json.dump({"setting": setting, "rows": rows}, f, indent=1)
        os.replace(args.json + ".tmp", args.json)


if __name__ == "__main__":
    main()
