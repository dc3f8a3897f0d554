"""The MLP block, Megatron's way: the first weights column-parallel, the activation local to each
device, the last weight row-parallel, one all-reduce after it.

GeLU (GPT-2, BERT): fc1, GeLU, fc2. SwiGLU (Llama, Mistral, Qwen2): silu(x Wg) * (x Wu), then
Wd; the gate and up weights are split alike, so a device holds both halves of the features
it computes, and they run as one matmul (FusedColumnParallelLinear)."""

from __future__ import annotations

import math

import jax
from flax import nnx

from megajax.core import sharding as S
from megajax.core.layers import ColumnParallelLinear, FusedColumnParallelLinear, RowParallelLinear
from megajax.core.lora import adapter, adapter_keys
from megajax.core.precision import Precision
from megajax.model_config import ModelConfig


class ParallelMLP(nnx.Module):
    """Column-parallel fc1 (SwiGLU: gate and up), the activation local to each device,
    row-parallel fc2, one all-reduce."""

    def __init__(self, cfg: ModelConfig, *, layout: S.Layout, precision: Precision, rngs: nnx.Rngs):
        out_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)
        self.approximate_gelu, self.gated = cfg.gelu == "tanh", cfg.mlp == "swiglu"
        common = dict(layout=layout, precision=precision, use_bias=cfg.bias == "all")
        parts = [("gate", cfg.ffn, 1), ("up", cfg.ffn, 1)] if self.gated else None
        lora = adapter(cfg, "fc1", cfg.hidden, cfg.ffn, column=True, rngs=rngs, parts=parts)
        if self.gated:
            self.fc1 = FusedColumnParallelLinear(
                cfg.hidden,
                parts,
                regather=cfg.remat != "full",
                std=cfg.init_std,
                rngs=rngs,
                lora=lora,
                **common,
            )
        else:
            self.fc1 = ColumnParallelLinear(
                cfg.hidden,
                cfg.ffn,
                regather=cfg.remat != "full",
                std=cfg.init_std,
                rngs=rngs,
                lora=lora,
                **common,
            )
        self.fc2 = RowParallelLinear(
            cfg.ffn,
            cfg.hidden,
            std=out_std,
            rngs=rngs,
            **common,
            lora=adapter(cfg, "fc2", cfg.ffn, cfg.hidden, column=False, rngs=rngs),
        )
        self.layout, self.recompute_norm_gelu = layout, precision.recompute_norm_gelu

    def activation(self, h):
        """GeLU of fc1's output, or SwiGLU's silu(gate) * up of its (..., tp, 2·ffn/tp) halves."""
        if not self.gated:
            return jax.nn.gelu(h, approximate=self.approximate_gelu)
        gate, up = jax.numpy.split(h, 2, axis=-1)
        out = jax.nn.silu(gate) * up
        return self.layout.constrain(out.reshape(*out.shape[:-2], -1), S.ACT_COLUMN)

    def __call__(self, x, norm=None, key=None):
        """fc2(act(fc1(x))), or of norm(x): the norm before the block, which with
        `recompute_norm_gelu` the backward pass recomputes from x (kept anyway) instead of
        keeping. `key`: the adapters' dropout (LoRA's), if any."""
        k1, k2 = adapter_keys(key, 2)
        # The activation is recomputed in the backward pass from its input, which is saved
        # anyway: that keeps no (b, s, ffn) intermediates alive and is ~5% faster on XLA:CPU
        # (bench/shakespeare_char.py).
        act = jax.checkpoint(self.activation)
        first = lambda x: self.fc1(x if norm is None else norm(x), k1)  # noqa: E731
        second = lambda h: self.fc2(act(h), k2)  # noqa: E731
        # keeps x and fc1's output, not the norm's and the activation's too
        if self.recompute_norm_gelu:
            first, second = jax.checkpoint(first), jax.checkpoint(second)
        return second(first(x))
