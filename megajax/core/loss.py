"""Vocab-parallel embedding lookup and fused vocab-parallel cross-entropy (Megatron section 3).

Both run under `jax.shard_map`, so the collectives are written out: each device sees only
its slice of the vocabulary, and only (batch, seq)-sized numbers cross the model axis,
never the (batch, seq, vocab) logits.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from megajax.core.ops import zero_cotangent
from megajax.core.sharding import DATA, MODEL

_NEG = float(jnp.finfo(jnp.float32).min)


def _vocab_range(local_size: int):
    start = jax.lax.axis_index(MODEL) * local_size
    return start, start + local_size


def vocab_parallel_lookup(table, ids, layout):
    """Embedding rows for `ids` from a table split over "model": one all-reduce of (b, s, h), or
    with sequence parallelism one reduce-scatter straight into sequence shards (b, s/tp, h)."""

    def local(table, ids):
        start, end = _vocab_range(table.shape[0])
        owned = (ids >= start) & (ids < end)
        rows = jnp.take(table, jnp.where(owned, ids - start, 0), axis=0)
        rows = jnp.where(owned[..., None], rows, jnp.zeros_like(rows))
        if layout.sequence_parallel:
            with jax.named_scope("embedding_reduce_scatter"):
                return jax.lax.psum_scatter(rows, MODEL, scatter_dimension=1, tiled=True)
        with jax.named_scope("embedding_all_reduce"):
            return jax.lax.psum(rows, MODEL)

    with jax.named_scope("embedding"):
        return layout.shard_map(local, (P(MODEL, None), P(DATA, None)), layout.between_blocks)(
            table, ids
        )


def vocab_parallel_cross_entropy(
    logits, targets, layout, vocab_size: int | None = None, with_accuracy: bool = False
):
    """Per-token -log softmax(logits)[target] for logits split over "model" on their last axis.

    Three all-reduces of (b, s) numbers: the max (for stability), the sum of exponentials and
    the target logit, which only the device owning that vocabulary slice contributes.
    Columns >= `vocab_size` (vocabulary padding) are excluded from the softmax.
    The backward pass is local: softmax - onehot on each device's own slice, recomputed from
    the logits and the (b, s) log-sum-exp, so the logits are the only (b, s, vocab/tp) array
    kept for it (as Megatron's fused kernel keeps one).
    With `with_accuracy`, also return whether the target is the argmax (target logit equal
    to the global max): a by-product of the two reductions, no extra collective.
    """

    def local(logits, targets):
        start = jax.lax.axis_index(MODEL) * logits.shape[-1]
        loss, hits = _cross_entropy(logits.astype(jnp.float32), targets, start, vocab_size)
        return (loss, hits) if with_accuracy else loss

    out_specs = (P(DATA, None), P(DATA, None)) if with_accuracy else P(DATA, None)
    with jax.named_scope("loss"):
        return layout.shard_map(local, (P(DATA, None, MODEL), P(DATA, None)), out_specs)(
            logits, targets
        )


def _local_columns(logits, targets, start, vocab_size):
    """Which columns are real vocabulary, and each row's target column here (if this slice owns
    it)."""
    ids = start + jnp.arange(logits.shape[-1])
    real = ids < vocab_size if vocab_size is not None else jnp.ones_like(ids, bool)
    owned = (targets >= start) & (targets < start + logits.shape[-1])
    return real, owned, jnp.where(owned, targets - start, 0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _cross_entropy(logits, targets, start, vocab_size):
    return _cross_entropy_fwd(logits, targets, start, vocab_size)[0]


def _cross_entropy_fwd(logits, targets, start, vocab_size):
    real, owned, local_t = _local_columns(logits, targets, start, vocab_size)
    masked = jnp.where(real, logits, _NEG)
    with jax.named_scope("loss_all_reduce"):
        gmax = jax.lax.pmax(masked.max(-1), MODEL)
    sum_exp = jnp.exp(masked - gmax[..., None]).sum(-1)
    picked = jnp.where(owned, jnp.take_along_axis(logits, local_t[..., None], axis=-1)[..., 0], 0.0)
    with jax.named_scope("loss_all_reduce"):
        sum_exp = jax.lax.psum(sum_exp, MODEL)
        target_logit = jax.lax.psum(picked, MODEL)
    lse = jnp.log(sum_exp) + gmax
    return (lse - target_logit, target_logit >= gmax), (logits, targets, start, lse)


def _cross_entropy_bwd(vocab_size, residuals, cotangents):
    logits, targets, start, lse = residuals
    g = cotangents[0]
    real, owned, local_t = _local_columns(logits, targets, start, vocab_size)
    softmax = jnp.where(real, jnp.exp(logits - lse[..., None]), 0.0)
    onehot = owned[..., None] & (jnp.arange(logits.shape[-1]) == local_t[..., None])
    grad = (softmax - onehot) * g[..., None]
    return grad, zero_cotangent(targets), zero_cotangent(start)


_cross_entropy.defvjp(_cross_entropy_fwd, _cross_entropy_bwd)


def mask_padded_vocab(logits, vocab_size: int):
    """Logits with the padded vocabulary columns set to -inf-ish, for sampling and argmax."""
    ids = jnp.arange(logits.shape[-1])
    return jnp.where(ids < vocab_size, logits, _NEG)
