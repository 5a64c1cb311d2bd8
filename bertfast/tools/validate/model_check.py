"""The model check of `bertfast validate --model DIR`: the backend's engine against the reference
forward on a whole checkpoint, stage by stage (after the embeddings, after each layer, the pooler) on
real positions only, each stage judged by the accuracy rule against the fp64 oracle on the same
rounded weights. `model_batch` is the ragged batch it runs (real sentences through the checkpoint's
tokenizer, or random ids when it has none); the int8 report runs on the same batch.

With a LoRA adapter (`--adapter DIR`) every other row of the batch runs on it, the others on the base model, in
one forward: the adapter's rows are judged against the reference forward with the adapter run unmerged, as PEFT
runs it (`reference.forward(adapter=)`: the oracle in fp64, the same-dtype reference with the LoRA terms in fp32),
the base rows against the base model's.
"""

from __future__ import annotations

import torch

from bertfast.accuracy import DTYPE_IDS, Row, judge
from bertfast.tools.validate.sweep import dtype_skip_reason, error_note

# The batch's sentences when the checkpoint has a tokenizer; else random ids of these lengths.
SENTENCES = (
    "Hi.",
    "The quick brown fox jumps over the lazy dog.",
    "bertfast runs BERT-family encoders on packed tokens, so padding costs nothing.",
    "A sentence embedding model maps text to a vector; similar meanings land close together, "
    "which is what semantic search, clustering and deduplication rely on.",
    "Ok",
    "Validation compares every layer with a float64 oracle.",
)
RANDOM_LENGTHS = (1, 23, 7, 64, 2)


def model_batch(directory: str, config, seed: int = 0):
    """(input_ids, attention_mask, token_type_ids) (B, S) int64, ragged; and a label for the table.

    Real sentences through the directory's tokenizer (padded as it pads) when it has one; random
    ids, right padded, otherwise (a row of 64 tokens reaches the position limit of small models).
    """
    tokenizer = None
    try:
        from bertfast.tokenization import load_tokenizer

        tokenizer = load_tokenizer(directory, config.max_position_embeddings)
    except ImportError:
        pass
    if tokenizer is not None:
        enc = tokenizer.encode_batch(list(SENTENCES))
        ids = torch.tensor([e.ids for e in enc], dtype=torch.int64)
        mask = torch.tensor([e.attention_mask for e in enc], dtype=torch.int64)
        types = torch.tensor([e.type_ids for e in enc], dtype=torch.int64)
        if int(ids.max()) >= config.vocab_size:
            raise ValueError(f"the tokenizer in {directory} produces ids up to {int(ids.max())}, "
                             f"beyond the model's vocab_size {config.vocab_size}")
        return ids, mask, types.clamp_max(max(config.type_vocab_size - 1, 0)), "sentences"
    g = torch.Generator().manual_seed(seed)
    lengths = [min(n, config.max_position_embeddings) for n in RANDOM_LENGTHS]
    B, S = len(lengths), max(lengths)
    mask = (torch.arange(S)[None, :] < torch.tensor(lengths)[:, None]).long()
    ids = torch.randint(0, config.vocab_size, (B, S), generator=g) * mask
    types = torch.randint(0, max(config.type_vocab_size, 1), (B, S), generator=g) * mask  # zeros without types
    return ids, mask, types, "random-ids"


def run_model_check(backend, weights, directory: str, dtypes, device="cpu", adapter=None) -> list[Row]:
    """Each dtype: the backend's engine vs the reference forward, after the embeddings, after every
    layer (rows "layer1".."layerN" = hidden_states[1:]) and for the pooler, on real positions only.

    weights: the checkpoint's ModelWeights (any dtype; rounded to each run dtype, and the oracle
    runs in fp64 on those rounded weights). adapter: an `adapters.Adapter` loaded against weights, run on the even
    rows (see above), or None.
    """
    from bertfast import reference
    from bertfast.engine import Engine

    ids, mask, types, what = model_batch(directory, weights.config)
    B, S = ids.shape
    shape = f"{what}-B{B}-S{S}-T{int(mask.sum())}" + ("" if adapter is None else f"-lora{(B + 1) // 2}of{B}")
    real = mask.bool()
    rows = []
    for dtype in dtypes:
        name = DTYPE_IDS[dtype]
        reason = dtype_skip_reason(backend, dtype, device)
        if reason is None and adapter is not None:
            reason = backend.no_adapters
        if reason is not None:
            rows.append(Row("model", shape, name, "SKIP", note=reason))
            continue
        w_lowp = weights.to(dtype=dtype, device=device)
        w_fp64 = w_lowp.to(dtype=torch.float64, device="cpu")
        on_dev = [t.to(device) for t in (ids, mask, types)]
        with torch.no_grad():
            _, pooled64, states64 = reference.forward(w_fp64, ids, mask, types, output_hidden_states=True)
            _, pooled_ref, states_ref = reference.forward(w_lowp, *on_dev, output_hidden_states=True)
            try:
                engine = Engine(w_lowp, backend)
                per_row = None
                if adapter is not None:
                    packed = engine.pack_adapter(adapter)
                    per_row = [packed if b % 2 == 0 else None for b in range(B)]
                _, pooled, states = engine.forward(*on_dev, output_hidden_states=True, adapters=per_row)
            except Exception as e:
                rows.append(Row("model", shape, name, "FAIL", note=error_note(e)))
                continue
            if adapter is not None:  # the adapter's rows judged against the reference forwards with it
                pooled64, states64 = _adapted_rows((pooled64, states64), reference.forward(
                    w_fp64, ids, mask, types, output_hidden_states=True, adapter=adapter))
                pooled_ref, states_ref = _adapted_rows((pooled_ref, states_ref), reference.forward(
                    w_lowp, *on_dev, output_hidden_states=True, adapter=adapter))
        if states is None or len(states) != len(states64):
            got = "none" if states is None else len(states)
            rows.append(Row("model", shape, name, "FAIL",
                            note=f"engine returned {got} hidden states, expected {len(states64)}"))
            continue
        stages = ["embeddings"] + [f"layer{i + 1}" for i in range(len(states64) - 1)]
        for stage, ours, ref_t, orc in zip(stages, states, states_ref, states64):
            if tuple(ours.shape) != (B, S, weights.config.hidden_size):
                rows.append(Row(stage, shape, name, "FAIL", note=f"hidden state shape {tuple(ours.shape)}"))
                continue
            rows.append(judge(stage, shape, dtype, ours[real.to(ours.device)],
                              ref_t[real.to(ref_t.device)], orc[real]))
        if pooled64 is not None:
            if pooled is None:
                rows.append(Row("pooler", shape, name, "FAIL", note="engine returned no pooler output"))
            else:
                rows.append(judge("pooler", shape, dtype, pooled, pooled_ref, pooled64))
    return rows


def _adapted_rows(base: tuple, adapted: tuple) -> tuple:
    """The base forward's (pooled, states) with their even rows from `adapted`'s forward (last, pooled, states), as
    the check runs the adapter."""
    def stitch(b, a):
        if b is None:
            return None
        out = b.clone()
        out[0::2] = a[0::2].to(out.device)
        return out
    return stitch(base[0], adapted[1]), [stitch(b, a) for b, a in zip(base[1], adapted[2])]
