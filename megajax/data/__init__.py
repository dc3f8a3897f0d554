"""Data: text sources, tokenizers, GPT token batches, BERT pretraining pairs and masking, and
the fine-tuning readers. Every batch is a pure function of (seed, step)."""
