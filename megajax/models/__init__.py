"""GPT and BERT built from the parallel core, the model registry with sharded init and the
params binder, and sampling with a sharded KV cache."""
