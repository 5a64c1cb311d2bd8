"""Tokenizer loading for `Encoder.encode`: `tokenizer.json` (tokenizers library) or `vocab.txt`.

Batches are padded to their longest sequence (never to a fixed length) and truncated to the
model's limit (`sentence_bert_config.json`'s `max_seq_length`, else the tokenizer's `model_max_length`,
at most `max_position_embeddings`), so the engine only ever sees real tokens plus the padding a batch
needs. `do_lower_case` there puts a Lowercase normalizer in front, as sentence-transformers does.
A tokenizer of BERT's WordPiece shape gets a native twin (`NativeWordPiece`) for its ASCII texts: the same ids.
"""

from __future__ import annotations

import json
import os

import numpy as np


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


class NativeWordPiece:
    """A `load_tokenizer` tokenizer's padded (input_ids, attention_mask, token_type_ids) with its ASCII texts
    tokenized by `_C.WordPiece` (csrc/cpu/text/wordpiece.cpp): the ids the tokenizers library gives, in ~1/30 of its
    CPU time on bench_embed's corpus (docs/embed.md). Built by `of` only for BERT's pipeline (BertNormalizer with
    clean_text, optionally after a Lowercase; BertPreTokenizer; WordPiece; one special token before and after the
    text, type 0: BERT's and MPNet's tokenizers); texts that are not ASCII or hold an added token's content go to the
    library, in the same call. BERTFAST_NATIVE_TOKENIZER=0 turns it off."""

    def __init__(self, tokenizer, native):
        self.tokenizer, self.native = tokenizer, native

    @classmethod
    def of(cls, tokenizer):
        """The twin of `tokenizer` (a tokenizers.Tokenizer), or None where its pipeline is of another shape, the
        extension is not built, or BERTFAST_NATIVE_TOKENIZER=0."""
        from .backends.cpu.ext import _C

        if _C is None or os.environ.get("BERTFAST_NATIVE_TOKENIZER", "1") == "0":
            return None
        spec = json.loads(tokenizer.to_str())
        model, pre = spec.get("model") or {}, spec.get("pre_tokenizer") or {}
        norm, post = spec.get("normalizer") or {}, spec.get("post_processor") or {}
        parts = norm.get("normalizers", []) if norm.get("type") == "Sequence" else [norm]
        kinds = [p.get("type") for p in parts]
        if (model.get("type") != "WordPiece" or pre.get("type") != "BertPreTokenizer"
                or kinds.count("BertNormalizer") != 1 or set(kinds) - {"BertNormalizer", "Lowercase"}
                or not all(p.get("clean_text") for p in parts if p.get("type") == "BertNormalizer")):
            return None
        around = _special_ids(post)
        vocab = model.get("vocab") or {}
        if around is None or model.get("unk_token") not in vocab:
            return None
        native = _C.WordPiece(vocab=list(vocab.items()), unk_token=model["unk_token"],
                              prefix=model.get("continuing_subword_prefix") or "",
                              cls=around[0], sep=around[1],
                              lowercase=any(p.get("type") == "Lowercase" or p.get("lowercase") for p in parts),
                              max_chars=int(model.get("max_input_chars_per_word", 100)),
                              added=[a["content"] for a in spec.get("added_tokens") or []])
        return cls(tokenizer, native)

    def __call__(self, texts: list[str]):
        """(ids, mask, types) (N, longest) int64 NumPy arrays, as the library pads them; None when the tokenizer's
        padding or truncation is now set otherwise than this handles (pad right to the longest, type 0; truncate
        on the right)."""
        max_length = _max_length(self.tokenizer)
        if max_length is None:
            return None
        flat, lengths = (t.numpy() for t in self.native.encode(texts, max_length))
        left = np.flatnonzero(lengths < 0)
        if left.size:  # the library's rows, spliced in where they belong
            starts = np.concatenate([[0], np.cumsum(np.maximum(lengths, 0))])[left]
            rows = [e.ids[:sum(e.attention_mask)] for e in _encode(self.tokenizer, [texts[i] for i in left])]
            parts, prev = [], 0
            for start, row in zip(starts, rows):
                parts += [flat[prev:start], np.asarray(row, dtype=np.int64)]
                prev = start
            flat = np.concatenate(parts + [flat[prev:]])
            lengths[left] = [len(r) for r in rows]
        width = int(lengths.max()) if len(texts) else 0
        mask = np.arange(width) < lengths[:, None]
        ids = np.full((len(texts), width), self.tokenizer.padding["pad_id"], dtype=np.int64)
        ids[mask] = flat
        return ids, mask.astype(np.int64), np.zeros_like(ids)

    def rows(self, texts: list[str], limit: int, library):
        """Each text's token ids truncated to `limit` as `library` (an `unpadded` copy of the tokenizer, truncating at
        `limit` from its direction) truncates them, and whether the text had more (the library's `overflowing`):
        (list of id lists, list of bool). Texts left to the library go to it."""
        left_side = library.truncation["direction"] == "left"
        flat, lengths = (t.numpy() for t in self.native.encode(texts, 1 << 62))  # whole: to tell what overflows
        ends = np.cumsum(np.maximum(lengths, 0))
        rows, over, rest = [], [], []
        for i, (end, n) in enumerate(zip(ends.tolist(), lengths.tolist())):
            row = flat[end - max(n, 0):end]
            if n > limit:  # [first] + the text's last or first limit - 2 tokens + [last], as the library cuts
                row = np.concatenate([row[:1], row[n - limit + 1:]] if left_side else [row[:limit - 1], row[-1:]])
            elif n < 0:
                rest.append(i)
            rows.append(row.tolist())
            over.append(n > limit)
        for i, e in zip(rest, _encode(library, [texts[i] for i in rest])):
            rows[i], over[i] = e.ids, bool(e.overflowing)
        return rows, over


