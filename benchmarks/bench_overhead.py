"""Python overhead of the engine pipeline, with the math taken away.

A backend whose ops return preallocated outputs (no compute) runs through the real `Engine`, so the
time left is what the pipeline itself costs per forward: input checks, unpad/pad, the per-layer
Python calls. This bounds how much a small-batch forward can lose to Python on any backend.

    python benchmarks/bench_overhead.py [--layers 12] [--tokens 16]
"""

from __future__ import annotations

import argparse

import torch

from bertfast import ModelConfig
from bertfast.backends.torch import TorchBackend
from bertfast.encoder import check_inputs
from bertfast.engine import Engine
from bertfast.backends.weights import EmbeddingWeights, LayerWeights, ModelWeights
from bertfast.tools.bench.measure import interleaved, quantile, timer


class NullBackend(TorchBackend):
    """Ops that return preallocated tensors of the right shape: pure pipeline overhead."""

    name = "null"

    def __init__(self, T, H, I, heads):
        self.x = torch.zeros(T, H)
        self.h = torch.zeros(T, I)
        d = H // heads
        self.q = torch.zeros(T, heads, d)
        self.out = {H: self.x, I: self.h}

    def embeddings(self, *args):
        return self.x

    def qkv(self, *args):
        return self.q, self.q, self.q

    def attention(self, *args):
        return self.x

    def linear(self, x, weight, bias, act="none", residual=None):
        return self.out[weight.shape[0]][:x.shape[0]]  # (tokens or pooled rows, out_features)

    def layernorm(self, *args):
        return self.x


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=2000)
    args = p.parse_args()
    H, I, heads, T = 768, 3072, 12, args.tokens
    cfg = ModelConfig.from_dict({"model_type": "bert", "hidden_size": H, "num_attention_heads": heads,
                                 "num_hidden_layers": args.layers, "intermediate_size": I, "vocab_size": 100,
                                 "max_position_embeddings": 512})
    z = torch.zeros
    emb = EmbeddingWeights(z(100, H), z(512, H), z(2, H), z(H), z(H))
    layer = LayerWeights(z(3 * H, H), z(3 * H), z(H, H), z(H), z(H), z(H), z(I, H), z(I), z(H, I), z(H), z(H), z(H))
    weights = ModelWeights(cfg, emb, [layer] * args.layers, z(H, H), z(H))
    engine = Engine(weights, NullBackend(T, H, I, heads))
    ids = torch.ones(1, T, dtype=torch.long)

    def forward():
        i, m, t, pos = check_inputs(cfg, ids, None, None, None, True, torch.device("cpu"))
        engine.forward(i, m, t, pos)

    times = interleaved({"forward": timer(forward)}, args.repeats, warmup=50)["forward"]
    med = quantile(times, 0.5) * 1e6
    print(f"pipeline overhead, {args.layers} layers, b1 x s{T}: {med:.0f} us per forward "
          f"({med / args.layers:.1f} us per layer incl. fixed costs), p90 {sorted(times)[int(0.9 * len(times))] * 1e6:.0f} us")


if __name__ == "__main__":
    main()
