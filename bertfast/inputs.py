"""What `Encoder` checks of a forward's inputs before the engine sees them: ids in range, a 0/1 mask, shapes that
agree, and no row the engine would get wrong (masked holes under sliding windows, a left-padded row under a pooler);
ValueError with a message otherwise. Values are checked on the inputs' device and read back in one transfer."""

from __future__ import annotations

import torch

_INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def to_host(*tensors):
    """The arguments with every CUDA tensor copied to the host, all the copies waited for at once (one device sync
    for the lot, where `.cpu()` on each would wait once each); anything else is passed through."""
    on_gpu = [torch.is_tensor(t) and t.device.type == "cuda" for t in tensors]
    if not any(on_gpu):
        return tensors
    out = tuple(t.to("cpu", non_blocking=True) if gpu else t for t, gpu in zip(tensors, on_gpu))
    torch.cuda.synchronize()
    return out


def check_inputs(config, input_ids, attention_mask, token_type_ids, position_ids, has_pooler, device):
    """Validate and normalise forward inputs; returns int64 tensors on `device` (mask as int64).

    The checks of values (id ranges, a 0/1 mask, ...) are computed on the device and read back in one transfer:
    on a GPU each read is a wait for the device, and a small forward is mostly such waits."""
    if not torch.is_tensor(input_ids):
        raise ValueError(f"input_ids must be a torch.Tensor, got {type(input_ids).__name__}")
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must have shape (batch, seq_len), got {tuple(input_ids.shape)}")
    B, S = input_ids.shape
    if B == 0 or S == 0:
        raise ValueError(f"empty batch: input_ids has shape {tuple(input_ids.shape)}")
    if input_ids.dtype not in _INT_DTYPES:
        raise ValueError(f"input_ids must be an integer tensor, got {input_ids.dtype}")
    ranges = []  # (name, limit, what); their (min, max) pairs lead `stats`
    stats = []

    def as_ids(t, name, limit, what):
        if t is None:
            return None
        if not torch.is_tensor(t):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if tuple(t.shape) != (B, S):
            raise ValueError(f"{name} has shape {tuple(t.shape)} but input_ids has {(B, S)}")
        if t.dtype not in _INT_DTYPES:
            raise ValueError(f"{name} must be an integer tensor, got {t.dtype}")
        t = t.to(device=device, dtype=torch.int64)
        ranges.append((name, limit, what))
        stats.extend(torch.aminmax(t))
        return t

    ids = as_ids(input_ids, "input_ids", config.vocab_size, "vocab_size")
    if token_type_ids is not None and config.type_vocab_size == 0:
        raise ValueError(f"token_type_ids given, but {config.family} models have no token types")
    types = as_ids(token_type_ids, "token_type_ids", config.type_vocab_size, "type_vocab_size")
    positions = as_ids(position_ids, "position_ids", config.max_position_embeddings,
                       "max_position_embeddings")
    if position_ids is None and S > config.max_sequence_length:
        raise ValueError(
            f"sequence length {S} exceeds the model's limit of {config.max_sequence_length} tokens "
            f"(max_position_embeddings = {config.max_position_embeddings})"
        )
    # Flags (a count > 0 is an error), checked in this order after the ranges.
    holes = cls_masked = None
    if attention_mask is None:
        mask = torch.ones(B, S, dtype=torch.int64, device=device)
    else:
        if not torch.is_tensor(attention_mask):
            raise ValueError(f"attention_mask must be a torch.Tensor, got {type(attention_mask).__name__}")
        if tuple(attention_mask.shape) != (B, S):
            raise ValueError(
                f"attention_mask has shape {tuple(attention_mask.shape)} but input_ids has {(B, S)}"
            )
        if attention_mask.dtype.is_complex:
            raise ValueError(f"attention_mask must be 0/1 (bool, int or float), got {attention_mask.dtype}")
        mask = attention_mask.to(device)
        stats.append(((mask != 0) & (mask != 1)).sum())
        mask = mask.to(torch.int64)
        if any(config.layer_windows):
            # A sliding window counts columns in transformers, real tokens here: the same wherever each row's real
            # tokens are contiguous (right or left padding), not for a mask with holes.
            holes = ((mask[:, 1:] > mask[:, :-1]).sum(1) + mask[:, 0]) > 1
            stats.append(holes.sum())
    if has_pooler:
        cls_masked = (mask[:, 0] == 0) & (mask != 0).any(1)
        stats.append(cls_masked.sum())
    values = torch.stack([v.to(torch.int64) for v in stats]).tolist() if stats else []
    for i, (name, limit, what) in enumerate(ranges):
        lo, hi = values[2 * i], values[2 * i + 1]
        if lo < 0 or hi >= limit:
            raise ValueError(f"{name} values must be in [0, {limit}) ({what}), found [{lo}, {hi}]")
    flags = values[2 * len(ranges):]
    if attention_mask is not None and flags.pop(0):
        raise ValueError("attention_mask must contain only 0 and 1")
    if holes is not None and flags.pop(0):
        rows = holes.nonzero().flatten().tolist()[:5]
        raise ValueError(
            f"attention_mask rows {rows} have masked positions between real tokens: {config.family}'s "
            "sliding-window layers count those positions in transformers, which this engine (packing real "
            "tokens only) does not; pad on the right or the left only")
    if cls_masked is not None and flags.pop(0):
        rows = cls_masked.nonzero().flatten().tolist()[:5]
        raise ValueError(
            f"attention_mask masks position 0 of rows {rows} that hold real tokens (left padding): "
            "pooler_output reads position 0, which this engine does not compute for padding. "
            "Pad on the right (or, for a bare encoder, load with add_pooling_layer=False)."
        )
    return ids, mask, types, positions
