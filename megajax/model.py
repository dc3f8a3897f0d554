"""GPT: vocab-parallel embedding, a stack of tensor-parallel transformer layers, tied
vocab-parallel logits and the fused cross-entropy.

`init_model` builds it directly into its shardings: each device only ever materialises its
own slices, and the same seed gives the same global weights on every mesh.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from megajax import sharding as S
from megajax.bert import BERT
from megajax.config import ModelConfig
from megajax.layers import LayerNorm, LayerStack, VocabParallelEmbedding, dropout
from megajax.loss import mask_padded_vocab, vocab_parallel_cross_entropy
from megajax.mesh import single_device_mesh


class GPT(nnx.Module):
    def __init__(self, cfg: ModelConfig, layout: S.Layout | None = None, *, rngs: nnx.Rngs):
        layout = layout or S.Layout(single_device_mesh())
        self.cfg, self.layout = cfg, layout
        self.dtype = cfg.dtype
        self.embed = VocabParallelEmbedding(cfg.padded_vocab, cfg.hidden, layout=layout,
                                            dtype=self.dtype, std=cfg.init_std, rngs=rngs)
        self.pos = nnx.Param(nnx.with_partitioning(nnx.initializers.normal(cfg.init_std), S.REPLICATED_2D)(
            rngs.params(), (cfg.seq_len, cfg.hidden), jnp.float32))
        self.layers = LayerStack(cfg, layout, rngs, causal=True)
        self.ln_f = LayerNorm(cfg.hidden, cfg.ln_eps)

    def hidden_states(self, tokens, *, key=None, cache=None, pos=None):
        """(b, s) token ids -> (b, s, h) final hidden states, replicated over "model".

        With a KV `cache` (see `init_cache`) the tokens sit at positions pos..pos+s-1 and the
        new cache is returned too."""
        b, s = tokens.shape
        k_embed, k_layers = jax.random.split(key) if key is not None else (None, None)
        positions = jnp.arange(s) if pos is None else pos + jnp.arange(s)
        x = self.embed(tokens) + jnp.take(self.pos[...], positions, axis=0).astype(self.dtype)
        x = self.layout.constrain(x, S.ACT_REPLICATED)
        x = dropout(x, self.cfg.hidden_dropout, k_embed, self.layout, S.ACT_REPLICATED)
        out = self.layers(x, key=k_layers, cache=cache, pos=pos)
        x, cache = (out, None) if cache is None else out
        if self.cfg.ln_placement == "pre":
            x = self.ln_f(x)
        return x if cache is None else (x, cache)

    def init_cache(self, batch: int, max_len: int | None = None):
        """Zero keys and values for every layer, (layers, b, heads, max_len, head_dim) each,
        split over heads on the model axis like the attention weights."""
        c = self.cfg
        shape = (c.num_layers, batch, c.num_heads, max_len or c.seq_len, c.head_dim)
        spec = S.P(None, *S.KV_CACHE)
        make = jax.jit(lambda: jnp.zeros(shape, self.dtype), out_shardings=self.layout.sharding(spec))
        return make(), make()

    def decode(self, tokens, cache, pos):
        """Logits (b, s, vocab) for tokens at positions pos.. given the cache, and the new cache."""
        h, cache = self.hidden_states(tokens, cache=cache, pos=pos)
        return mask_padded_vocab(self.embed.attend(h), self.cfg.vocab_size), cache

    def __call__(self, tokens, *, key=None):
        """Logits over the real vocabulary (padding columns masked), split over "model"."""
        return mask_padded_vocab(self.embed.attend(self.hidden_states(tokens, key=key)), self.cfg.vocab_size)

    def token_losses(self, tokens, targets, *, key=None):
        """(b, s) per-token cross-entropy through the fused vocab-parallel loss."""
        logits = self.embed.attend(self.hidden_states(tokens, key=key))
        return vocab_parallel_cross_entropy(logits, targets, self.layout, self.cfg.vocab_size)

    def loss(self, tokens, targets, *, key=None, weights=None):
        losses = self.token_losses(tokens, targets, key=key)
        with jax.named_scope("loss_mean"):
            if weights is None:
                return losses.mean()
            return (losses * weights).sum() / jnp.maximum(weights.sum(), 1.0)

    # -- the training interface shared by every model (see megajax/train_step.py) ------------
    @staticmethod
    def batch_shapes(cfg, batch_size: int):
        """A GPT batch is one (b, seq_len + 1) token array: inputs and next-token targets."""
        return jax.ShapeDtypeStruct((batch_size, cfg.model.seq_len + 1), jnp.int32)

    def objective(self, tokens, *, key=None):
        """(loss, metrics) of one batch: next-token cross-entropy."""
        loss = self.loss(tokens[:, :-1], tokens[:, 1:], key=key)
        return loss, {"loss": loss}


MODELS = {"gpt": GPT, "bert": BERT}


def abstract_model(cfg: ModelConfig, layout: S.Layout | None = None):
    """The model with ShapeDtypeStructs for weights: shapes and specs, nothing allocated."""
    return nnx.eval_shape(lambda: MODELS[cfg.kind](cfg, layout, rngs=nnx.Rngs(0)))


def param_specs(model_or_state):
    """PartitionSpecs of every parameter, read from the NNX sharding metadata."""
    state = model_or_state if isinstance(model_or_state, nnx.State) else nnx.state(model_or_state, nnx.Param)
    return nnx.get_partition_spec(state)


def init_model(cfg: ModelConfig, mesh, seed: int = 0):
    """Build the model with every weight created directly in its sharding on `mesh`."""
    cfg.check_mesh(mesh.shape[S.MODEL])
    layout = S.Layout(mesh)
    abstract = abstract_model(cfg, layout)
    graphdef, abs_state = nnx.split(abstract)
    shardings = S.param_shardings(mesh, nnx.get_partition_spec(abs_state))

    @jax.jit
    def create():
        return nnx.state(MODELS[cfg.kind](cfg, layout, rngs=nnx.Rngs(seed)))

    state = jax.jit(create, out_shardings=shardings)()
    return nnx.merge(graphdef, state)


def count_params(model) -> int:
    return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


# --- Parameters as a plain nested dict --------------------------------------------------
# optax, orbax and the train step work on plain dicts of arrays (string keys); the NNX
# graph definition and a template state turn them back into a module inside the step.

def _stringify(tree):
    return {str(k): _stringify(v) for k, v in tree.items()} if isinstance(tree, dict) else tree


def _unstringify(tree, template):
    if not isinstance(template, dict):
        return tree
    return {k: _unstringify(tree[str(k)], v) for k, v in template.items()}


class ModelDef:
    """Everything static about a model: rebuild it from a params dict with `bind(params)`."""

    def __init__(self, model):
        self.graphdef, params_state, self.rest = nnx.split(model, nnx.Param, ...)
        self._template = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params_state)
        self.cfg = model.cfg
        self.layout = model.layout

    def params(self, model) -> dict:
        return _stringify(nnx.to_pure_dict(nnx.state(model, nnx.Param)))

    def abstract_params(self) -> dict:
        return _stringify(jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                                       nnx.to_pure_dict(self._template)))

    def abstract_sharded_params(self, shardings) -> dict:
        """ShapeDtypeStructs carrying the given shardings: a restore or compile target, nothing allocated."""
        return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                            self.abstract_params(), shardings)

    def specs(self) -> dict:
        return _stringify(nnx.to_pure_dict(nnx.get_partition_spec(self._template)))

    def bind(self, params: dict):
        state = jax.tree.map(lambda x: x, self._template)
        nnx.replace_by_pure_dict(state, _unstringify(params, nnx.to_pure_dict(state)))
        return nnx.merge(self.graphdef, state, self.rest)
