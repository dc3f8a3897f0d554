"""The stack of transformer layers: a scan over stacked weights (one compiled layer, the form
the paper's configs use) or a Python loop; the full-remat checkpoint around each layer; and,
with FSDP, each layer's weights all-gathered over "data" right before it runs.

`split_at_stack` lets the train step's layer programs (megajax/training/layer_programs.py) run
a model's own code before and after its stack without the stack, and `layer_call` is the one
layer the scan runs, for them to run a layer at a time."""

from __future__ import annotations

import contextlib
import contextvars
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from megajax.config import ModelConfig
from megajax.core import sharding as S
from megajax.core.moe import is_matrix
from megajax.core.precision import Precision
from megajax.core.transformer import TransformerLayer

# Where the layer weights sit in a model's params dict: a model's `layers` attribute is its
# LayerStack, which holds them as `stacked` (scanned: one leading axis of layers) or as the list
# `layers` (one entry per layer). Every module that tells layer weights from the rest asks here.
STACKED_PATH = ("layers", "stacked")
LISTED_PATH = ("layers", "layers")


def layer_weight(keys: tuple[str, ...]) -> tuple[tuple[str, ...], int] | None:
    """(its path inside one layer, the leading axes before that) of a layer weight's params
    path, or None for a weight outside the layers (embeddings, final norm, heads)."""
    if keys[: len(STACKED_PATH)] == STACKED_PATH:
        return keys[len(STACKED_PATH) :], 1
    if keys[: len(LISTED_PATH)] == LISTED_PATH:
        return keys[len(LISTED_PATH) + 1 :], 0
    return None


def read_by_backward(keys: tuple[str, ...]) -> bool:
    """Whether the backward pass reads a weight (FSDP gathers it again): the matrices (a
    gradient's input needs them), the norms' scales, a sparse layer's router and experts; not
    the biases."""
    return keys[-1].endswith("kernel") or keys[-1] == "scale" or is_matrix(keys)


def _stacked_layers(
    cfg: ModelConfig, layout: S.Layout, precision: Precision, rngs: nnx.Rngs, causal: bool
):
    """num_layers layers whose parameters are stacked on a new leading (unsharded) axis."""
    keys = jax.random.split(rngs.params(), cfg.num_layers)
    # LoRA adapters: their own stream, so that the base weights are those of the same seed without
    lora_keys = keys
    if cfg.lora_rank:
        lora_keys = jax.random.split(
            rngs.lora() if "lora" in rngs else rngs.params(), cfg.num_layers
        )

    @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: None})
    def make(key, lora_key):
        return TransformerLayer(
            cfg,
            layout=layout,
            precision=precision,
            rngs=nnx.Rngs(params=key, lora=lora_key),
            causal=causal,
            sparse=cfg.num_experts > 0,  # a scanned stack's layers are all sparse or all dense
        )

    return make(keys, lora_keys)


# While set, a LayerStack does not run: it hands its input to this function and returns what
# that returns (see split_at_stack).
_SPLIT: contextvars.ContextVar = contextvars.ContextVar("layer_stack_split", default=None)


@contextlib.contextmanager
def split_at_stack(handler: Callable):
    """Within this block every LayerStack call returns handler(stack, x, keys, mask,
    token_weights) instead of running its layers (`keys`: the layers' dropout keys, or None),
    with no routing statistics (an empty dict) for sparse layers. A model's code then runs up
    to its stack (a handler that records x) or from it (one that returns a given output)."""
    token = _SPLIT.set(handler)
    try:
        yield
    finally:
        _SPLIT.reset(token)


