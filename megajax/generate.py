"""Autoregressive sampling from a GPT (temperature, top-k), sharded like training."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def sample_logits(logits, key, temperature: float, top_k: int | None):
    """One token id per row from (b, vocab) float32 logits; temperature 0 means greedy."""
    if temperature <= 0:
        return jnp.argmax(logits, axis=-1)
    logits = logits / temperature
    if top_k:
        kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1)


def generate(model, prompt_tokens, max_new_tokens: int, temperature: float = 1.0,
             top_k: int | None = None, rng=None, eos_id: int | None = None) -> np.ndarray:
    """Continue each row of `prompt_tokens` (b, t) by up to `max_new_tokens` tokens.

    Recomputes the forward pass over a fixed window of the model's context each step (one
    compiled program for every step); rows that produced `eos_id` keep emitting it.
    """
    prompt = np.atleast_2d(np.asarray(prompt_tokens, dtype=np.int32))
    rows, t = prompt.shape
    dp = model.layout.dp  # the batch is sharded over "data": pad it to a multiple
    prompt = np.concatenate([prompt, np.repeat(prompt[:1], -rows % dp, axis=0)])
    b = prompt.shape[0]
    ctx = model.cfg.seq_len
    rng = jax.random.key(0) if rng is None else rng

    @jax.jit
    def next_token(window, pos, key):
        logits = model(window)[:, pos, :].astype(jnp.float32)
        return sample_logits(logits, key, temperature, top_k)

    out = prompt.copy()
    done = np.zeros(b, bool)
    for i in range(max_new_tokens):
        window = out[:, -ctx:]
        pos = window.shape[1] - 1
        padded = np.zeros((b, ctx), np.int32)
        padded[:, : window.shape[1]] = window
        tok = np.asarray(next_token(padded, pos, jax.random.fold_in(rng, i)))
        if eos_id is not None:
            tok = np.where(done, eos_id, tok)
            done |= tok == eos_id
        out = np.concatenate([out, tok[:, None].astype(np.int32)], axis=1)
        if eos_id is not None and done.all():
            break
    return out[:rows, t:]
