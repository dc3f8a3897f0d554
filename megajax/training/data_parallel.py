"""Sharded data parallelism: ZeRO-1 (`train.shard_optimizer`) and FSDP (`train.shard_params`).

GSPMD reduces a gradient over "data" where the backward pass computes it: once per
microbatch, and it has no way to keep a per-device partial sum across gradient accumulation.
So here the gradients are computed under a shard_map that is manual over "data" (the model
axis stays GSPMD's): each device runs the model on its own rows (a `Layout` whose
`manual` axes hold "data"), accumulates its partial gradients over the microbatches, and the step
reduce-scatters them once, into the slices of the optimizer state (Rajbhandari et al. 2020;
Megatron-LM's distributed optimizer). After the update the new slices are all-gathered:
a reduce-scatter plus an all-gather move the bytes of one all-reduce.

With FSDP the parameters stay split between steps too. Each layer's weights are all-gathered
right before the layer runs, forward and again in the backward pass (`Layout.gather_weights`,
inside the scanned stack), and the transpose of that gather reduce-scatters the layer's
gradient as the backward pass produces it; the other weights (embeddings, final LayerNorm,
heads) are gathered once per microbatch around the whole model.

A weight is split over "data" along the largest dimension the model axis leaves whole and
the data axis divides (`sharding.data_sharded_spec`; with FSDP never the stacked layers'
axis); one with no such dimension (with FSDP, a column-parallel bias of a stacked layer, say)
stays whole on every data shard, its gradient all-reduced once per step.
`DataParallel.whole` lists them.

On a mesh with pipeline stages the same split runs inside the pipeline's shard_map, manual
over "pipe" and "data" (megajax/training/pipeline.py): `stages` gives the weights' specs with
the stacked layers' axis split over "pipe", which "data" then never splits.

On an expert mesh "expert" is one more data axis for every weight but the experts' (each
device holds its own experts): the step is manual over both, a batch's rows split over both,
an expert's weight split (and its gradient reduced) over "data" alone, every other weight over
"data" and "expert" together.
"""

from __future__ import annotations

import dataclasses

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from megajax.core import sharding as S
from megajax.core.attention import copied_weights
from megajax.core.moe import is_expert_weight
from megajax.core.stack import layer_weight
from megajax.mesh_shape import MeshShape
from megajax.models.registry import ModelDef, abstract_model, path_keys
from megajax.training import microbatches
from megajax.training.loss_scale import scaled
from megajax.training.trainable import trained, with_trained

NONE = -1  # a weight no dimension of which "data" divides


