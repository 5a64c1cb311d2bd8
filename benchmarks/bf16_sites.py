"""Where bf16's error comes from: a torch model of the cpu backend's bf16 arithmetic on BERT-base random weights
(the model and inputs of bf16_accuracy.py), each rounding site to bf16 switched on alone and switched off alone,
as max |x - fp32| / max |fp32| and as rms |x - fp32| / rms |fp32| (the max moves by ~+-5% between seeds or with
any change that flips one rounding; the rms does not), transformers' fp32 as the reference.
docs/cpu-gemm.md#bf16-accuracy has the numbers.

    python3 benchmarks/bf16_sites.py [--layers 12] [--seed 0] [--round-p]

The sites: the word table; the position and token type tables; the embeddings' output; the stream rounded where a
GEMM reads it (QKV, FFN-in); the GEMM weights; q, k, v after the QKV GEMM; attention's unnormalised probabilities
before P V (--round-p only: torch's bf16 flash attention rounds P once; every tier of the engine carries it in fp32,
the amx tiers as two bf16 parts, hi + lo); the attention output before its
GEMM; the activation's output before FFN-out. Everything else is fp32, as in the engine (residual adds, LayerNorms,
softmax, GEMM accumulation). Biases and LayerNorm weights are exact in bf16 at init (zeros, ones): not sites here.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
import transformers

SITES = ("word", "pos_type", "emb_out", "operand", "weights", "qkv", "probs", "ctx", "act")
# What the engine rounds: before the fp32 stream tensors (STREAM_TENSORS), also pos_type and emb_out.
ENGINE = {"word", "operand", "weights", "qkv", "probs", "ctx", "act"}
GEMM_OPERANDS = {"operand", "weights", "ctx", "act"}  # what bf16 GEMMs cannot avoid (with --round-p, qkv and probs too)


def simulate(model, ids, sites: set[str], round_p: bool) -> torch.Tensor:
    """The last hidden state (B, S, H) fp32, with the named sites rounded to bf16."""
    def r(site, t):
        return t.bfloat16().float() if site in sites else t

    def lin(x, module, site="weights"):
        return x @ r(site, module.weight).T + module.bias

    e, cfg = model.embeddings, model.config
    H, heads = cfg.hidden_size, cfg.num_attention_heads
    d, eps = H // heads, cfg.layer_norm_eps
    B, S = ids.shape
    h = (r("word", e.word_embeddings.weight)[ids] + r("pos_type", e.position_embeddings.weight)[:S]
         + r("pos_type", e.token_type_embeddings.weight)[0])
    x = r("emb_out", F.layer_norm(h, (H,), e.LayerNorm.weight, e.LayerNorm.bias, eps)).reshape(B * S, H)
    for layer in model.encoder.layer:
        a = layer.attention.self
        q, k, v = (r("qkv", lin(r("operand", x), m)).view(B, S, heads, d).transpose(1, 2)
                   for m in (a.query, a.key, a.value))
        s = q @ k.transpose(-1, -2) / d ** 0.5
        p = torch.exp(s - s.amax(-1, keepdim=True))  # the online softmax's unnormalised P; its row sum stays fp32
        ctx = ((r("probs", p) if round_p else p) @ v / p.sum(-1, keepdim=True)).transpose(1, 2).reshape(B * S, H)
        out = layer.attention.output
        x = F.layer_norm(lin(r("ctx", ctx), out.dense) + x, (H,), out.LayerNorm.weight, out.LayerNorm.bias, eps)
        inner = r("act", F.gelu(lin(r("operand", x), layer.intermediate.dense)))
        out = layer.output
        x = F.layer_norm(lin(inner, out.dense) + x, (H,), out.LayerNorm.weight, out.LayerNorm.bias, eps)
    return x.view(B, S, H)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--round-p", action="store_true",
                    help="P rounded to bf16 before P V, as torch's bf16 flash attention does")
    args = ap.parse_args()
    torch.manual_seed(args.seed)  # the model and tokens of bf16_accuracy.py
    model = transformers.BertModel(transformers.BertConfig(num_hidden_layers=args.layers),
                                   add_pooling_layer=False).eval()
    ids = torch.randint(1000, 30000, (8, 128))
    sites = set(SITES) if args.round_p else set(SITES) - {"probs"}
    engine = ENGINE & sites

    with torch.inference_mode():
        ref = model(input_ids=ids).last_hidden_state.double()

        def row(name, rounded):
            x = simulate(model, ids, rounded, args.round_p)
            cols = []
            for y in (x, x.bfloat16()):
                dev = y.double() - ref
                cols += [(dev.abs().max() / ref.abs().max()).item(),
                         (dev.pow(2).mean() / ref.pow(2).mean()).sqrt().item()]
            print(f"  {name:40s}" + "".join(f" {c:10.3e}" for c in cols))

        print(f"BERT-base {args.layers} layers, 8 x 128, seed {args.seed}{', P rounded' if args.round_p else ''}: "
              "|x - fp32| / |fp32| of the fp32 stream and of the bf16 output")
        print(f"  {'rounded to bf16':40s} {'stream max':>10s} {'rms':>10s} {'out max':>10s} {'rms':>10s}")
        row("nothing", set())
        row("the engine before (+ pos_type, emb_out)", engine | {"pos_type", "emb_out"})
        row("the engine", engine)
        row("GEMM operands only", GEMM_OPERANDS | ({"qkv", "probs"} if args.round_p else set()))
        for site in sorted(sites):
            row(f"{site} alone", {site})
        for site in sorted(engine):
            row(f"the engine but {site}", engine - {site})


if __name__ == "__main__":
    main()
