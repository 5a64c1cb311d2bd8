"""bf16's error against fp32 on BERT-base random weights (`BertModel(config)` init, 8 x 128 random tokens): transformers
in bf16, bertfast's bf16 output (`last_hidden_state`, rounded to bf16) and its fp32 output
(`output_dtype=torch.float32`: the residual stream `Encoder.encode` pools), as max |x - fp32| / max |fp32| and rms
|x - fp32| / rms |fp32| (the max moves by ~+-5-10% with any change that flips one rounding, the rms does not),
transformers' fp32 as the reference. --model: a checkpoint's real weights instead (the same random tokens). --tiers:
bertfast on each of these ISA tiers (the same model: `BERTFAST_ISA` would also cap ATen, whose random init then draws
other weights). --openvino: OpenVINO's CPU plugin with a bf16 inference precision on the same model and tokens (fp32
outputs). docs/bf16.md#bf16-accuracy has the numbers.

    python3 benchmarks/bf16_accuracy.py [--layers 12] [--seed 0] [--model DIR] [--tiers avx512_vnni,amx_emulated]
                                        [--openvino]
"""

from __future__ import annotations

import argparse
import copy

import torch
import transformers

import bertfast
from bertfast import _C

bertfast.cap_libraries()  # ATen's random init under BERTFAST_ISA's cap too (the note above)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", help="a model directory (real weights; --layers is then ignored)")
    ap.add_argument("--tiers", help="comma-separated ISA tiers to run bertfast on (default: this process's)")
    ap.add_argument("--openvino", action="store_true", help="OpenVINO bf16 on the same model and tokens")
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

    def row(label, x):
        dev = x.double() - ref
        print(f"  {label:44s} {(dev.abs().max() / ref.abs().max()).item():10.3e} "
              f"{(dev.pow(2).mean() / ref.pow(2).mean()).sqrt().item():10.3e}")

    print(f"cpu: {bertfast.cpu_info()}")
    print(f"{name}, 8 x 128, seed {args.seed}: |x - fp32| / |fp32|")
    print(f"  {'':44s} {'max':>10s} {'rms':>10s}")
    row("transformers bf16", theirs)
    for tier in args.tiers.split(",") if args.tiers else [_C.isa()]:
        if not _C.set_isa(tier):
            print(f"  bertfast on {tier}: not on this CPU")
            continue
        with torch.inference_mode():
            enc = bertfast.Encoder.from_hf(model, backend="cpu", dtype=torch.bfloat16, add_pooling_layer=False)
            ours = enc(input_ids=ids).last_hidden_state
            stream = enc(input_ids=ids, output_dtype=torch.float32).last_hidden_state
        row(f"bertfast bf16 output ({tier})", ours)
        row(f"bertfast bf16 fp32 output ({tier})", stream)
    if args.openvino:
        print(f"  {openvino_row(model, ids, mask, row)}")


def openvino_row(model, ids, mask, row) -> str:
    """OpenVINO's bf16 output on the same model and tokens (its row printed by `row`), or why not."""
    try:
        import openvino as ov
    except ImportError:
        return "OpenVINO: not installed (pip install openvino)"

    class LastHidden(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, input_ids, attention_mask):
            return self.m(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state

    compiled = ov.Core().compile_model(ov.convert_model(LastHidden(model), example_input=(ids, mask)), "CPU",
                                       {"INFERENCE_PRECISION_HINT": "bf16"})
    ran = compiled.get_property("INFERENCE_PRECISION_HINT").to_string()
    if ran != "bf16":
        return f"OpenVINO {ov.__version__}: runs {ran} on this CPU (no native bf16), not bf16"
    out = compiled.create_infer_request().infer({0: ids.numpy(), 1: mask.numpy()})[0]
    row(f"OpenVINO {ov.__version__.split('-')[0]} bf16 (fp32 output)", torch.from_numpy(out))
    return f"(OpenVINO {ov.__version__}, inference precision {ran})"


if __name__ == "__main__":
    main()
