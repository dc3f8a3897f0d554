"""GPT: vocab-parallel embedding, a stack of tensor-parallel transformer layers, vocab-parallel
logits and the fused cross-entropy. The decoders of today are GPTs of other fields: RMSNorm,
rotary positions (no position table), SwiGLU, grouped-query attention and an untied output
layer (model_config.py); Llama, Mistral and Qwen2 checkpoints import into this class."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from megajax.config import ModelConfig
from megajax.core import sharding as S
from megajax.core.attention import stored_kv_heads
from megajax.core.layers import VocabParallelEmbedding, dropout, param
from megajax.core.loss import mask_padded_vocab, vocab_parallel_cross_entropy
from megajax.core.mesh import single_device_mesh
from megajax.core.moe import router_losses
from megajax.core.norms import norm
from megajax.core.ops import segment_positions
from megajax.core.precision import Precision
from megajax.core.stack import LayerStack
from megajax.models.inputs import check_ids


class GPT(nnx.Module):
    def __init__(self, cfg: ModelConfig, layout: S.Layout | None = None, *, rngs: nnx.Rngs):
        # sequence parallelism: the layout's
        layout = layout or S.Layout.for_model(single_device_mesh(), cfg)
        precision = Precision.of(cfg)
        self.cfg, self.layout, self.dtype = cfg, layout, precision.compute
        rows = dict(rows=cfg.vocab_rows(layout.shape), drawn=cfg.padded_vocab)
        self.embed = VocabParallelEmbedding(
            **rows, dim=cfg.hidden, layout=layout, precision=precision, std=cfg.init_std, rngs=rngs
        )
        self.pos = (
            param(
                nnx.initializers.normal(cfg.init_std),
                S.REPLICATED_2D,
                rngs.params(),
                (cfg.seq_len, cfg.hidden),
            )
            if cfg.positions == "learned"
            else None
        )
        self.layers = LayerStack(cfg, layout, precision, rngs, causal=True)
        self.ln_f = norm(cfg, layout)
        self.head = (
            None
            if cfg.tie_embeddings
            else VocabParallelEmbedding(
                **rows,
                dim=cfg.hidden,
                layout=layout,
                precision=precision,
                std=cfg.init_std,
                rngs=rngs,
            )
        )

    @property
    def output_layer(self) -> VocabParallelEmbedding:
        """The input embedding (tied) or the output layer's own weight."""
        return self.embed if self.head is None else self.head

    def hidden_states(
        self, tokens, *, key=None, cache=None, pos=None, segments=None, token_weights=None
    ):
        """(b, s) token ids -> (b, s, h) final hidden states, replicated over "model" (with
        sequence parallelism split along the sequence: the logits gather it).

        With a KV `cache` (see `init_cache`) the tokens sit at positions pos..pos+s-1 and the
        new cache is returned too. `segments` (b, s) integers: packed sequences, each token
        attending within its segment, at positions counted from the segment's start. A mixture
        of experts also returns its sparse layers' routing statistics, (h, stats), weighted by
        `token_weights` (b, s) (None: every token)."""
        learned = self.cfg.positions == "learned"
        self.layout.check_tokens(tokens, self.cfg.seq_len if pos is None and learned else None)
        check_ids("token ids", tokens, self.cfg.vocab_size)
        s = tokens.shape[1]
        k_embed, k_layers = jax.random.split(key) if key is not None else (None, None)
        x = self.embed(tokens)
        if self.pos is not None:  # rotary positions are applied in each attention block instead
            positions = jnp.arange(s) if pos is None else pos + jnp.arange(s)
            if segments is not None:
                positions = segment_positions(segments)
            x = x + jnp.take(self.pos[...], positions, axis=0).astype(self.dtype)
        x = self.layout.constrain(x, self.layout.between_blocks)
        x = dropout(x, self.cfg.hidden_dropout, k_embed, self.layout, self.layout.between_blocks)
        out = self.layers(
            x, key=k_layers, cache=cache, pos=pos, mask=segments, token_weights=token_weights
        )
        x, extra = (out, None) if cache is None and not self.cfg.num_experts else out
        if self.cfg.ln_placement == "pre":
            x = self.ln_f(x)
        x = self.layout.constrain(x, self.layout.between_blocks)
        return x if extra is None else (x, extra)

    def init_cache(self, batch: int, max_len: int | None = None):
        """Zero keys and values for every layer, (layers, b, kv heads, max_len, head_dim) each,
        split over heads on the model axis like the attention weights (grouped-query attention
        keeps its key/value heads only, or on a model axis larger than their count each
        device's copy: stored_kv_heads)."""
        c = self.cfg
        shape = (
            c.num_layers,
            batch,
            stored_kv_heads(c, self.layout.shape),
            max_len or c.seq_len,
            c.head_dim,
        )
        spec = S.P(None, *S.KV_CACHE)
        make = jax.jit(
            lambda: jnp.zeros(shape, self.dtype), out_shardings=self.layout.sharding(spec)
        )
        return make(), make()

    def decode(self, tokens, cache, pos):
        """Logits (b, s, vocab) for tokens at positions pos.. given the cache, and the new cache."""
        h, cache = self.hidden_states(tokens, cache=cache, pos=pos)
        return mask_padded_vocab(
            self.output_layer.attend(h, self.layout.sequence_parallel), self.cfg.vocab_size
        ), cache

    def __call__(self, tokens, *, key=None):
        """Logits over the real vocabulary (padding columns masked), split over "model"."""
        logits = self.output_layer.attend(
            self._hidden(tokens, key=key)[0], self.layout.sequence_parallel
        )
        return mask_padded_vocab(logits, self.cfg.vocab_size)

    def _hidden(self, tokens, **kwargs):
        """(hidden states, the routing statistics or None)."""
        out = self.hidden_states(tokens, **kwargs)
        return out if self.cfg.num_experts else (out, None)

    def token_losses(self, tokens, targets, *, key=None, segments=None):
        """(b, s) per-token cross-entropy through the fused vocab-parallel loss."""
        return self._token_losses(tokens, targets, key=key, segments=segments)[0]

    def _token_losses(self, tokens, targets, *, key=None, segments=None, token_weights=None):
        """(per-token losses, a mixture of experts' routing statistics or None)."""
        h, stats = self._hidden(tokens, key=key, segments=segments, token_weights=token_weights)
        logits = self.output_layer.attend(h, self.layout.sequence_parallel)
        losses = vocab_parallel_cross_entropy(logits, targets, self.layout, self.cfg.vocab_size)
        return losses, stats

    def loss(self, tokens, targets, *, key=None, weights=None, segments=None):
        """Mean cross-entropy over the global batch, or over the targets where `weights` (b, s)
        is nonzero: the others contribute exactly nothing, to the loss or its gradient."""
        return self._loss(tokens, targets, key=key, weights=weights, segments=segments)[0]

    def _loss(self, tokens, targets, *, key=None, weights=None, segments=None):
        """(mean cross-entropy, a mixture of experts' router losses: {} for a dense model)."""
        losses, stats = self._token_losses(
            tokens, targets, key=key, segments=segments, token_weights=weights
        )
        # over the global batch, also when each data shard has its rows
        with jax.named_scope("loss_mean"):
            if weights is None:
                mean = losses.sum() / self.layout.global_sum(losses.size)
            else:
                kept = jnp.where(weights > 0, losses * weights, 0.0)
                mean = kept.sum() / jnp.maximum(self.layout.global_sum(weights.sum()), 1.0)
        if not stats:  # a dense model, or a pipeline stage's (its stages add their own)
            return mean, {}
        return mean, router_losses(stats, self.cfg, self.layout.global_sum)

    def objective(self, batch, *, key=None):
        """(loss, metrics) of one batch: next-token cross-entropy over a (b, s + 1) token array,
        or over packed conversations: {"tokens", "segments": (b, s + 1), "loss_mask": (b, s)},
        the loss on the targets the mask marks (megajax/data/packing.py). A mixture of experts
        adds its router losses, each times its coefficient (metrics: "loss" is the
        cross-entropy alone)."""
        if not isinstance(batch, dict):
            loss, router = self._loss(batch[:, :-1], batch[:, 1:], key=key)
        else:
            tokens = batch["tokens"]
            loss, router = self._loss(
                tokens[:, :-1],
                tokens[:, 1:],
                key=key,
                weights=batch["loss_mask"],
                segments=batch["segments"][:, :-1],
            )
        if not router:
            return loss, {"loss": loss}
        c = self.cfg
        total = loss + c.moe_aux_loss * router["moe/aux_loss"] + c.moe_z_loss * router["moe/z_loss"]
        return total, {"loss": loss, **router}
