"""`bertfast embed`: a corpus to sentence embeddings (readers -> job -> writer; cluster for --ray)."""