def _special_ids(post: dict):
    """(id before, id after) the text of a BertProcessing, a RobertaProcessing (MPNet's, as transformers converts it)
    or a "[X] $A [Y]" TemplateProcessing (every type 0)."""
    if post.get("type") in ("BertProcessing", "RobertaProcessing"):  # one text: cls, its tokens, sep; type 0
        return post["cls"][1], post["sep"][1]
    single = post.get("single") or [] if post.get("type") == "TemplateProcessing" else []
    if [next(iter(p)) for p in single] != ["SpecialToken", "Sequence", "SpecialToken"]:
        return None
    if any(next(iter(p.values())).get("type_id") != 0 for p in single):
        return None
    ids = [(post.get("special_tokens") or {}).get(single[i]["SpecialToken"]["id"], {}).get("ids") for i in (0, 2)]
    return (ids[0][0], ids[1][0]) if all(isinstance(i, list) and len(i) == 1 for i in ids) else None


def _max_length(tokenizer):
    """The truncation length NativeWordPiece applies for `tokenizer`'s settings now, or None if it cannot."""
    pad, trunc = tokenizer.padding, tokenizer.truncation
    if (pad is None or pad["length"] is not None or pad["pad_to_multiple_of"] or pad["direction"] != "right"
            or pad["pad_type_id"] != 0):
        return None
    if trunc is None:
        return 1 << 62
    if trunc["direction"] != "right" or trunc["strategy"] not in ("longest_first", "only_first"):
        return None
    return trunc["max_length"] if trunc["max_length"] >= 2 else None


def _encode(tokenizer, texts):
    # encode_batch_fast (tokenizers >= 0.20) skips the character offsets, which nothing here reads
    return getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)(list(texts))


def library_tokenize(tokenizer, texts: list[str]):
    """(ids, mask, types) (N, longest) int64 NumPy arrays from the tokenizers library alone."""
    enc = _encode(tokenizer, texts)
    # NumPy builds the arrays from the id lists much faster than torch.tensor does
    return tuple(np.array([getattr(e, f) for e in enc], dtype=np.int64).reshape(len(enc), -1) if enc
                 else np.zeros((0, 0), dtype=np.int64) for f in ("ids", "attention_mask", "type_ids"))
