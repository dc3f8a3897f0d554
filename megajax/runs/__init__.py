"""What a run leaves on disk and reads back: the workdir (config, tokenizer, checkpoints,
metrics), its orbax checkpoints and its metrics.jsonl and loss curve."""
