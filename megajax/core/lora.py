"""LoRA (Hu et al. 2021): a frozen linear layer's y = x W plus scale * (dropout(x) A) B, with A
(d_in, rank) and B (rank, d_out) the only weights trained, B starting at zero so that the
adapted model starts as the base model.

Split with the base layer so that the forward pass adds no collective:
  column-parallel W (None, "model"):  A replicated, B split by columns like W: each device
                                      computes its own columns of the delta;
  row-parallel W ("model", None):     A split by rows like W, B replicated: each device's delta
                                      is a partial sum, added to the layer's before its one
                                      all-reduce.
In the backward pass the replicated factor (a column layer's A, a row layer's B) gets a partial
gradient on each device of the model axis, as a replicated weight of sequence parallelism does,
summed over "model" (`per_device`): in the plain step within its reduction over "data" (one
all-reduce over both axes), in the data-manual one (ZeRO-1, FSDP) in an all-reduce of its own
per layer and microbatch, h x rank numbers.

Which layers: model.lora_targets, among LORA_TARGETS (qkv: the query, key and value projection;
out: attention's output projection; fc1: the MLP's first (SwiGLU: gate and up); fc2: its last).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from megajax.core import sharding as S

NAME = "lora"  # the attribute of an adapted layer: its weights' paths hold it


def is_adapter(keys: tuple[str, ...]) -> bool:
    """Whether a params path (its keys) is a LoRA weight."""
    return NAME in keys


def adapter(
    cfg, target: str, d_in: int, d_out: int, *, column: bool, rngs: nnx.Rngs, parts=None
) -> Adapter | None:
    """The adapter of a `target` layer, None where model.lora_targets does not name it."""
    if target not in cfg.lora_target_list:
        return None
    return Adapter(d_in, d_out, column=column, cfg=cfg, rngs=rngs, parts=parts)


def adapter_keys(key, n: int):
    """`n` dropout keys for a block's adapters, folded from the block's key (its own splits,
    and so every other dropout mask, stay as they are without adapters)."""
    if key is None:
        return (None,) * n
    return tuple(jax.random.fold_in(key, 1000 + i) for i in range(n))


def _lora_key(rngs: nnx.Rngs):
    """Adapters draw from their own stream ("lora") when the model has one, so that the base
    weights of a seed are the same with and without them."""
    return rngs.lora() if "lora" in rngs else rngs.params()


class Adapter(nnx.Module):
    """A and B of one layer. `parts`: the fused column layer's (name, width, copies), one B
    each (`b_{name}`, split like that part's kernel); a plain layer has one B, `b`."""

    def __init__(self, d_in: int, d_out: int, *, column: bool, cfg, rngs: nnx.Rngs, parts=None):
        self.rank, self.scale = cfg.lora_rank, cfg.lora_alpha / cfg.lora_rank
        self.rate, self.column = cfg.lora_dropout, column
        bound = 1 / math.sqrt(d_in)  # PEFT's: kaiming_uniform(a=sqrt(5)) on (rank, d_in)
        self.a = _param(
            nnx.initializers.uniform(2 * bound),
            S.REPLICATED_2D if column else S.ROW,
            _lora_key(rngs),
            (d_in, self.rank),
            shift=-bound,
        )
        self.parts = tuple(parts or (("", d_out, 1),))
        for name, width, copies in self.parts:
            spec = S.REPLICATED_2D if not column or copies > 1 else S.COLUMN
            setattr(
                self,
                f"b_{name}" if name else "b",
                _param(nnx.initializers.zeros, spec, None, (self.rank, width)),
            )

    def b_of(self, name: str = ""):
        return getattr(self, f"b_{name}" if name else "b")[...]

    def a_weight(self):
        return self.a[...]


def _param(init, spec, key, shape, shift: float = 0.0):
    def make(key, shape, dtype):
        return init(key if key is not None else jax.random.key(0), shape, dtype) + shift

    return nnx.Param(
        nnx.with_partitioning(make, spec)(key, shape, jnp.float32), eager_sharding=False
    )


def per_device(w, layout: S.Layout):
    """Inside a layer's shard_map: a replicated factor (a column layer's A, a row layer's B)
    used by each device's own product. Its gradient is a partial sum on each device, summed by
    this cast's transpose under a name the audit reads (`adapter_gradients`): in the plain step
    over "data" and "model" at once (its data-parallel reduction, which it needs anyway), in the
    data-manual step (ZeRO-1, FSDP: gradients reduced over "data" once a step) over "model"."""
    axes = S.MODEL if S.DATA in layout.manual else (S.DATA, S.MODEL)
    with jax.named_scope("lora_gradient"):
        return jax.lax.pcast(w, axes, to="varying")


def low_rank(x, a, b, scale: float, matmul):
    """scale * (x a) b in the layer's precision (`matmul(x, w)`)."""
    return matmul(matmul(x, a), b) * scale


def folded(params: dict, cfg) -> dict:
    """A params dict (numpy or jax arrays) with every adapter folded into its kernel,
    K + (lora_alpha / lora_rank) A B (stacked layers: per layer), and no adapters left: the
    model the adapters make, as a plain one."""
    scale = cfg.lora_alpha / cfg.lora_rank

    def fold(tree: dict) -> dict:
        out = {k: fold(v) if isinstance(v, dict) else v for k, v in tree.items() if k != NAME}
        for name, b in tree.get(NAME, {}).items():
            if name.startswith("b"):
                kernel = "kernel" if name == "b" else f"{name.removeprefix('b_')}_kernel"
                out[kernel] = out[kernel] + (tree[NAME]["a"] @ b) * scale
        return out

    return fold(params)
