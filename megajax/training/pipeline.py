"""Pipeline parallelism over the mesh's "pipe" axis (Narayanan et al. 2021, Megatron-LM's PTD-P):
each stage holds a contiguous group of layers (the stacked layers' leading axis split over
"pipe"), and the step's microbatches flow through the stages on a schedule's table
(megajax/schedules.py).

The gradient computation runs under a shard_map manual over "pipe" (data and model stay
GSPMD's, so tensor and sequence parallelism work inside each stage unchanged). It is a scan
over the table's ticks; at each tick every stage runs the one action the table gives it:

  forward   its chunk of layers on a microbatch (the first stage embeds the tokens first; the
            last runs the model's head and loss after: the step's metrics)
  backward  the same recomputed under jax.vjp, from the saved stage input and the gradient
            the next stage sent: the weights' gradients are accumulated, the input's sent on
  idle      nothing (the bubble)

and after it the activations move one stage on and the gradients one stage back, point to
point (`ppermute`), between the stages that have one to pass on at that tick. A stage keeps
only its inputs between a microbatch's forward and backward (the table's buffer slots: m of
them for GPipe, at most p for 1F1B). The weights outside the
stack (embeddings, final norm, heads) are held by every stage; the first stage's and the last
stage's gradients of them (the tied embedding's two uses) are summed over "pipe" once a step,
as Megatron-LM all-reduces its embedding group's.

A mixture of experts' router losses are each layer's, so each stage adds its own chunks'
(their statistics never leave the stage): a chunk's forward adds its router losses to the
step's metrics, and its backward differentiates them with the layers, beside the cotangent
the next stage sent.

With ZeRO-1 or FSDP (a `DataParallel` given) the shard_map is manual over "data" too: each
data shard runs its own rows through the stages and keeps its partial gradients until the
step's end, where ZeRO-1 reduce-scatters them once into the optimizer state's slices; FSDP's
layers gather their weights over "data" as they run (in forward and backward ticks) and
reduce-scatter their gradients through the gathers' transposes
(megajax/training/data_parallel.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from megajax import schedules
from megajax.core import sharding as S
from megajax.core.moe import LOAD, router_losses
from megajax.core.stack import STACKED_PATH, split_at_stack
from megajax.models.registry import ModelDef, abstract_model, path_keys
from megajax.training import microbatches
from megajax.training.data_parallel import DataParallel
from megajax.training.layer_programs import get_path, replace_path, stack_of
from megajax.training.loss_scale import scaled
from megajax.training.trainable import trained

FIRST, MIDDLE, LAST = 0, 1, 2


def _is_stacked(path, stacked_path: tuple) -> bool:
    """Whether a leaf (of params, or of optimizer state mirroring them) is a stacked weight."""
    keys, n = path_keys(path), len(stacked_path)
    return any(keys[i : i + n] == stacked_path for i in range(len(keys) - n + 1))


def stage_specs(specs: dict, path: tuple) -> dict:
    """The weights' PartitionSpecs with the stacked layers' axis split over "pipe"."""

    def split(spec):
        return P(S.PIPE, *tuple(spec)[1:])

    return replace_path(
        specs, path, jax.tree.map(split, get_path(specs, path), is_leaf=lambda x: isinstance(x, P))
    )


class Pipeline:
    """The pipelined gradient computation of a Trainer on a mesh with a "pipe" axis."""

    def __init__(self, cfg, mesh, modeldef: ModelDef, data_parallel: DataParallel | None = None):
        t = cfg.train
        self.cfg, self.mesh, self.data_parallel = cfg, mesh, data_parallel
        self.p, self.v, self.m = mesh.shape[S.PIPE], t.pipeline_chunks, t.microbatches
        self.table = schedules.build(t.pipeline_schedule, self.p, self.m, self.v)
        self.per_chunk = cfg.model.num_layers // (self.p * self.v)
        self.path = STACKED_PATH  # where the stacked layers' weights are
        self.data_axes = None if data_parallel is None else data_parallel.rows
        if data_parallel is not None:
            self.manual = data_parallel.manual
        else:
            layout = S.Layout.for_model(mesh, cfg.model, manual={S.PIPE})
            self.manual = ModelDef(abstract_model(cfg.model, layout))
        # each tick's pattern of stage pairs that pass a result on (schedules.Table.sends)
        self.send_on, self.send_back = (
            (np.asarray(index, np.int32), patterns)
            for index, patterns in (
                self.table.sends(schedules.FORWARD),
                self.table.sends(schedules.BACKWARD),
            )
        )

    # -- stage-major storage (interleaved) ----------------------------------------------
    def layer_order(self) -> np.ndarray | None:
        """Interleaved: stage s holds chunks s, s + p, ..., which are not contiguous layers, so
        the stacked weights are stored stage-major: position k holds layer order[k] (stage s's
        v chunks one after another, each its n layers). None: the layers' own order."""
        if self.v == 1:
            return None
        p, v, n = self.p, self.v, self.per_chunk
        return np.asarray(
            [(c * p + s) * n + j for s in range(p) for c in range(v) for j in range(n)], np.int32
        )

    def reorder(self, tree, inverse: bool = False):
        """The stacked leaves of params (or of optimizer state) from the layers' order into
        storage order, or back with `inverse` (a jit-traceable take along the layer axis)."""
        order = self.layer_order()
        if order is None:
            return tree
        index = np.argsort(order) if inverse else order
        return jax.tree_util.tree_map_with_path(
            lambda path, x: (
                jnp.take(x, index, axis=0)
                if _is_stacked(path, self.path) and getattr(x, "ndim", 0)
                else x
            ),
            tree,
        )

    # -- the model's parts --------------------------------------------------------------
    def _full(self, rest, stacked):
        return replace_path(rest, self.path, stacked)

    def _gathered_rest(self, rest, stacked):
        """(the weights outside the stack as the stages use them, the map of their gradients
        back): FSDP gathers them over "data" once per step, before the ticks, and the
        transpose reduce-scatters their gradients summed over the step (the layers gather
        their own weights as they run)."""
        dp = self.data_parallel
        if dp is None or not dp.fsdp:
            return rest, lambda g: g
        gathered, transpose = jax.vjp(
            lambda r: replace_path(
                dp.gather_outside_layers(self._full(r, stacked)), self.path, None
            ),
            rest,
        )
        return gathered, lambda g: transpose(g)[0]

    def _pre(self, rest, stacked, mb, key):
        """The model up to its stack: (stack input, (the layers' dropout keys, mask, the tokens'
        weights in the router's statistics))."""
        seen = {}

        def record(stack, x, keys, mask, token_weights):
            seen.update(x=x, aux=(keys, mask, token_weights))
            return x

        with split_at_stack(record):
            self.manual.bind(self._full(rest, stacked)).objective(mb, key=key)
        return seen["x"], seen["aux"]

    def _post(self, rest, stacked, mb, key, h, loss_scale):
        """The model after its stack, from the stack's output h: (scaled loss, metrics)."""
        with split_at_stack(lambda stack, x, *_: h):
            return scaled(
                self.manual.bind(self._full(rest, stacked)).objective(mb, key=key), loss_scale
            )

    def _chunk(self, rest, stacked, chunk, virtual, x, aux, scale):
        """This stage's chunk `chunk` (virtual stage `virtual`) of layers on x: (its output, the
        chunk's share of the objective (times `scale`), its metrics): a mixture of experts'
        router losses, 0 and {} for dense layers."""
        keys, mask, token_weights = aux
        stack = stack_of(self.manual.bind(self._full(rest, stacked)))[1]
        call, _, state = stack.layer_call(mask, token_weights)
        sparse = any(stack.sparse)
        n = self.per_chunk
        if self.v > 1:  # (one chunk: the stage's weights as they are, not a sliced copy)
            state = jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, chunk * n, n), state)
        keys = None if keys is None else jax.lax.dynamic_slice_in_dim(keys, virtual * n, n)

        def layer(h, xs):
            out = call(xs[0], h, xs[1])
            return out if sparse else (out, None)

        with jax.named_scope("layers"):
            y, stats = jax.lax.scan(layer, x, (state, keys))
        if not sparse:
            return y, jnp.zeros((), jnp.float32), {}
        return (y, *self._router(stats, chunk, scale))

    def _router(self, stats, chunk, scale):
        """A chunk's router losses from its layers' statistics: (their share of the objective,
        times `scale`, their metrics). The losses sum over layers, so the stages' sum is the
        model's; the dropped share is weighted by the chunk's layers (each layer routes as
        many tokens), and each layer's load goes to its place in the stacked weights' order."""
        c = self.cfg.model
        global_sum = (
            (lambda x: x) if self.data_axes is None else (lambda x: jax.lax.psum(x, self.data_axes))
        )
        metrics = router_losses(stats, c, global_sum)
        objective = c.moe_aux_loss * metrics["moe/aux_loss"] + c.moe_z_loss * metrics["moe/z_loss"]
        metrics["moe/dropped"] = metrics["moe/dropped"] * self.per_chunk / c.num_layers
        if LOAD in metrics:  # the stage's chunks are stored one after another (layer_order)
            at = (jax.lax.axis_index(S.PIPE) * self.v + chunk) * self.per_chunk
            whole = jnp.zeros((c.num_layers, c.num_experts), jnp.float32)
            metrics[LOAD] = jax.lax.dynamic_update_slice_in_dim(whole, metrics[LOAD], at, 0)
        return objective if scale is None else objective * scale, metrics

    # -- one tick's actions ------------------------------------------------------------------
    # Each takes (the tick's operands, the sums so far: rest grads, stacked grads, metrics) and
    # returns (sent on, sent back, the sums): the sums go through the switch, so a backward
    # adds its gradients into them in place instead of returning a second gradient-sized copy.
    def _branches(self, zx):
        add = lambda a, b: a + b.astype(a.dtype)  # noqa: E731

        def idle(op, sums):
            return zx, zx, sums

        def added(totals, metrics):
            return {k: add(v, metrics[k]) if k in metrics else v for k, v in totals.items()}

        def forward(where):
            def run(op, sums):
                rest, stacked, mb, key, x, _, chunk, virtual, scale = op
                first, aux = self._pre(rest, stacked, mb, key)
                x = first if where == FIRST else x
                y, _, router = self._chunk(rest, stacked, chunk, virtual, x, aux, scale)
                if where != LAST:
                    return y.astype(zx.dtype), zx, (*sums[:2], added(sums[2], router))
                _, metrics = self._post(rest, stacked, mb, key, y, scale)
                return zx, zx, (*sums[:2], added(sums[2], {**metrics, **router}))

            return run

        def backward(where):
            def run(op, sums):
                rest, stacked, mb, key, x, g, chunk, virtual, scale = op

                def through(rest, stacked, x):
                    """(the chunk's output, its share of the objective)"""
                    first, aux = self._pre(rest, stacked, mb, key)
                    x = first if where == FIRST else x
                    return self._chunk(rest, stacked, chunk, virtual, x, aux, scale)[:2]

                if where == LAST:

                    def loss(rest, stacked, x):
                        with jax.named_scope("pipeline_recompute"):
                            y, router = through(rest, stacked, x)
                        objective, metrics = self._post(rest, stacked, mb, key, y, scale)
                        return objective + router, metrics

                    (_, _), (d_rest, d_stack, dx) = jax.value_and_grad(
                        loss, argnums=(0, 1, 2), has_aux=True
                    )(rest, stacked, x)
                else:
                    with jax.named_scope("pipeline_recompute"):
                        (_, router), pullback = jax.vjp(through, rest, stacked, x)
                    d_rest, d_stack, dx = pullback((g.astype(x.dtype), jnp.ones_like(router)))
                dx = zx if where == FIRST else dx.astype(zx.dtype)
                return (
                    zx,
                    dx,
                    (
                        jax.tree.map(add, sums[0], d_rest),
                        jax.tree.map(add, sums[1], d_stack),
                        sums[2],
                    ),
                )

            return run

        return [
            idle,
            *(forward(w) for w in (FIRST, MIDDLE, LAST)),
            *(backward(w) for w in (FIRST, MIDDLE, LAST)),
        ]

    def _table(self) -> dict:
        """The schedule as arrays, ticks x stages, with each entry's branch of `_branches` and
        virtual stage."""
        ticks = np.asarray(self.table.ticks, np.int32)
        names = ("kind", "chunk", "micro", "act", "grad")
        out = {name: ticks[..., n] for n, name in enumerate(names)}
        out["arrive_act"] = np.asarray(self.table.arrive_act, np.int32)
        out["arrive_grad"] = np.asarray(self.table.arrive_grad, np.int32)
        out["virtual"] = out["chunk"] * self.p + np.arange(self.p, dtype=np.int32)
        where = np.where(
            out["virtual"] == 0,
            FIRST,
            np.where(out["virtual"] == self.p * self.v - 1, LAST, MIDDLE),
        )
        out["branch"] = np.where(
            out["kind"] == schedules.IDLE,
            0,
            np.where(out["kind"] == schedules.FORWARD, 1, 4) + where,
        )
        for name, (index, _) in (("send_on", self.send_on), ("send_back", self.send_back)):
            out[name] = np.repeat(index[:, None], self.p, axis=1)
        return {k: v.astype(np.int32) for k, v in out.items()}

    def switch_runs(self) -> dict[str, tuple[int, list[int]]]:
        """What the audit counts the switches' collectives by (tools/hlo.py), per switch's name
        scope: (ticks, how many of the table's ticks x stages run each branch), and for the
        sends (ticks, how many ticks run each pattern)."""
        branch = self._table()["branch"]
        runs = {
            "pipeline_stage": (self.table.num_ticks, [int((branch == k).sum()) for k in range(7)])
        }
        for scope, (index, patterns) in (
            ("pipeline_send", self.send_on),
            ("pipeline_send_back", self.send_back),
        ):
            runs[scope] = (
                self.table.num_ticks,
                [int((index == k).sum()) for k in range(len(patterns))],
            )
        return runs

    def _send(self, x, pattern, patterns):
        """One tick's sends in one direction: the tick's pattern of stage pairs (the same on
        every stage, so every stage takes the same branch of the switch around the
        collective-permute)."""
        branches = [lambda x: jnp.zeros_like(x)] + [
            (lambda x, pairs=pairs: jax.lax.ppermute(x, S.PIPE, pairs)) for pairs in patterns[1:]
        ]
        return jax.lax.switch(pattern, branches, x)

    def _local(self, params, batch, key, loss_scale):
        """One stage's share of the step: (metrics, gradients), summed over the microbatches."""
        stage = jax.lax.axis_index(S.PIPE)
        stacked, rest = get_path(params, self.path), replace_path(params, self.path, None)
        rest, rest_gradients = self._gathered_rest(rest, stacked)
        # Microbatch j: the rows j, j+m, ... of the batch (of this data shard's, when "data" is
        # manual: the same rows as the GSPMD split gives it)
        on_shards = (
            None
            if self.data_parallel is not None
            else lambda x: jax.lax.with_sharding_constraint(x, P(None, S.rows_axes(self.mesh)))
        )
        micro = microbatches.split(batch, self.m, on_shards)

        def microbatch(i):
            return microbatches.take(micro, i), microbatches.key(key, self.m, i)

        mb0, key0 = microbatch(0)
        x_shape = jax.eval_shape(lambda: self._pre(rest, stacked, mb0, key0))[0]
        x0 = jnp.zeros(x_shape.shape, x_shape.dtype)
        metric_shapes = jax.eval_shape(
            lambda: {
                **self._post(rest, stacked, mb0, key0, x0, loss_scale)[1],
                **self._chunk(
                    rest, stacked, 0, 0, x0, self._pre(rest, stacked, mb0, key0)[1], loss_scale
                )[2],
            }
        )
        zx = jnp.zeros(x_shape.shape, x_shape.dtype)
        sums = (
            jax.tree.map(jnp.zeros_like, rest),
            jax.tree.map(jnp.zeros_like, stacked),
            jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32), metric_shapes),
        )
        branches = self._branches(zx)
        t = self.table
        carry = (
            jnp.zeros((t.act_slots, *zx.shape), zx.dtype),
            jnp.zeros((t.grad_slots, *zx.shape), zx.dtype),
            sums,
        )

        def tick(carry, row):
            acts, grads, sums = carry
            row = {k: v[stage] for k, v in row.items()}
            mb, k = microbatch(row["micro"])
            x = jax.lax.dynamic_index_in_dim(acts, jnp.maximum(row["act"], 0), keepdims=False)
            g = jax.lax.dynamic_index_in_dim(grads, jnp.maximum(row["grad"], 0), keepdims=False)
            with jax.named_scope("pipeline_stage"):
                sent_on, sent_back, sums = jax.lax.switch(
                    row["branch"],
                    branches,
                    (rest, stacked, mb, k, x, g, row["chunk"], row["virtual"], loss_scale),
                    sums,
                )
            with jax.named_scope("pipeline_send"):
                arrived = self._send(sent_on, row["send_on"], self.send_on[1])
            with jax.named_scope("pipeline_send_back"):
                arrived_grad = self._send(sent_back, row["send_back"], self.send_back[1])
            acts = _put(acts, row["arrive_act"], arrived)
            grads = _put(grads, row["arrive_grad"], arrived_grad)
            return (acts, grads, sums), None

        (_, _, (d_rest, d_stack, metrics)), _ = jax.lax.scan(tick, carry, self._table())
        with jax.named_scope("pipeline_gradient_sum"):
            d_rest, metrics = jax.lax.psum((d_rest, metrics), S.PIPE)
        d_rest = rest_gradients(d_rest)
        grads = replace_path(d_rest, self.path, d_stack)
        metrics, grads = jax.tree.map(lambda x: x / self.m, (metrics, grads))
        grads = trained(self.cfg, grads)
        if self.data_parallel is not None:
            with jax.named_scope("metrics_all_reduce"):
                metrics = jax.lax.psum(metrics, self.data_parallel.rows)  # shards' shares
            grads = self.data_parallel.reduce(grads)  # once per step
        return metrics, grads

    def specs(self, params, held: bool = True) -> dict:
        """The manual part of each weight's spec: "pipe" on the stacked layers' axis, and with
        ZeRO-1 / FSDP "data" on the dimension it splits (`held`: as the weights are held
        between steps, split only under FSDP; else as the gradients leave the step, split
        under both)."""
        dp = self.data_parallel
        if dp is None:
            specs = jax.tree.map(lambda _: P(), params)
        else:
            specs = dp.manual_specs(params, split=dp.fsdp or not held)
        return stage_specs(specs, self.path)

    def updated_params(self, part):
        """ZeRO-1's all-gather of the updated slices, if the stages run one."""
        return part if self.data_parallel is None else self.data_parallel.updated_params(part)

    def gradients(self, params, batch, key, loss_scale=None):
        """(metrics, gradients): means over the step's microbatches, the stacked layers'
        gradients split over "pipe" like their weights (and over "data" like the optimizer
        state, with ZeRO-1 / FSDP)."""
        dp = self.data_parallel
        manual = {S.PIPE} if dp is None else {S.PIPE} | dp.manual_axes
        fn = jax.shard_map(
            self._local,
            mesh=self.mesh,
            in_specs=(self.specs(params), P() if dp is None else P(dp.rows), P(), P()),
            out_specs=(P(), trained(self.cfg, self.specs(params, held=False))),
            axis_names=manual,
            check_vma=False,
        )
        metrics, grads = fn(params, batch, key, loss_scale)
        if dp is not None:
            grads = jax.lax.with_sharding_constraint(grads, trained(self.cfg, dp.sharded))
        return metrics, grads


def _put(buffer, slot, value):
    """buffer[slot] = value where slot >= 0 (in place)."""
    at = jnp.maximum(slot, 0)
    old = jax.lax.dynamic_index_in_dim(buffer, at, keepdims=False)
    return jax.lax.dynamic_update_index_in_dim(buffer, jnp.where(slot >= 0, value, old), at, 0)
