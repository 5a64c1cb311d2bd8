"""The native WordPiece (`NativeWordPiece`, csrc/cpu/text/wordpiece.cpp) against the tokenizers library: the same padded
ids, mask and types on generated texts of every ASCII character class, with words from the vocabulary, pieces, words
no entry covers, words past max_input_chars_per_word, added tokens' texts, non-ASCII texts (the library's rows, spliced
in) and truncation inside a word; tokenizers of another shape get no twin."""

from __future__ import annotations

import json
import os
import random
import string

import numpy as np
import pytest
import tokenizers

from bertfast.backends.cpu.ext import _C
from bertfast.tokenization import NativeWordPiece, library_tokenize, load_tokenizer

pytestmark = pytest.mark.skipif(_C is None, reason="the native extension is not built")


WHITESPACE = " \t\n\r\x0b\x0c"
CONTROLS = "".join(map(chr, range(32))) + "\x7f"
NON_ASCII = ["é", "Ünïcödé", "中文字", "🙂", "\u00a0", "\u3000", "e\u0301", "naïve", "\u2019", "\u2014"]
ADDED = ["[CLS]", "[SEP]", "[MASK]", "[PAD]", "[UNK]", "[mask]", "[Mask]", "[CLS", "CLS]"]


def _minilm_dir():
    import bertfast

    return bertfast.default_model_path()


def _texts(vocab: list[str], n: int, seed: int) -> list[str]:
    """n texts of 0-200 tokens, every other one ASCII only (the native path's, past any truncation length)."""
    rng = random.Random(seed)
    ascii_only = False
    words = [w for w in vocab if w.isascii() and w.isalnum()]
    specials = [w for w in vocab if w.startswith("<") and w.endswith(">")]  # MPNet's added tokens' texts
    pieces = [w[2:] for w in vocab if w.startswith("##") and w[2:].isascii()]

    def token():
        kind = rng.random()
        if kind < 0.35:
            w = rng.choice(words)
            return w.upper() if rng.random() < 0.1 else w.capitalize() if rng.random() < 0.2 else w
        if kind < 0.5:  # a word and its continuations: split into pieces (or unk where a part has no entry)
            return rng.choice(words) + "".join(rng.choice(pieces) for _ in range(rng.randint(1, 3)))
        if kind < 0.62:
            return "".join(rng.choice(string.ascii_letters + string.digits) for _ in range(rng.randint(1, 12)))
        if kind < 0.75:
            return "".join(rng.choice(string.punctuation) for _ in range(rng.randint(1, 3)))
        if kind < 0.83:
            return "".join(rng.choice(WHITESPACE) for _ in range(rng.randint(1, 3)))
        if kind < 0.88:
            return rng.choice(CONTROLS) + rng.choice(words)
        if kind < 0.91:  # past max_input_chars_per_word (100), or just at it
            return "".join(rng.choice("ab") for _ in range(rng.choice([99, 100, 101, 150])))
        if kind < 0.94 and not ascii_only:
            return rng.choice(NON_ASCII)
        if kind < 0.96 and not ascii_only:
            return rng.choice(ADDED + specials)
        return rng.choice(words) + rng.choice(string.punctuation) + rng.choice(words)

    out = []
    for i in range(n):
        ascii_only = i % 2 == 0
        length = rng.choice([0, 1, 2, 5, 20, 60, 200])
        sep = "" if rng.random() < 0.1 else " "
        out.append(sep.join(token() for _ in range(length)))
    return out


def _assert_same(tok, texts, batch: int = 64):
    native = NativeWordPiece.of(tok)
    assert native is not None
    for s in range(0, len(texts), batch):
        got, want = native(texts[s:s + batch]), library_tokenize(tok, texts[s:s + batch])
        assert got is not None
        for name, g, w in zip(("input_ids", "attention_mask", "token_type_ids"), got, want):
            assert g.shape == w.shape, (name, s)
            rows = np.flatnonzero((g != w).any(1))
            assert rows.size == 0, f"{name} differs on {texts[s + rows[0]]!r}"


