import torch, transformers as T
torch.manual_seed(0)
cfgs = {
 "bert": T.BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128, vocab_size=30522),
 "bert768": T.BertConfig(hidden_size=768, num_hidden_layers=1, num_attention_heads=12, intermediate_size=3072, vocab_size=30522),
 "mpnet": T.MPNetConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128, vocab_size=30527),
 "deberta": T.DebertaV2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128, vocab_size=30522, relative_attention=True, pos_att_type=["p2c","c2p"], position_buckets=32, max_relative_positions=64, share_att_key=True, norm_rel_ebd="layer_norm"),
 "modernbert": T.ModernBertConfig(hidden_size=64, num_hidden_layers=3, num_attention_heads=2, intermediate_size=128, vocab_size=50368, local_attention=16, global_attn_every_n_layers=2),
}
for name, c in cfgs.items():
    m = T.AutoModel.from_config(c).eval()
    m.save_pretrained(f"/tmp/cmp/models/{name}")
print("ok")
