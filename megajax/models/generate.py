"""Autoregressive sampling with a KV cache split over the model axis like the heads."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from megajax.core import sharding as S
from megajax.core.mesh import padded_rows
from megajax.models.registry import ModelDef, abstract_model


def sample_logits(logits, key, temperature: float, top_k: int | None):
    """One token id per row from (b, vocab) float32 logits; temperature 0 means greedy."""
    if temperature <= 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / temperature
    if top_k:
        kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def _sample_replicated(model, logits, key, temperature, top_k):
    """Sampled ids replicated on every device, so every process can read them."""
    tok = sample_logits(logits.astype(jnp.float32), key, temperature, top_k)
    return model.layout.constrain(tok, P())


@functools.partial(jax.jit, static_argnames=("temperature", "top_k"))
def _prefill(model, prompt, cache, key, temperature, top_k):
    logits, cache = model.decode(prompt, cache, 0)
    return _sample_replicated(model, logits[:, -1], key, temperature, top_k), cache


@functools.partial(jax.jit, static_argnames=("temperature", "top_k"), donate_argnames=("cache",))
def _step(model, token, cache, pos, key, temperature, top_k):
    logits, cache = model.decode(token[:, None], cache, pos)
    return _sample_replicated(model, logits[:, -1], key, temperature, top_k), cache


@functools.partial(jax.jit, static_argnames=("temperature", "top_k"))
def _window_step(model, window, last, key, temperature, top_k):
    logits = model(window)
    return _sample_replicated(model, jnp.take(logits, last, axis=1), key, temperature, top_k)


def _checked(model, prompt_tokens, max_new_tokens, temperature, top_k):
    """The prompt as (b, t) int32 and top_k clamped to the vocabulary, or a ValueError that says
    which argument is wrong (jax would fail on them deep inside, or sample from garbage: an id
    outside the vocabulary embeds as zeros, a NaN temperature samples from NaN logits)."""
    if getattr(model.cfg, "kind", None) != "gpt":
        raise ValueError(f"generate continues text with a GPT; this is a {type(model).__name__}")
    prompt = np.atleast_2d(np.asarray(prompt_tokens))
    if prompt.ndim != 2 or prompt.dtype.kind not in "iu" or prompt.shape[1] == 0:
        raise ValueError(
            "the prompt must be token ids, (t,) or (b, t) integers with t >= 1, got "
            f"{prompt.dtype} {prompt.shape}"
        )
    if prompt.min() < 0 or prompt.max() >= model.cfg.vocab_size:
        raise ValueError(
            f"prompt ids must lie in [0, {model.cfg.vocab_size}), the model's vocabulary; got "
            f"{prompt.min()}..{prompt.max()}"
        )
    if (
        isinstance(max_new_tokens, bool)
        or not isinstance(max_new_tokens, (int, np.integer))
        or max_new_tokens < 0
    ):
        raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    if not np.isfinite(temperature) or temperature < 0:
        raise ValueError(
            f"temperature must be a finite number >= 0 (0 is greedy), got {temperature}"
        )
    if top_k is not None and top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 or None: no top-k), got {top_k}")
    return prompt.astype(np.int32), min(top_k, model.cfg.vocab_size) if top_k else None


def _for_decoding(model):
    """The same weights with the inference layout (Layout.for_model): a model built for training
    with sequence parallelism cannot decode one token at a time (eval.py and train.py's sample
    build it so already)."""
    if not model.layout.sequence_parallel:
        return model
    layout = S.Layout.for_model(model.layout.mesh, model.cfg, "inference")
    return ModelDef(abstract_model(model.cfg, layout)).bind(ModelDef(model).params(model))


def generate(
    model,
    prompt_tokens,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    rng=None,
    eos_id: int | None = None,
    stopped=None,
    emit=None,
) -> np.ndarray:
    """Continue each row of `prompt_tokens` (b, t), equal-length prompts, by `max_new_tokens`.

    The prompt fills the cache in one pass, then each new token costs one position's worth of
    compute. Past the model's context (learned positions end there) it slides a window and
    recomputes. Rows that emitted `eos_id` keep emitting it; all rows done ends early, and so
    does `stopped()` turning true (a signal: what was generated so far is returned). `emit`,
    if given, receives each new token of every row, (b,), as soon as it is sampled (to stream).
    Returns the new tokens, (b, n).
    """
    prompt, top_k = _checked(model, prompt_tokens, max_new_tokens, temperature, top_k)
    model = _for_decoding(model)
    rows, t = prompt.shape
    if max_new_tokens == 0:
        return np.zeros((rows, 0), np.int32)
    # learned positions: the table's rows; rotary: the model's max_positions
    ctx = model.cfg.context
    # room in the cache for the first new token; a context of 1 keeps one prompt token
    if t >= ctx:
        keep = max(ctx - 1, 1)
        prompt, t = prompt[:, t - keep :], keep
    prompt = prompt[padded_rows(rows, model.layout.shape)]
    b = prompt.shape[0]
    rng = jax.random.key(0) if rng is None else rng
    cache = model.init_cache(b, min(ctx, t + max_new_tokens))  # no longer than the sample needs
    tok, cache = _prefill(model, prompt, cache, jax.random.fold_in(rng, 0), temperature, top_k)
    out = [np.asarray(tok)]
    emit = emit or (lambda tokens: None)
    emit(out[0][:rows])
    done = out[0] == eos_id if eos_id is not None else np.zeros(b, bool)
    seq = np.concatenate([prompt, out[0][:, None]], axis=1)
    for i in range(1, max_new_tokens):
        if done.all() or (stopped is not None and stopped()):
            break
        key = jax.random.fold_in(rng, i)
        pos = t + i - 1  # position of the token being fed
        if pos < ctx:
            tok, cache = _step(model, out[-1], cache, np.int32(pos), key, temperature, top_k)
        else:
            tok = _window_step(model, seq[:, -ctx:], ctx - 1, key, temperature, top_k)
        tok = np.asarray(tok)
        if eos_id is not None:
            tok = np.where(done, eos_id, tok)
            done |= tok == eos_id
        out.append(tok)
        emit(tok[:rows])
        # the window is all it reads
        seq = np.concatenate([seq[:, 1 - ctx :], tok[:, None]], axis=1)
    return np.stack(out, axis=1)[:rows]
