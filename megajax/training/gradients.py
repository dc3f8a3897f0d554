"""How a train step computes its gradients over the mesh: one interface, three strategies.

    PlainGradients  GSPMD places the data-axis reductions: each gradient all-reduced where the
                    backward pass computes it (once per microbatch)
    DataParallel    ZeRO-1 / FSDP: manual over "data", one reduction per step
                    (megajax/training/data_parallel.py)
    Pipeline        stages over "pipe", with a DataParallel inside or not
                    (megajax/training/pipeline.py)

The Trainer (megajax/training/step.py) holds one and calls nothing else of it. Every strategy
splits a batch by the one microbatch rule (megajax/training/microbatches.py), which is what
makes a step's losses the same on every mesh.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from megajax.config import Config
from megajax.core import sharding as S
from megajax.models.registry import ModelDef
from megajax.training import microbatches
from megajax.training.loss_scale import scaled
from megajax.training.trainable import trained, with_trained


class GradientStrategy(Protocol):
    def gradients(self, params, batch, key, loss_scale=None):
        """(metrics, gradients of the trained part): means over the step's microbatches,
        reduced over "data" (of the loss times `loss_scale`, if given)."""

    def updated_params(self, part):
        """The trained weights after the optimizer, as the next step holds them."""

    def layer_order(self) -> np.ndarray | None:
        """The order the step stores the stacked layers in (None: their own)."""

    def reorder(self, tree, inverse: bool = False):
        """A params-shaped tree into that order (`inverse`: back to the layers' own)."""


def split_on_shards(batch, cfg: Config, mesh):
    """Every batch array as (microbatches, rows, ...) by the one rule, each microbatch's rows
    kept on their data shard (GSPMD's view: the batch is global)."""
    on_shards = NamedSharding(mesh, P(None, S.rows_axes(mesh)))
    return microbatches.split(
        batch, cfg.train.microbatches, lambda x: jax.lax.with_sharding_constraint(x, on_shards)
    )


@dataclasses.dataclass
class PlainGradients:
    """GSPMD's data parallelism: the whole step is one GSPMD program over both axes."""

    cfg: Config
    mesh: jax.sharding.Mesh
    modeldef: ModelDef

    def objective(self, params, batch, key, loss_scale=None):
        return scaled(self.modeldef.bind(params).objective(batch, key=key), loss_scale)

    def gradients(self, params, batch, key, loss_scale=None):
        t = self.cfg.train
        grad_fn = jax.value_and_grad(
            lambda part, b, k: self.objective(with_trained(params, part), b, k, loss_scale),
            has_aux=True,
        )
        part = trained(self.cfg, params)
        if t.microbatches == 1:
            (_, metrics), grads = grad_fn(part, batch, key)
            return metrics, grads
        micro = split_on_shards(batch, self.cfg, self.mesh)
        metric_shapes = jax.eval_shape(
            lambda mb: self.objective(params, mb, key)[1], jax.tree.map(lambda x: x[0], micro)
        )
        return microbatches.mean_gradients(
            lambda mb, k: grad_fn(part, mb, k),
            micro,
            key,
            t.microbatches,
            metric_shapes,
            part,
            t.unroll_microbatches,
        )

    def updated_params(self, part):
        return part

    def layer_order(self) -> None:
        return None

    def reorder(self, tree, inverse: bool = False):
        return tree
