"""Scoring token windows with a GPT, as the paper evaluates: overlapping windows, each
target scored once with as much context as fits. Everything runs on the mesh the model was
loaded on, whatever mesh trained it; batches are padded to split over its data axis."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from megajax.core.mesh import padded_batches
from megajax.errors import UserError


def perplexity(mean_loss: float) -> float:
    """exp(mean loss), infinite past what a float holds (math.exp raises OverflowError there):
    a diverged model's perplexity is a result to report, not a crash."""
    return math.exp(mean_loss) if mean_loss < 709.0 else math.inf


def stride_windows(n_tokens: int, seq_len: int, stride: int) -> list[tuple[int, int]]:
    """(start, first_scored) pairs: window i covers tokens[start : start+seq_len+1] and scores
    the targets (predictions of token j+1) j in [first_scored, start+seq_len). The first window
    scores all of its targets, later ones only the `stride` new ones, so every token after the
    first is scored exactly once, with as much context as fits (Megatron's overlapping eval)."""
    if not 0 < stride <= seq_len:
        raise UserError(f"stride must be in 1..{seq_len}, got {stride}")
    n_targets = n_tokens - 1
    if n_targets <= 0:
        return []
    count = max(math.ceil((n_targets - seq_len) / stride), 0) + 1
    windows = []
    for i in range(count):
        start = i * stride
        windows.append((start, start if i == 0 else start + seq_len - stride))
    return windows


def _forward_fn(model):
    @jax.jit
    def losses_and_argmax(m, tokens, targets):
        logits = m(tokens)
        return m.token_losses(tokens, targets), jnp.argmax(logits, -1).astype(jnp.int32)

    return losses_and_argmax


def score_windows(model, rows: list[tuple[np.ndarray, np.ndarray]], batch_size: int, progress=None):
    """Run (tokens, score_mask) rows of length at most seq_len+1 through the model in batches.
    Returns per-row (summed loss of scored targets, count, per-target losses, argmax).
    `progress(done, total)` is called after each batch."""
    seq_len = model.cfg.seq_len
    fn = _forward_fn(model)
    out = []
    for idx, real in padded_batches(len(rows), batch_size, model.layout.shape):
        toks = np.zeros((len(idx), seq_len + 1), np.int32)
        for j, i in enumerate(idx):
            toks[j, : len(rows[i][0])] = rows[i][0]
        losses, argmax = jax.device_get(fn(model, toks[:, :-1], toks[:, 1:]))
        for j in np.flatnonzero(real):
            mask = np.zeros(seq_len, bool)
            mask[: len(rows[idx[j]][1])] = rows[idx[j]][1]
            out.append(
                (
                    float(losses[j][mask].astype(np.float64).sum()),
                    int(mask.sum()),
                    losses[j],
                    argmax[j],
                )
            )
        if progress:
            progress(len(out), len(rows))
    return out


def perplexity_of_tokens(
    model, tokens: np.ndarray, stride: int, batch_size: int, progress=None
) -> dict:
    seq_len = model.cfg.seq_len
    rows = []
    for start, first in stride_windows(len(tokens), seq_len, stride):
        t = np.asarray(tokens[start : start + seq_len + 1], np.int32)
        mask = np.zeros(len(t) - 1, bool)
        mask[first - start :] = True
        rows.append((t, mask))
    scored = score_windows(model, rows, batch_size, progress)
    total = sum(s[0] for s in scored)
    count = sum(s[1] for s in scored)
    return {
        "loss_sum": total,
        "tokens": count,
        "loss": total / count,
        "ppl": perplexity(total / count),
        "windows": len(rows),
        "stride": stride,
    }
