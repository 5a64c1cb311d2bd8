"""Random-weight DeBERTa-v2 models (transformers' own classes) and ragged batches for them.

CONFIGS name the styles the tests cross: "v2" (own position projections, no log buckets, absolute positions and
token types), "v3" (deberta-v3 / mDeBERTa: shared attention keys, log buckets, LayerNorm'd relative embeddings, no
absolute positions, no token types), "v3-256" (v3 with deberta-v3's 256 buckets: rows past 256 reach the log
buckets), "c2p" and "p2c" (one term each). The builders move every norm and bias off its init and draw the
relative embeddings at unit scale (the init leaves the position terms small enough to hide mistakes).
`save_tokenizer` writes a deberta-v3-style tokenizer (transformers' own DebertaV2Tokenizer: Unigram pieces after a
Metaspace, [CLS] a [SEP] b [SEP] with type ids 0 / 1) for checkpoints the tests save.
"""

from __future__ import annotations

import string

import torch
import transformers

from helpers.tokens import layout_mask


BASE = dict(vocab_size=97, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96,
            max_position_embeddings=64, layer_norm_eps=1e-7, relative_attention=True, pad_token_id=0)
CONFIGS = {
    "v2": dict(pos_att_type=["p2c", "c2p"], max_relative_positions=24, type_vocab_size=2),
    "v3": dict(pos_att_type="p2c|c2p", share_att_key=True, position_buckets=16, max_relative_positions=64,
               norm_rel_ebd="layer_norm", position_biased_input=False),
    "v3-256": dict(pos_att_type="p2c|c2p", share_att_key=True, position_buckets=256, max_position_embeddings=512,
                   norm_rel_ebd="layer_norm", position_biased_input=False, hidden_size=32, num_attention_heads=2,
                   intermediate_size=48),
    "c2p": dict(pos_att_type=["c2p"], position_buckets=8, max_relative_positions=32, hidden_act="gelu_new"),
    "p2c": dict(pos_att_type=["p2c"], share_att_key=True, type_vocab_size=3),
}
LENGTHS = [50, 1, 37, 9]  # 50 > 2 * 16: v3's log buckets; 50 > 24: v2's clamped distances; a 1-token row


def build(style="v3", seed=0, task=None, **overrides):
    """transformers' DebertaV2Model (or DebertaV2For<task>) of config style `style`, random weights, fp32, eval."""
    cfg = transformers.DebertaV2Config(**{**BASE, **CONFIGS[style], **overrides})
    torch.manual_seed(seed)
    cls = transformers.DebertaV2Model if task is None else getattr(transformers, f"DebertaV2For{task}")
    model = cls(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name.lower() or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
            elif "rel_embeddings" in name:
                p.normal_(0, 1.0)
    return model


def batch(lengths=LENGTHS, seed=1, vocab=97, type_vocab=0, layout="right"):
    """ids, mask, types (B, S): pad id 0 at padded positions; layout "left" pads on the left, "holes" masks a few
    columns inside the rows (relative positions then count columns, as in transformers)."""
    g = torch.Generator().manual_seed(seed)
    mask = layout_mask(lengths, layout)
    S = mask.shape[1]
    ids = torch.randint(1, vocab, (len(lengths), S), generator=g) * mask
    types = torch.randint(0, max(type_vocab, 1), (len(lengths), S), generator=g) * mask
    return ids, mask, types


def save_tokenizer(path, texts) -> int:
    """A DebertaV2Tokenizer into directory `path` (tokenizer.json, tokenizer_config.json): deberta-v3's special ids
    ([PAD] 0, [CLS] 1, [SEP] 2, [UNK] 3), a piece per word of `texts` (lower and as written), ASCII characters for
    the rest, [UNK] beyond. Returns the vocabulary size."""
    words = sorted({w for t in texts for word in t.split() for w in (word, word.lower())})
    vocab = [(t, 0.0) for t in ("[PAD]", "[CLS]", "[SEP]", "[UNK]", "[MASK]")]
    vocab += [("\u2581", -3.0)] + [(c, -6.0) for c in string.ascii_letters + string.digits + string.punctuation]
    vocab += [("\u2581" + w, -1.0) for w in words]
    transformers.DebertaV2Tokenizer(vocab=vocab, unk_token="[UNK]").save_pretrained(path)
    return len(vocab)