@pytest.fixture(scope="module")
def minilm_tokenizer():
    return load_tokenizer(_minilm_dir(), 512)


def test_minilm_tokenizer_equals_the_library(minilm_tokenizer):
    vocab = list(minilm_tokenizer.get_vocab())
    _assert_same(minilm_tokenizer, _texts(vocab, 1500, seed=0))  # truncated at 256: the longest texts cross it


@pytest.mark.parametrize("max_length", [2, 3, 7, 16])
def test_truncation_inside_words(minilm_tokenizer, max_length):
    tok = tokenizers.Tokenizer.from_str(minilm_tokenizer.to_str())
    tok.enable_truncation(max_length=max_length)
    vocab = list(tok.get_vocab())
    _assert_same(tok, _texts(vocab, 300, seed=max_length))


def test_no_truncation(minilm_tokenizer):
    tok = tokenizers.Tokenizer.from_str(minilm_tokenizer.to_str())
    tok.no_truncation()
    _assert_same(tok, _texts(list(tok.get_vocab()), 200, seed=5))


def _small_vocab_dir(tmp_path, lowercase_vocab: bool):
    rng = random.Random(1)
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    letters = string.ascii_lowercase if lowercase_vocab else string.ascii_letters
    words = {"".join(rng.choice(letters) for _ in range(rng.randint(1, 4))) for _ in range(300)}
    pieces = {"##" + "".join(rng.choice(letters) for _ in range(rng.randint(1, 3))) for _ in range(200)}
    vocab = specials + sorted(set(string.punctuation) | set(string.digits)) + sorted(words) + sorted(pieces)
    (tmp_path / "vocab.txt").write_text("\n".join(vocab) + "\n")
    return tmp_path, vocab


@pytest.mark.parametrize("cased", [False, True], ids=["uncased", "cased"])
def test_vocab_txt_tokenizers(tmp_path, cased):
    """BertWordPieceTokenizer from a vocab.txt (BertProcessing), cased or not, where most words split or are unk."""
    directory, vocab = _small_vocab_dir(tmp_path, lowercase_vocab=not cased)
    (directory / "tokenizer_config.json").write_text(json.dumps({"do_lower_case": not cased}))
    tok = load_tokenizer(str(directory), 64)
    assert json.loads(tok.to_str())["post_processor"]["type"] == "BertProcessing"
    _assert_same(tok, _texts(vocab, 800, seed=2))


def test_sentence_transformers_lowercase_in_front(tmp_path):
    """sentence_bert_config.json's do_lower_case puts a Lowercase normalizer before a cased BertNormalizer."""
    directory, vocab = _small_vocab_dir(tmp_path, lowercase_vocab=True)
    (directory / "tokenizer_config.json").write_text(json.dumps({"do_lower_case": False}))
    (directory / "sentence_bert_config.json").write_text(json.dumps({"do_lower_case": True}))
    tok = load_tokenizer(str(directory), 64)
    assert json.loads(tok.to_str())["normalizer"]["type"] == "Sequence"
    _assert_same(tok, _texts(vocab, 400, seed=3))


def test_mpnet_tokenizer_as_transformers_converts_it(tmp_path):
    """transformers' MPNetTokenizerFast from a vocab.txt (RobertaProcessing: <s> text </s>; its specials are added
    tokens here)."""
    import shutil

    import transformers
    shutil.copy(os.path.join(_minilm_dir(), "vocab.txt"), tmp_path / "vocab.txt")
    tok = transformers.MPNetTokenizerFast.from_pretrained(str(tmp_path)).backend_tokenizer
    assert json.loads(tok.to_str())["post_processor"]["type"] == "RobertaProcessing"
    tok.enable_padding(pad_id=1, pad_token="<pad>")
    tok.enable_truncation(max_length=128)
    _assert_same(tok, _texts(list(tok.get_vocab()) + ["<s>", "</s>", "<mask>"], 600, seed=6))


