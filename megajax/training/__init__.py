"""Training: the optimizer, the compiled step, checkpoints, the workdir, metrics, signals,
multi-process agreement, and the loop that ties them together."""
