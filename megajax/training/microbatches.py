"""The one rule that splits a step's batch into microbatches, and their accumulation.

Every gradient strategy (GSPMD's step, ZeRO-1 / FSDP's data-manual step, the pipeline's
schedule, the layer programs) takes its microbatches here, so that a step computes the same
numbers bit for bit on every mesh and under every strategy: microbatch j takes the rows
j, j+m, j+2m, ... of the batch, so every data shard keeps its own rows whether "data" is split
by GSPMD or by hand, and its dropout key is fold_in(step key, j) (the step's own key when there
is one microbatch).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def split(batch, m: int, constrain=None):
    """Every batch array as (m, rows / m, ...), microbatch j first-axis entry j; `constrain`
    (optional) is applied to each split array (GSPMD: keep the rows on their data shard)."""

    def one(x):
        x = x.reshape(x.shape[0] // m, m, *x.shape[1:]).swapaxes(0, 1)
        return x if constrain is None else constrain(x)

    return jax.tree.map(one, batch)


def key(step_key, m: int, j):
    """Microbatch j's dropout key."""
    return step_key if m == 1 else jax.random.fold_in(step_key, j)


def take(micro, j):
    """Microbatch j of a split batch (j may be traced)."""
    return jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, j, keepdims=False), micro)


def mean_gradients(grad_fn, micro, step_key, m: int, metric_shapes, part, unroll: bool):
    """(metrics, gradients) of `grad_fn(microbatch, key) -> ((loss, metrics), grads)` averaged
    over the m microbatches of `micro`, summed in microbatch order: in a scan, or unrolled into
    independent subgraphs (`unroll`) that XLA may run at once (the same sums, bit for bit)."""

    def accumulate(carry, xs):
        mb, j = xs
        (_, metrics), grads = grad_fn(mb, key(step_key, m, j))
        return jax.tree.map(jnp.add, carry, (metrics, grads)), None

    total = (
        jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32), metric_shapes),
        jax.tree.map(jnp.zeros_like, part),
    )
    if m == 1 or unroll:
        for j in range(m):
            total, _ = accumulate(total, (jax.tree.map(lambda x: x[j], micro), j))
    else:
        total, _ = jax.lax.scan(accumulate, total, (micro, jnp.arange(m)))
    return jax.tree.map(lambda x: x / m, total)
