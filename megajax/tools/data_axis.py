"""The data axis's least traffic for a trainer's step: the closed forms of
analytic.data_axis_minimum fed with one device's model shard of the trained weights, as the
run's scheme (plain, ZeRO-1, FSDP) and its pipeline stages hold them. The audit
(tools/audit.py) sets what the compiled step sends against it."""

from __future__ import annotations

import math

import jax
from jax.sharding import PartitionSpec

from megajax.analytic import data_axis_minimum as data_axis_sent_minimum
from megajax.core.attention import copied_weights
from megajax.core.moe import is_expert_weight
from megajax.core.sharding import DATA, EXPERT, param_shardings
from megajax.core.stack import layer_weight, read_by_backward
from megajax.mesh_shape import MeshShape
from megajax.models.registry import path_keys
from megajax.training.data_parallel import NONE


def data_axis_minimum(trainer) -> tuple[str, dict]:
    """(scheme, {origin: elements each device sends per step}) at the minimum of the run's
    data-parallel scheme (analytic.data_axis_minimum), from a device's model shard of the
    trained weights (with LoRA the adapters'; FSDP gathers every split weight)."""
    scheme, trained = _scheme_minimum(trainer, trainer.trained)
    if scheme == "fsdp" and trainer.cfg.model.lora_rank:
        every = _scheme_minimum(trainer, lambda tree: tree)[1]
        trained = {**trained, "params": every["params"], "regather": every["regather"]}
    return scheme, trained


def _scheme_minimum(trainer, part) -> tuple[str, dict]:
    n, m = trainer.mesh.shape[DATA], trainer.cfg.train.microbatches
    shapes = part(trainer.modeldef.abstract_params())
    dp = trainer.data_parallel
    # a device's model shard (on a pipeline: of its stage's layers), before "data" splits it
    held = (
        dp.held_specs if dp is not None else jax.tree.map(lambda s: s.spec, trainer.param_shardings)
    )
    local = jax.tree.map(
        lambda x, sh: math.prod(sh.shard_shape(x.shape)),
        shapes,
        part(param_shardings(trainer.mesh, held)),
    )
    if dp is None:
        # A weight held in copies over "model" has its gradient reduced over "data" on the share
        # each device computes, before the copies are made whole.
        copied = copied_weights(trainer.cfg.model, MeshShape.of(trainer.mesh))
        local = jax.tree_util.tree_map_with_path(
            lambda p, size: size // copied.get(path_keys(p)[-1], 1), local
        )
        # On an expert mesh the experts' gradients are reduced over "data" alone, every other
        # weight's over "data" and "expert" (a data axis for them).
        on_experts = jax.tree.map(lambda s: EXPERT in s, part(held), is_leaf=_is_spec)
        sizes = {True: 0, False: 0}
        for size, expert in zip(jax.tree.leaves(local), jax.tree.leaves(on_experts)):
            sizes[expert] += size
        ep = trainer.mesh.shape.get(EXPERT, 1)
        others = data_axis_sent_minimum("plain", n * ep, m, 0, sizes[False])
        experts = data_axis_sent_minimum("plain", n, m, 0, sizes[True])
        total = {k: others[k] + experts[k] for k in others}
        if ep > 1:
            total["expert_gradients"] = experts["gradients"]
        return "plain", total
    # On an expert mesh the experts' weights are split over "data" alone, the others over
    # "data" and "expert": each group at its own minimum.
    groups = {False: [0, 0, 0, 0], True: [0, 0, 0, 0]}  # split, whole, layers, layers_read
    for (path, size), d in zip(
        jax.tree_util.tree_flatten_with_path(local)[0], jax.tree.leaves(part(dp.dims))
    ):
        keys = path_keys(path)
        sums = groups[dp.rows != DATA and is_expert_weight(keys)]
        if d == NONE:
            sums[1] += size
            continue
        sums[0] += size
        if layer_weight(keys) is not None:
            sums[2] += size
            if read_by_backward(keys) or trainer.cfg.model.remat == "full":
                sums[3] += size
    scheme = "fsdp" if dp.fsdp else "zero"
    ep = trainer.mesh.shape.get(EXPERT, 1)
    total = {}
    for expert, sums in groups.items():
        part_sent = data_axis_sent_minimum(
            scheme, n * (1 if expert else ep), m, *sums, outside_once=trainer.pipeline is not None
        )
        total = {k: total.get(k, 0) + v for k, v in part_sent.items()}
    return scheme, total


def _is_spec(x) -> bool:
    return isinstance(x, PartitionSpec)
