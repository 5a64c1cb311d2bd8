"""bf16's error against fp32 on BERT-base random weights (`BertModel(config)` init, 8 x 128 random tokens): transformers
in bf16, bertfast's bf16 output (`last_hidden_state`, rounded to bf16) and its fp32 residual stream (what
`Encoder.encode` pools), as max |x - fp32| / max |fp32| with transformers' fp32 as the reference. --model: a
checkpoint's real weights instead (the same random tokens). docs/cpu-gemm.md#bf16-accuracy has the numbers.

    python3 benchmarks/bf16_accuracy.py [--layers 12] [--seed 0] [--model DIR]
"""

from __future__ import annotations

import argparse
import copy

import torch
import transformers

import bertfast


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", help="a model directory (real weights; --layers is then ignored)")
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    if args.model:
        model = transformers.AutoModel.from_pretrained(args.model).eval()
        name = args.model
    else:
        model = transformers.BertModel(transformers.BertConfig(num_hidden_layers=args.layers),
                                       add_pooling_layer=False).eval()
        name = f"BERT-base {args.layers} layers"
    ids = torch.randint(1000, 30000, (8, 128))
    mask = torch.ones_like(ids)
    with torch.inference_mode():
        ref = model(input_ids=ids).last_hidden_state.double()
        theirs = copy.deepcopy(model).to(torch.bfloat16)(input_ids=ids).last_hidden_state
        enc = bertfast.Encoder.from_hf(model, backend="cpu", dtype=torch.bfloat16, add_pooling_layer=False)
        ours = enc(input_ids=ids).last_hidden_state
        stream = enc.engine.forward(ids, mask, pool=False, stream=True)[0]

    def rel(x):
        return ((x.double() - ref).abs().max() / ref.abs().max()).item()

    print(f"cpu: {bertfast.cpu_info()}")
    print(f"{name}, 8 x 128, seed {args.seed}: max |x - fp32| / max |fp32|")
    print(f"  transformers bf16          {rel(theirs):.3e}")
    print(f"  bertfast bf16 output       {rel(ours):.3e}")
    print(f"  bertfast bf16 fp32 stream  {rel(stream):.3e}  ({stream.dtype})")


if __name__ == "__main__":
    main()