def test_batches_of_only_library_rows_and_empty(minilm_tokenizer):
    native = NativeWordPiece.of(minilm_tokenizer)
    for texts in (["é", "[CLS] x", "中文"], [], [""], ["", "é"]):
        got, want = native(texts), library_tokenize(minilm_tokenizer, texts)
        for g, w in zip(got, want):
            assert g.shape == w.shape and (g == w).all(), texts


def test_other_shapes_get_no_twin(minilm_tokenizer, monkeypatch):
    from tokenizers import normalizers, pre_tokenizers

    tok = tokenizers.Tokenizer.from_str(minilm_tokenizer.to_str())
    tok.normalizer = normalizers.NFKC()
    assert NativeWordPiece.of(tok) is None
    tok = tokenizers.Tokenizer.from_str(minilm_tokenizer.to_str())
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    assert NativeWordPiece.of(tok) is None
    tok = tokenizers.Tokenizer.from_str(minilm_tokenizer.to_str())
    tok.post_processor = None
    assert NativeWordPiece.of(tok) is None
    monkeypatch.setenv("BERTFAST_NATIVE_TOKENIZER", "0")
    assert NativeWordPiece.of(minilm_tokenizer) is None


@pytest.mark.parametrize("setting", ["multiple_of_8", "fixed", "left", "no_padding", "truncate_left"])
def test_settings_it_does_not_handle_go_to_the_library(minilm_tokenizer, setting):
    tok = tokenizers.Tokenizer.from_str(minilm_tokenizer.to_str())
    native = NativeWordPiece.of(tok)
    assert native(["a text"]) is not None
    if setting == "multiple_of_8":
        tok.enable_padding(pad_to_multiple_of=8)
    elif setting == "fixed":
        tok.enable_padding(length=32)
    elif setting == "left":
        tok.enable_padding(direction="left")
    elif setting == "no_padding":
        tok.no_padding()
    else:
        tok.enable_truncation(max_length=16, direction="left")
    assert native(["a text"]) is None


def test_encoder_tokenize_uses_it_and_matches(minilm_tokenizer):
    from bertfast import Encoder

    enc = Encoder.from_pretrained(_minilm_dir())
    texts = _texts(list(minilm_tokenizer.get_vocab()), 100, seed=4)
    got = enc.tokenize(texts)
    assert isinstance(enc._native_tokenizer[1], NativeWordPiece)
    want = library_tokenize(enc.tokenizer, texts)
    for g, w in zip(got, want):
        assert g.shape == w.shape and bool((g.numpy() == w).all())


def test_minilm_corpus_is_all_native(minilm_tokenizer):
    """The bench's corpus (plain English) never leaves the native path: every row's length comes back >= 0."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "bench_embed", os.path.join(os.path.dirname(__file__), "..", "benchmarks", "bench_embed.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    texts = bench.corpus(500)
    native = NativeWordPiece.of(minilm_tokenizer)
    _, lengths = native.native.encode(texts, 256)
    assert int(lengths.min()) >= 3
    _assert_same(minilm_tokenizer, texts, batch=250)


@pytest.mark.parametrize("direction", ["right", "left"])
@pytest.mark.parametrize("limit", [2, 5, 64])
def test_rows_truncate_and_overflow_as_the_library(minilm_tokenizer, direction, limit):
    """`NativeWordPiece.rows` (the server's ids): each text cut at the limit from either side, and whether it was
    over, as an unpadded library tokenizer gives them; texts left to the library in the same call."""
    from bertfast.tokenization import unpadded

    tok = tokenizers.Tokenizer.from_str(minilm_tokenizer.to_str())
    tok.enable_truncation(max_length=limit)
    library = unpadded(tok, direction)
    texts = _texts(list(tok.get_vocab()), 300, seed=limit)
    rows, over = NativeWordPiece.of(tok).rows(texts, limit, library)
    want = library.encode_batch(texts)
    assert rows == [e.ids for e in want]
    assert over == [bool(e.overflowing) for e in want]
    assert any(over) and not all(over)
