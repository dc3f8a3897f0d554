"""The train step as one compiled program per layer, called from Python (`train.layer_programs`).

Why: a scanned stack compiles one layer and loops it, but the activations each layer's backward
pass needs are kept in buffers stacked over the layers, which XLA zero-fills, writes and copies
out again: about 17% of a GPT-2 1.2B step on an H200 (docs/performance.md). An unrolled stack
keeps them in separate buffers but compiles every layer. Here one layer is compiled, as in the
scan, and called once per layer: its forward returns jax.vjp's pullback, whose leaves are that
layer's saved activations, in buffers of their own (its weights are sliced again in the
backward program, `_Saved`); its backward adds the layer's weight gradients into the stacked
gradients in place (bench/layer_programs.py times the three ways).

Per microbatch: the model's own code up to its stack (`_pre`, with jax.vjp), the layers'
forwards, the model's code after the stack with the loss (`_post`, value and gradient), the
layers' backwards, the pre part's backward (`_accumulate`); then the optimizer, as in the
single-program step (`Trainer.apply_gradients`). The model is cut at its LayerStack with
`stack.split_at_stack`, so GPT, BERT and its tasks need no code of their own. The same
gradients as the single program (tests/test_layer_programs.py), the same four all-reduces per
layer (two in each layer's forward program and two in its backward), over "data" GSPMD's
reduction once per microbatch. Plain data parallelism only (ZeRO-1/FSDP are manual over
"data" around the whole gradient computation).
"""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from megajax.core.stack import LayerStack, split_at_stack
from megajax.models.registry import params_dict
from megajax.training import microbatches
from megajax.training.memory import per_device_bytes


def get_path(tree: dict, path: tuple):
    for k in path:
        tree = tree[k]
    return tree


def replace_path(tree: dict, path: tuple, sub):
    """A copy of the nested dict `tree` with the subtree at `path` replaced (None: removed)."""
    head, *rest = path
    out = dict(tree)
    if rest:
        out[head] = replace_path(tree[head], tuple(rest), sub)
    elif sub is None:
        del out[head]
    else:
        out[head] = sub
    return out


@jax.tree_util.register_pytree_node_class
class _Saved:
    """A layer's pullback without its weights: the activations it saved (the leaves) and, as
    static data, where the weight slices go back in. jax.vjp keeps the layer's weights among
    its residuals, and as slices of the stacked weights they would be copies: a second float32
    copy of every layer's weights held from the forward pass to the backward. The backward
    program slices them again instead, as the scan's backward pass does."""

    def __init__(self, leaves, layout):
        self.leaves, self.layout = leaves, layout

    def tree_flatten(self):
        return self.leaves, self.layout

    @classmethod
    def tree_unflatten(cls, layout, leaves):
        return cls(list(leaves), layout)

    @classmethod
    def of(cls, pullback, weights):
        leaves, treedef = jax.tree.flatten(pullback)
        slots = tuple(
            next((n for n, w in enumerate(weights) if w is leaf), None) for leaf in leaves
        )
        return cls([leaf for leaf, slot in zip(leaves, slots) if slot is None], (treedef, slots))

    def pullback(self, weights):
        treedef, slots = self.layout
        saved = iter(self.leaves)
        return jax.tree.unflatten(
            treedef, [next(saved) if slot is None else weights[slot] for slot in slots]
        )


def stack_of(model) -> tuple[tuple[str, ...], LayerStack]:
    stacks = [
        (tuple(str(k) for k in path), node)
        for path, node in nnx.iter_graph(model)
        if isinstance(node, LayerStack)
    ]
    assert len(stacks) == 1, (
        f"train.layer_programs needs a model with one layer stack, found {len(stacks)}"
    )
    return stacks[0]


