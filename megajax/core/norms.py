"""The norms, LayerNorm and RMSNorm: float32 statistics, replicated parameters, run duplicated
on every device of the model axis (Megatron's)."""

from __future__ import annotations

import jax
from flax import nnx

from megajax.core import sharding as S
from megajax.core.layers import param
from megajax.core.ops import layer_norm, rms_norm
from megajax.model_config import ModelConfig


class LayerNorm(nnx.Module):
    """LayerNorm with float32 statistics; its parameters are replicated over the mesh.
    `rows_2d`: normalise a (rows, hidden) view, faster on XLA:CPU; off for sequence-parallel
    activations, whose (b, s/tp) split the merged rows would lose (XLA would gather them)."""

    def __init__(self, dim: int, eps: float = 1e-5, rows_2d: bool = True):
        self.eps, self.rows_2d = eps, rows_2d
        self.scale = param(nnx.initializers.ones, S.REPLICATED_BIAS, jax.random.key(0), (dim,))
        self.bias = param(nnx.initializers.zeros, S.REPLICATED_BIAS, jax.random.key(0), (dim,))

    def __call__(self, x):
        # On (rows, hidden): XLA:CPU's backward (column sums for scale/bias) is ~1.5x faster in 2-D.
        rows = x.reshape(-1, x.shape[-1]) if self.rows_2d else x
        return layer_norm(rows, self.scale[...], self.bias[...], self.eps).reshape(x.shape)


class RMSNorm(nnx.Module):
    """RMSNorm (Llama's), float32 statistic, a replicated scale; `rows_2d` as LayerNorm's."""

    def __init__(self, dim: int, eps: float = 1e-5, rows_2d: bool = True):
        self.eps, self.rows_2d = eps, rows_2d
        self.scale = param(nnx.initializers.ones, S.REPLICATED_BIAS, jax.random.key(0), (dim,))

    def __call__(self, x):
        rows = x.reshape(-1, x.shape[-1]) if self.rows_2d else x
        return rms_norm(rows, self.scale[...], self.eps).reshape(x.shape)


def norm(cfg: ModelConfig, layout: S.Layout):
    """The config's norm over `hidden` features, LayerNorm or RMSNorm."""
    kind = RMSNorm if cfg.norm == "rmsnorm" else LayerNorm
    return kind(cfg.hidden, cfg.ln_eps, rows_2d=not layout.sequence_parallel)
