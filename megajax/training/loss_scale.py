"""Dynamic loss scaling for float16 activations: the paper's mixed precision (Micikevicius et
al. 2018, as Megatron-LM's dynamic grad scaler and PyTorch's GradScaler run it).

float16 keeps 11 significant bits down to 6.1e-5 and none below 6e-8, so the small gradients
of a language model's backward pass (the logits' is ~1/(tokens x vocab)) would lose their
precision or vanish. The step multiplies the loss by a scale S before differentiating, so every
16-bit gradient is S times larger, and divides the float32 weight gradients by S before the
optimizer (`Trainer.apply_gradients`). A step whose gradients overflowed (some not finite) is
skipped: weights and Adam's state stay as they were. Megatron-LM's rule then sets S: each
overflow uses up one of `hysteresis` tolerated overflows, and once they are used up every
overflow halves S; after `window` steps in a row without overflow S doubles (up to 2^32) and
the tolerance is restored. As in Megatron-LM, a skipped step does not advance the
learning-rate schedule (Adam's own count stays); its batch is not seen again. Megatron-LM
starts S at 2^32 and floors it at 1; megajax starts at 2^16 (PyTorch's GradScaler: 16 fewer
skipped steps at the start) and stops the run if gradients overflow at 1 (it has diverged).

bfloat16 has float32's range and needs none of this. The state is part of every optimizer
state (outside float16 the scale is kept at its first value, unused, and nothing is skipped),
so a checkpoint restores whatever the precision of the run that reads it, and a run that
switches to float16 starts from `train.loss_scale`.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from megajax.config import MAX_LOSS_SCALE as MAX_SCALE
from megajax.config import Config
from megajax.core.precision import Precision


class LossScaleState(NamedTuple):
    scale: jax.Array  # float32: what the next step multiplies its loss by
    good_steps: jax.Array  # int32: steps without overflow since the last overflow or growth
    # int32: overflows left before one halves the scale (Megatron's hysteresis)
    tolerance: jax.Array
    skipped: jax.Array  # int32: steps skipped so far (their gradients overflowed)
    inner: optax.OptState  # the wrapped optimizer's state


def uses_loss_scaling(cfg: Config) -> bool:
    """float16 activations (`model.compute_dtype = "float16"`, or "auto" on a GPU without
    bfloat16 tensor cores)."""
    return Precision.of(cfg.model).compute == jnp.float16


def scaled(objective_out, loss_scale):
    """An objective's (loss, metrics) with the loss times `loss_scale` (None: as it is); the
    metrics keep the true loss."""
    loss, metrics = objective_out
    return (loss, metrics) if loss_scale is None else (loss * loss_scale, metrics)


def _fresh(inner_state, initial: float, hysteresis: int) -> LossScaleState:
    return LossScaleState(
        jnp.float32(initial), jnp.int32(0), jnp.int32(hysteresis), jnp.int32(0), inner_state
    )


def around(inner_state, cfg: Config) -> LossScaleState:
    """An optimizer state saved without a loss scale (megajax before float16: AdamW's alone),
    behind a fresh one, so that such checkpoints resume."""
    return _fresh(inner_state, cfg.train.loss_scale, cfg.train.loss_scale_hysteresis)


def loss_scaled(
    inner: optax.GradientTransformation,
    *,
    dynamic: bool,
    initial: float,
    window: int,
    hysteresis: int = 1,
) -> optax.GradientTransformation:
    """`inner` behind a loss scale. Its update takes the *unscaled* gradients (the step divides
    by `state.scale` itself, so that the gradient norm it logs is the true one). Not dynamic:
    `inner` as it is, the scale kept as it is (unused)."""

    def init(params):
        return _fresh(inner.init(params), initial, hysteresis)

    def update(grads, state, params=None):
        updates, inner_state = inner.update(grads, state.inner, params)
        if not dynamic:
            return updates, state._replace(inner=inner_state)
        finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)]))
        updates = jax.tree.map(lambda u: jnp.where(finite, u, jnp.zeros_like(u)), updates)
        inner_state = jax.tree.map(
            lambda new, old: jnp.where(finite, new, old), inner_state, state.inner
        )
        grow = finite & (state.good_steps + 1 >= window)
        tolerance = jnp.where(
            finite, jnp.where(grow, hysteresis, state.tolerance), state.tolerance - 1
        )
        halve = ~finite & (tolerance <= 0)
        scale = jnp.where(
            grow,
            jnp.minimum(2 * state.scale, MAX_SCALE),
            jnp.where(halve, state.scale / 2, state.scale),
        )
        good = jnp.where(finite & ~grow, state.good_steps + 1, 0)
        skipped = state.skipped + (~finite).astype(jnp.int32)
        return updates, LossScaleState(
            scale, good, tolerance.astype(jnp.int32), skipped, inner_state
        )

    return optax.GradientTransformation(init, update)