class LayerStack(nnx.Module):
    """The transformer layers, run as a scan over stacked weights or as a Python loop."""

    def __init__(
        self,
        cfg: ModelConfig,
        layout: S.Layout,
        precision: Precision,
        rngs: nnx.Rngs,
        causal: bool = True,
    ):
        self.num_layers, self.scan, self.remat = (
            cfg.num_layers,
            cfg.scan_layers,
            cfg.remat == "full",
        )
        self.layout, self.sparse = layout, cfg.sparse_layers
        if self.scan:
            self.stacked = _stacked_layers(cfg, layout, precision, rngs, causal)
        else:
            self.layers = nnx.List(
                [
                    TransformerLayer(
                        cfg,
                        layout=layout,
                        precision=precision,
                        rngs=rngs,
                        causal=causal,
                        sparse=sparse,
                    )
                    for sparse in self.sparse
                ]
            )

    def _gathered(self, layer_state, x):
        """FSDP: one layer's weights all-gathered over "data" right before the layer runs on x.
        The barrier ties the gather to x: without it XLA hoists the gathers of an unrolled
        stack out of the gradient-accumulation loop and keeps every layer's whole weights."""
        if not self.layout.fsdp_layer_dims:
            return layer_state, x
        weights, x = jax.lax.optimization_barrier((nnx.to_pure_dict(layer_state), x))
        nnx.replace_by_pure_dict(layer_state, self.layout.gather_weights(weights))
        return layer_state, x

    def _checkpointed(self, layer_fn):
        """Full remat recomputes the whole layer in the backward pass; FSDP without it still
        drops the gathered weights after the forward pass and gathers them again."""
        if self.remat:
            return jax.checkpoint(layer_fn)
        if self.layout.fsdp_layer_dims:
            return jax.checkpoint(layer_fn, policy=S.drop_data_gathers)
        return layer_fn

    def _run_layer(
        self, graphdef, layer_state, h, key, mask=None, cache=None, pos=None, token_weights=None
    ):
        """One layer on h: its weights gathered first under FSDP."""
        layer_state, h = self._gathered(layer_state, h)
        layer = nnx.merge(graphdef, layer_state)
        extra = {"token_weights": token_weights} if layer.sparse else {}
        return layer(h, key=key, mask=mask, cache=cache, pos=pos, **extra)

    def layer_call(self, mask=None, token_weights=None) -> tuple[Callable, object, object]:
        """(fn(layer_state, h, key) -> h (sparse layers: (h, routing statistics)), the stacked
        layers' graphdef, their stacked state): one layer as the scan runs it (FSDP gather and
        remat included); index the state's leaves for one layer's. For the train step's layer
        programs and pipeline stages; scanned stacks only."""
        graphdef, state = nnx.split(self.stacked)

        def call(layer_state, h, k):
            return self._run_layer(graphdef, layer_state, h, k, mask, token_weights=token_weights)

        return self._checkpointed(call), graphdef, state

    def __call__(self, x, *, key=None, mask=None, cache=None, pos=None, token_weights=None):
        """Run the layers; with `cache` (k, v stacked over layers) also return the new cache;
        in training, with sparse layers, also their routing statistics, stacked over them
        (core/moe.py; `token_weights` (b, s): the tokens the loss covers)."""
        keys = None if key is None else jax.random.split(key, self.num_layers)
        sparse = any(self.sparse) and cache is None
        if (split := _SPLIT.get()) is not None and cache is None:
            out = split(self, x, keys, mask, token_weights)
            return (out, {}) if sparse else out
        if self.scan:
            graphdef, state = nnx.split(self.stacked)

            def body(h, xs):
                layer_state, k, c = xs
                out = self._run_layer(graphdef, layer_state, h, k, mask, c, pos, token_weights)
                return out if c is not None or sparse else (out, None)

            with jax.named_scope("layers"):
                x, ys = jax.lax.scan(self._checkpointed(body), x, (state, keys, cache))
            return x if cache is None and not sparse else (x, ys)
        outs = []
        for i, layer in enumerate(self.layers):
            graphdef, state = nnx.split(layer)

            def call(layer_state, h, k, c, graphdef=graphdef):
                return self._run_layer(graphdef, layer_state, h, k, mask, c, pos, token_weights)

            with jax.named_scope(f"layer_{i}"):
                out = self._checkpointed(call)(
                    state,
                    x,
                    None if keys is None else keys[i],
                    None if cache is None else (cache[0][i], cache[1][i]),
                )
            if cache is None and not self.sparse[i]:
                x = out
            else:
                x, c = out
                outs.append(c)
        if cache is None and not sparse:
            return x
        if cache is None:  # the sparse layers' statistics, stacked over them
            return x, jax.tree.map(lambda *a: jnp.stack(a), *outs)
        return x, (jnp.stack([c[0] for c in outs]), jnp.stack([c[1] for c in outs]))