class LayerProgramStep:
    """step(params, opt_state, batch, step) -> (params, opt_state, metrics), like the compiled
    single-program step, run as a sequence of compiled programs."""

    def __init__(self, trainer):
        self.tr = trainer
        t = trainer.cfg.train
        self.microbatches, self.num_layers = t.microbatches, trainer.cfg.model.num_layers
        path, _ = stack_of(trainer.modeldef.bind(trainer.modeldef.abstract_params()))
        self.path = (*path, "stacked")  # the stacked layers' weights in the params dict
        shardings = trainer.param_shardings
        self.stacked_shardings = get_path(shardings, self.path)
        self.rest_shardings = replace_path(shardings, self.path, None)
        grads_out = (self.rest_shardings, self.stacked_shardings)
        self._zeros = jax.jit(
            lambda p: jax.tree.map(
                jnp.zeros_like, (replace_path(p, self.path, None), get_path(p, self.path))
            ),
            out_shardings=grads_out,
        )
        self._pre = jax.jit(self._pre_fn)
        self._forward = jax.jit(self._forward_fn)
        self._post = jax.jit(
            self._post_fn, out_shardings=(trainer.replicated(), self.rest_shardings, None)
        )
        self._backward = jax.jit(
            self._backward_fn, out_shardings=(self.stacked_shardings, None), donate_argnums=(2,)
        )
        self._accumulate = jax.jit(
            self._accumulate_fn,
            out_shardings=(self.rest_shardings, trainer.replicated()),
            donate_argnums=(2, 4),
        )
        self._update = jax.jit(
            self._update_fn,
            out_shardings=(shardings, trainer.opt_shardings, trainer.replicated()),
            donate_argnums=(0, 1),
        )

    # -- the programs ------------------------------------------------------------------------
    def _microbatch(self, batch, step, j):
        """Microbatch j and its dropout key, as the single program splits them."""
        key = self.tr.step_key(step)
        if self.microbatches == 1:
            return batch, key
        return (
            microbatches.take(self.tr.split_microbatches(batch), j),
            microbatches.key(key, self.microbatches, j),
        )

    def _pre_fn(self, params, batch, step, j):
        """The model up to its stack: (stack input, (layer keys, mask), pullback to the weights)."""
        mb, key = self._microbatch(batch, step, j)
        stacked = get_path(params, self.path)

        def up_to_stack(rest):
            seen = {}

            def record(stack, x, keys, mask, token_weights):
                seen.update(x=x, aux=(keys, mask))
                return x  # what the model computes after this is unused: compiled away

            with split_at_stack(record):
                self.tr.objective(replace_path(rest, self.path, stacked), mb, key)
            return seen["x"], seen["aux"]

        x, pullback, aux = jax.vjp(up_to_stack, replace_path(params, self.path, None), has_aux=True)
        return x, aux, pullback

    def _layer(self, params, aux, i):
        keys, mask = aux
        call, _, state = stack_of(self.tr.modeldef.bind(params))[1].layer_call(mask)
        layer_state = jax.tree.map(
            lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), state
        )
        return call, layer_state, None if keys is None else keys[i]

    def _forward_fn(self, params, i, h, aux):
        call, layer_state, key = self._layer(params, aux, i)
        h, pullback = jax.vjp(lambda st, h: call(st, h, key), layer_state, h)
        return h, _Saved.of(pullback, jax.tree.leaves(layer_state))

    def _backward_fn(self, params, saved, stacked_grads, i, g):
        _, layer_state, _ = self._layer(params, (None, None), i)
        d_layer, dh = saved.pullback(jax.tree.leaves(layer_state))(g)
        d_layer = params_dict(nnx.to_pure_dict(d_layer))
        return jax.tree.map(lambda acc, d: acc.at[i].add(d), stacked_grads, d_layer), dh

    def _post_fn(self, params, batch, step, j, h, loss_scale):
        """The model from its stack's output h: (metrics, grads of the other weights, dh), of the
        loss times `loss_scale` if given (float16)."""
        mb, key = self._microbatch(batch, step, j)
        stacked = get_path(params, self.path)

        def from_stack(rest, h):
            with split_at_stack(lambda stack, x, *_: h):
                return self.tr.objective(
                    replace_path(rest, self.path, stacked), mb, key, loss_scale
                )

        (_, metrics), (grads, dh) = jax.value_and_grad(from_stack, argnums=(0, 1), has_aux=True)(
            replace_path(params, self.path, None), h
        )
        return metrics, grads, dh

    @staticmethod
    def _accumulate_fn(pullback, dx, rest_grads, post_grads, metrics_sum, metrics):
        (pre_grads,) = pullback(dx)
        rest_grads = jax.tree.map(lambda a, b, c: a + b + c, rest_grads, post_grads, pre_grads)
        metrics_sum = (
            metrics if metrics_sum is None else jax.tree.map(jnp.add, metrics_sum, metrics)
        )
        return rest_grads, metrics_sum

    def _update_fn(self, params, opt_state, rest_grads, stacked_grads, metrics_sum, step):
        m = self.microbatches
        grads = replace_path(rest_grads, self.path, stacked_grads)
        metrics, grads = jax.tree.map(lambda x: x / m, (metrics_sum, grads))
        return self.tr.apply_gradients(params, opt_state, grads, metrics, step)

    # -- the step ------------------------------------------------------------------------
    def __call__(self, params, opt_state, batch, step):
        rest_grads, stacked_grads = self._zeros(params)
        metrics_sum, loss_scale = None, self.tr.loss_scale(opt_state)
        for j in range(self.microbatches):
            j = np.int32(j)
            x, aux, pre_pullback = self._pre(params, batch, step, j)
            pullbacks = []
            for i in range(self.num_layers):
                x, pullback = self._forward(params, np.int32(i), x, aux)
                pullbacks.append(pullback)
            metrics, post_grads, g = self._post(params, batch, step, j, x, loss_scale)
            # each layer's activations freed as it goes
            for i in reversed(range(self.num_layers)):
                stacked_grads, g = self._backward(
                    params, pullbacks.pop(), stacked_grads, np.int32(i), g
                )
            rest_grads, metrics_sum = self._accumulate(
                pre_pullback, g, rest_grads, post_grads, metrics_sum, metrics
            )
        return self._update(params, opt_state, rest_grads, stacked_grads, metrics_sum, step)

    # -- what the step needs in memory ----------------------------------------------------
    def memory_analysis(self):
        """An estimate in the form of XLA's (what `check_step_fits` reads), from compiling the
        stack's first programs: the state and batch, the gradients, and every layer's saved
        activations at once (the forward program's outputs, L times), plus that program's temps."""
        tr = self.tr
        params, opt = tr.abstract_state()
        batch = tr.batch_shapes()
        scalar = jax.ShapeDtypeStruct((), jnp.int32)
        shardings = self._pre.lower(params, batch, scalar, scalar).compile().output_shardings
        x, aux, _ = jax.eval_shape(self._pre, params, batch, scalar, scalar)
        x, aux = jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
            (x, aux),
            tuple(shardings[:2]),
        )
        fwd = self._forward.lower(params, scalar, x, aux).compile().memory_analysis()
        state = per_device_bytes(params) + per_device_bytes(opt)
        grads = per_device_bytes(params)
        saved = self.num_layers * int(fwd.output_size_in_bytes)
        return types.SimpleNamespace(
            argument_size_in_bytes=state + per_device_bytes(batch),
            output_size_in_bytes=state,
            alias_size_in_bytes=state,
            temp_size_in_bytes=grads + saved + int(fwd.temp_size_in_bytes),
        )