@dataclasses.dataclass
class DataParallel:
    cfg: object
    mesh: jax.sharding.Mesh
    dims: dict  # params dict of ints: the dimension "data" splits, or NONE
    sharded: dict  # params dict of NamedShardings: the model's split plus "data"'s
    whole: list  # paths of the weights no dimension of which "data" divides
    manual: ModelDef  # the model as each data shard runs it
    model_specs: dict  # params dict of the weights' own PartitionSpecs (the model axis's split)
    # the weights' specs between steps without "data" (with stages: the layers over "pipe")
    held_specs: dict
    rows: str | tuple  # the axes a batch's rows split over: "data" (and "expert")

    @classmethod
    def build(cls, cfg, mesh, modeldef: ModelDef, stages: dict | None = None) -> "DataParallel":
        """`stages`: on a pipeline, the stage-split specs (pipeline.stage_specs)."""
        axes = MeshShape.of(mesh)
        specs, shapes = modeldef.specs(), modeldef.abstract_params()
        whole, layer_dims = [], {}
        rows = S.rows_axes(mesh)
        over = _over_for(rows)
        # Grouped-query attention's key/value weights held in copies over "model" (small) stay
        # whole over "data": split, each data shard would gather the copies over "model" too.
        copied = copied_weights(cfg.model, axes)

        def pick(path, shape, spec):
            keys = path_keys(path)
            layer = layer_weight(keys)
            # "data" never splits a stacked weight's layer axis: FSDP gathers a layer at a time,
            # and a pipeline splits the layers over "pipe"
            stacked = layer is not None and layer[1] == 1
            zero = (
                None
                if keys[-1] in copied
                else S.data_sharded_spec(
                    shape.shape,
                    spec,
                    axes,
                    skip_leading=stacked and (cfg.train.shard_params or stages is not None),
                    over=over(path),
                )
            )
            if zero is None:
                whole.append("/".join(keys))
                return NONE
            dim = list(zero).index(over(path))
            if layer is not None and cfg.train.shard_params:
                inner = S.without_axes(tuple(spec)[layer[1] :], {S.EXPERT})
                layer_dims[layer[0]] = (dim - layer[1], tuple(inner), over(path))
            return dim

        dims = jax.tree_util.tree_map_with_path(pick, shapes, specs)
        held = specs if stages is None else stages
        sharded = jax.tree_util.tree_map_with_path(
            lambda path, d, spec, x: NamedSharding(
                mesh, _with_data(spec, d, len(x.shape), over(path))
            ),
            dims,
            held,
            shapes,
            is_leaf=lambda x: isinstance(x, P),
        )
        manual = {S.DATA} | ({S.EXPERT} if rows != S.DATA else set())
        layout = S.Layout.for_model(
            mesh,
            cfg.model,
            manual=manual | ({S.PIPE} if stages is not None else set()),
            fsdp_layer_dims=tuple(sorted(layer_dims.items())) if cfg.train.shard_params else (),
        )
        return cls(
            cfg,
            mesh,
            dims,
            sharded,
            whole,
            ModelDef(abstract_model(cfg.model, layout)),
            specs,
            held,
            rows,
        )

    @property
    def fsdp(self) -> bool:
        return self.cfg.train.shard_params

    def over(self, path):
        """The axes a weight is split over and its gradient reduced over."""
        return _over_for(self.rows)(path)

    @property
    def manual_axes(self) -> set:
        """The axes the step's shard_map is manual over (a pipeline adds "pipe")."""
        return {S.DATA} | ({S.EXPERT} if self.rows != S.DATA else set())

    # -- inside the data-manual shard_map --------------------------------------------------
    def manual_specs(self, tree, split: bool = True) -> dict:
        """The manual part of each weight's spec (the model axis is GSPMD's): "expert" where
        an expert's weight has it, and with `split` the data axes on the dimension they split
        (as the optimizer state is, and FSDP's weights between steps)."""

        def one(path, d, x, spec):
            entries = [S.EXPERT if S.EXPERT in _names(e) else None for e in spec]
            entries += [None] * (x.ndim - len(entries))
            if split and d != NONE:
                entries[d] = self.over(path)
            return P(*entries)

        return jax.tree_util.tree_map_with_path(
            one,
            self.dims,
            tree,
            self.model_specs,
            is_leaf=lambda x: isinstance(x, P),
        )

    def _is_layer(self, path) -> bool:
        return layer_weight(path_keys(path)) is not None

    def gather_outside_layers(self, params):
        """FSDP: the weights outside the layer stack, all-gathered over "data" inside each
        microbatch's gradient (loop-invariant: XLA hoists them out of the accumulation loop, so
        once per step), their gradients reduce-scattered per microbatch by the transposes."""

        def gather(path, x, d, spec):
            if d == NONE or self._is_layer(path):
                return x
            inner = tuple(S.without_axes(spec, {S.EXPERT}))
            return S.gather_over_data(x, d, inner, self.over(path))

        return jax.tree_util.tree_map_with_path(gather, params, self.dims, self.model_specs)

    def _objective(self, params, batch, key, loss_scale=None):
        if self.fsdp:
            params = self.gather_outside_layers(params)
        return scaled(self.manual.bind(params).objective(batch, key=key), loss_scale)

    def _local(self, params, batch, key, loss_scale):
        """One device's rows: (metrics, gradients) summed over the microbatches, reduced once."""
        t = self.cfg.train
        grad_fn = jax.value_and_grad(
            lambda part, b, k: self._objective(with_trained(params, part), b, k, loss_scale),
            has_aux=True,
        )
        part = trained(self.cfg, params)
        # this shard's rows j, j+m, ...: the rows of the global batch's microbatch j it holds
        micro = microbatches.split(batch, t.microbatches)
        first = jax.tree.map(lambda x: x[0], micro)
        metric_shapes = jax.eval_shape(lambda mb: self._objective(params, mb, key)[1], first)
        metrics, grads = microbatches.mean_gradients(
            lambda mb, k: grad_fn(part, mb, k),
            micro,
            key,
            t.microbatches,
            metric_shapes,
            part,
            t.unroll_microbatches,
        )
        with jax.named_scope("metrics_all_reduce"):
            metrics = jax.lax.psum(metrics, self.rows)  # each shard's share of the global means
        return metrics, self.reduce(grads)

    def reduce(self, grads):
        """Each gradient's one data-axis reduction per step: a reduce-scatter into its slice, an
        all-reduce where no dimension divides; FSDP's split weights arrive reduced already
        (the transpose of their gathers). Manual over "model" too: each device reduces its own
        model shard (left to GSPMD, a data-axis collective inside the data-manual region would
        first gather its operand over "model")."""
        specs = jax.tree.map(
            lambda s: S.without_axes(s, {S.EXPERT}),
            trained(self.cfg, self.model_specs),
            is_leaf=lambda x: isinstance(x, P),
        )

        def reduce_all(g):
            return jax.tree_util.tree_map_with_path(
                lambda path, g, d: self._reduce_one(g, d, self.over(path)),
                g,
                trained(self.cfg, self.dims),
            )

        return jax.shard_map(
            reduce_all,
            in_specs=(specs,),
            out_specs=specs,
            axis_names={S.MODEL},
            check_vma=False,
        )(grads)

    def _reduce_one(self, g, d, over):
        if d == NONE:
            with jax.named_scope("gradients_all_reduce"):
                return jax.lax.psum(g, over)
        if self.fsdp:
            return g
        with jax.named_scope("gradients_reduce_scatter"):
            return jax.lax.psum_scatter(g, over, scatter_dimension=d, tiled=True)

    # -- called by the step ------------------------------------------------------------------
    def gradients(self, params, batch, key, loss_scale=None):
        """(metrics, gradients), the gradients split over "data" like the optimizer state (of
        the loss times `loss_scale`, if given)."""
        specs = self.manual_specs(params)
        held = specs if self.fsdp else self.manual_specs(params, split=False)
        fn = jax.shard_map(
            self._local,
            mesh=self.mesh,
            in_specs=(held, P(self.rows), P(), P()),
            out_specs=(P(), trained(self.cfg, specs)),
            axis_names=self.manual_axes,
            check_vma=False,
        )
        metrics, grads = fn(params, batch, key, loss_scale)
        return metrics, jax.lax.with_sharding_constraint(grads, trained(self.cfg, self.sharded))

    def layer_order(self) -> None:
        return None  # the layers' own (a pipeline reorders them, around this)

    def reorder(self, tree, inverse: bool = False):
        return tree

    def updated_params(self, params):
        """ZeRO-1: the updated slices of the trained weights all-gathered into whole ones for
        the next step (FSDP keeps them split)."""
        if self.fsdp:
            return params
        dims = trained(self.cfg, self.dims)

        def gather(params):
            with jax.named_scope("params_all_gather"):
                return jax.tree_util.tree_map_with_path(
                    lambda path, x, d: (
                        x
                        if d == NONE
                        else jax.lax.all_gather(x, self.over(path), axis=d, tiled=True)
                    ),
                    params,
                    dims,
                )

        sharded = trained(self.cfg, jax.tree.map(lambda s: s.spec, self.sharded))
        return jax.shard_map(
            gather,
            mesh=self.mesh,
            in_specs=(sharded,),
            out_specs=trained(self.cfg, self.held_specs),
            check_vma=False,
        )(params)

    def describe(self) -> str:
        """One line for the dry run: what stays whole on every data shard."""
        n = len(jax.tree.leaves(self.dims))
        if not self.whole:
            return f"all {n} weights split"
        return (
            f"{len(self.whole)} of {n} weights stay whole (no dimension left by the model axis "
            f"divides by {self.mesh.shape[S.DATA]}): "
            + ", ".join(self.whole[:4])
            + (" ..." if len(self.whole) > 4 else "")
        )


def _with_data(spec: P, d: int, ndim: int, over=S.DATA) -> P:
    entries = list(spec) + [None] * (ndim - len(spec))
    if d != NONE:
        entries[d] = over
    return P(*entries)


def _over_for(rows):
    """path -> the axes a weight is split over: an expert's over "data" (its experts are split
    over "expert" already), every other weight over all of `rows`."""
    return lambda path: S.DATA if is_expert_weight(path_keys(path)) else rows


def _names(entry) -> tuple:
    return entry if isinstance(entry, tuple) else (entry,)
