"""Tokenizer loading for `Encoder.encode`: `tokenizer.json` (tokenizers library) or `vocab.txt`.

Batches are padded to their longest sequence (never to a fixed length) and truncated to the
model's limit (`sentence_bert_config.json`'s `max_seq_length`, else the tokenizer's `model_max_length`,
at most `max_position_embeddings`), so the engine only ever sees real tokens plus the padding a batch
needs. `do_lower_case` there puts a Lowercase normalizer in front, as sentence-transformers does.
"""

from __future__ import annotations

import json
import os


def _read_json(path):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError):
        return {}


def load_tokenizer(directory: str, max_positions: int):
    """A `tokenizers.Tokenizer` for the model in `directory`, or None when it ships none."""
    from tokenizers import Tokenizer

    tok_json = os.path.join(directory, "tokenizer.json")
    vocab = os.path.join(directory, "vocab.txt")
    tok_cfg = _read_json(os.path.join(directory, "tokenizer_config.json"))
    if os.path.isfile(tok_json):
        tokenizer = Tokenizer.from_file(tok_json)
    elif os.path.isfile(vocab):
        from tokenizers.implementations import BertWordPieceTokenizer

        tokenizer = BertWordPieceTokenizer(vocab, lowercase=bool(tok_cfg.get("do_lower_case", True)))
    else:
        return None
    limit = max_positions
    st_cfg = _read_json(os.path.join(directory, "sentence_bert_config.json"))
    for value in (st_cfg.get("max_seq_length"), tok_cfg.get("model_max_length")):
        if isinstance(value, int) and 0 < value < limit:
            limit = value
            break
    tokenizer.enable_truncation(max_length=limit)
    if st_cfg.get("do_lower_case") and not _lowercases(tokenizer):
        from tokenizers import normalizers

        normalizer = tokenizer.normalizer  # as sentence-transformers does: Lowercase in front
        tokenizer.normalizer = (normalizers.Lowercase() if normalizer is None
                                else normalizers.Sequence([normalizers.Lowercase(), normalizer]))
    pad_id = tokenizer.token_to_id("[PAD]")
    tokenizer.enable_padding(pad_id=0 if pad_id is None else pad_id, pad_token="[PAD]")
    return tokenizer


def _lowercases(tokenizer) -> bool:
    normalizer = json.loads(tokenizer.to_str()).get("normalizer") or {}
    parts = normalizer.get("normalizers", [normalizer])
    return any(p.get("type") == "Lowercase" or p.get("lowercase") is True for p in parts)


def prompt_length(tokenizer, prompt: str) -> int:
    """Tokens a prompt adds at the start of a text, as sentence-transformers counts them: the prompt
    tokenized alone with its special tokens, less a trailing special token ([SEP], </s>)."""
    ids = tokenizer.encode(prompt).ids
    special = {i for i, tok in tokenizer.get_added_tokens_decoder().items() if tok.special}
    return len(ids) - (1 if ids and ids[-1] in special else 0)


def unpadded(tokenizer, direction: str = "right"):
    """A copy of a `load_tokenizer` tokenizer that returns each text's own tokens (no padding), truncated
    at the same limit (`copy.truncation["max_length"]`) from `direction`: 'right' keeps a text's start,
    'left' its end. A text longer than the limit keeps the rest in its encoding's `overflowing`."""
    from tokenizers import Tokenizer

    if direction not in ("right", "left"):
        raise ValueError(f"direction must be 'right' or 'left', got {direction!r}")
    copy = Tokenizer.from_str(tokenizer.to_str())
    copy.no_padding()
    copy.enable_truncation(max_length=tokenizer.truncation["max_length"], direction=direction)
    return copy


def token_budget_batches(lengths, batch_tokens: int) -> list[list[int]]:
    """Group texts by token count so each padded batch holds at most `batch_tokens` tokens.

    lengths: tokens per text (after truncation). Returns lists of indices into `lengths`, longest
    first, each batch's rows x its longest length <= batch_tokens; a text longer than the budget
    alone forms a batch. Every index appears exactly once.
    """
    if batch_tokens < 1:
        raise ValueError(f"batch_tokens must be >= 1, got {batch_tokens}")
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches, current = [], []
    for i in order:
        # longest first: the batch's first row sets its padded length
        if current and (len(current) + 1) * max(lengths[current[0]], 1) > batch_tokens:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches
