"""GPT: vocab-parallel embedding, a stack of tensor-parallel transformer layers, tied
vocab-parallel logits and the fused cross-entropy."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from megajax.config import ModelConfig
from megajax.core import sharding as S
from megajax.core.layers import LayerNorm, VocabParallelEmbedding, dropout, param
from megajax.core.loss import mask_padded_vocab, vocab_parallel_cross_entropy
from megajax.core.mesh import single_device_mesh
from megajax.core.precision import Precision
from megajax.core.stack import LayerStack
from megajax.models.inputs import check_ids


class GPT(nnx.Module):
    def __init__(self, cfg: ModelConfig, layout: S.Layout | None = None, *, rngs: nnx.Rngs):
        layout = layout or S.Layout.for_model(single_device_mesh(), cfg)   # sequence parallelism: the layout's
        precision = Precision.of(cfg)
        self.cfg, self.layout, self.dtype = cfg, layout, precision.compute
        self.embed = VocabParallelEmbedding(cfg.padded_vocab, cfg.hidden, layout=layout, precision=precision,
                                            std=cfg.init_std, rngs=rngs)
        self.pos = param(nnx.initializers.normal(cfg.init_std), S.REPLICATED_2D, rngs.params(),
                         (cfg.seq_len, cfg.hidden))
        self.layers = LayerStack(cfg, layout, precision, rngs, causal=True)
        self.ln_f = LayerNorm(cfg.hidden, cfg.ln_eps, rows_2d=not layout.sequence_parallel)

    def hidden_states(self, tokens, *, key=None, cache=None, pos=None):
        """(b, s) token ids -> (b, s, h) final hidden states, replicated over "model" (with
        sequence parallelism split along the sequence: the logits gather it).

        With a KV `cache` (see `init_cache`) the tokens sit at positions pos..pos+s-1 and the
        new cache is returned too."""
        self.layout.check_tokens(tokens, self.cfg.seq_len if pos is None else None)
        check_ids("token ids", tokens, self.cfg.vocab_size)
        s = tokens.shape[1]
        k_embed, k_layers = jax.random.split(key) if key is not None else (None, None)
        positions = jnp.arange(s) if pos is None else pos + jnp.arange(s)
        x = self.embed(tokens) + jnp.take(self.pos[...], positions, axis=0).astype(self.dtype)
        x = self.layout.constrain(x, self.layout.between_blocks)
        x = dropout(x, self.cfg.hidden_dropout, k_embed, self.layout, self.layout.between_blocks)
        out = self.layers(x, key=k_layers, cache=cache, pos=pos)
        x, cache = (out, None) if cache is None else out
        if self.cfg.ln_placement == "pre":
            x = self.ln_f(x)
        x = self.layout.constrain(x, self.layout.between_blocks)
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
        return mask_padded_vocab(self.embed.attend(h, self.layout.sequence_parallel), self.cfg.vocab_size), cache

    def __call__(self, tokens, *, key=None):
        """Logits over the real vocabulary (padding columns masked), split over "model"."""
        return mask_padded_vocab(self.embed.attend(self.hidden_states(tokens, key=key), self.layout.sequence_parallel), self.cfg.vocab_size)

    def token_losses(self, tokens, targets, *, key=None):
        """(b, s) per-token cross-entropy through the fused vocab-parallel loss."""
        logits = self.embed.attend(self.hidden_states(tokens, key=key), self.layout.sequence_parallel)
        return vocab_parallel_cross_entropy(logits, targets, self.layout, self.cfg.vocab_size)

    def loss(self, tokens, targets, *, key=None, weights=None):
        losses = self.token_losses(tokens, targets, key=key)
        with jax.named_scope("loss_mean"):   # over the global batch, also when each data shard has its rows
            if weights is None:
                return losses.sum() / self.layout.global_sum(losses.size)
            return (losses * weights).sum() / jnp.maximum(self.layout.global_sum(weights.sum()), 1.0)

    def objective(self, tokens, *, key=None):
        """(loss, metrics) of one batch: next-token cross-entropy."""
        loss = self.loss(tokens[:, :-1], tokens[:, 1:], key=key)
        return loss, {"loss": loss}
