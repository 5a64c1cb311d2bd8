"""Per seed: BERT-base random (bf16_accuracy.py's init), 8 x 128; bertfast bf16 with the word table fp32 (new) and
rounded to bf16 (the old load, bit for bit): output and stream max / rms vs transformers fp32."""
import dataclasses, sys, torch, transformers
import bertfast
from bertfast import Encoder
from bertfast.loading import load_hf_model
bertfast.cap_libraries()
from bertfast import _C
if len(sys.argv) > 3: assert _C.set_isa(sys.argv[3]); print("tier", _C.isa(), flush=True)
def stats(x, ref):
    d = x.double() - ref
    return (d.abs().max() / ref.abs().max()).item(), (d.pow(2).mean() / ref.pow(2).mean()).sqrt().item()
for seed in range(int(sys.argv[1]), int(sys.argv[2])):
    torch.manual_seed(seed)
    model = transformers.BertModel(transformers.BertConfig(num_hidden_layers=12), add_pooling_layer=False).eval()
    ids = torch.randint(1000, 30000, (8, 128)); mask = torch.ones_like(ids)
    with torch.inference_mode():
        ref = model(input_ids=ids).last_hidden_state.double()
        w = load_hf_model(model, torch.bfloat16, torch.float32)
        old = dataclasses.replace(w, embeddings=dataclasses.replace(w.embeddings, word=w.embeddings.word.bfloat16()))
        row = [seed]
        for weights in (old, w):
            enc = Encoder(weights, backend="cpu", add_pooling_layer=False)
            row += [*stats(enc(input_ids=ids).last_hidden_state, ref),
                    *stats(enc.engine.forward(ids, mask, pool=False, stream=True)[0], ref)]
    print(" ".join(f"{v:.4e}" if isinstance(v, float) else str(v) for v in row), flush=True)
