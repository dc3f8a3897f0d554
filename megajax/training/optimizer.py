"""The paper's optimiser recipe, from optax: global-norm clipping, then AdamW with linear
warmup and cosine (GPT-2) or linear (the paper's BERT) decay, behind a loss scale that is
dynamic for float16 activations (megajax/training/loss_scale.py)."""

from __future__ import annotations

import jax
import optax

from megajax.config import Config, TrainConfig
from megajax.training.loss_scale import loss_scaled, uses_loss_scaling

# Megatron-LM decays every weight matrix and embedding (token, position, token-type tables)
# and exempts only biases and LayerNorm parameters (scale and shift).
_NOT_DECAYED = ("bias", "scale")


def lr_schedule(t: TrainConfig):
    """Linear warmup to lr, then cosine (GPT-2) or linear (the paper's BERT) decay to min_lr."""
    decay_steps = max(t.decay_steps or t.steps, t.warmup_steps + 1)
    if t.schedule == "linear":
        return optax.join_schedules(
            [
                optax.linear_schedule(0.0, t.lr, t.warmup_steps),
                optax.linear_schedule(t.lr, t.min_lr, decay_steps - t.warmup_steps),
            ],
            [t.warmup_steps],
        )
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=t.lr,
        warmup_steps=t.warmup_steps,
        decay_steps=decay_steps,
        end_value=t.min_lr,
    )


def weight_decay_mask(params: dict):
    return jax.tree_util.tree_map_with_path(
        lambda path, _: not str(path[-1].key).endswith(_NOT_DECAYED), params
    )


def make_optimizer(cfg: Config) -> optax.GradientTransformation:
    t = cfg.train
    adamw = optax.chain(
        optax.clip_by_global_norm(t.grad_clip),
        optax.adamw(
            lr_schedule(t),
            b1=t.beta1,
            b2=t.beta2,
            eps=t.eps,
            weight_decay=t.weight_decay,
            mask=weight_decay_mask,
        ),
    )
    return loss_scaled(
        adamw,
        dynamic=uses_loss_scaling(cfg),
        initial=t.loss_scale,
        window=t.loss_scale_window,
        hysteresis=t.loss_scale_hysteresis,
    )
