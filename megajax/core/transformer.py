"""One transformer layer: the attention and MLP blocks with their residuals, the norm before
each block (pre) or after each residual add (post)."""

from __future__ import annotations

import jax
from flax import nnx

from megajax.core import sharding as S
from megajax.core.attention import ParallelSelfAttention
from megajax.core.layers import dropout
from megajax.core.mlp import ParallelMLP
from megajax.core.moe import MoEBlock
from megajax.core.norms import norm
from megajax.core.precision import Precision
from megajax.model_config import ModelConfig


class TransformerLayer(nnx.Module):
    """Attention and MLP blocks with residuals; the norm before each block (pre) or after each add
    (post)."""

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        layout: S.Layout,
        precision: Precision,
        rngs: nnx.Rngs,
        causal: bool = True,
        sparse: bool = False,
    ):
        """`sparse`: the MLP is a mixture of experts (core/moe.py)."""
        self.layout, self.placement = layout, cfg.ln_placement
        self.hidden_dropout = cfg.hidden_dropout
        self.lora_dropout = cfg.lora_rank > 0 and cfg.lora_dropout > 0
        self.ln1 = norm(cfg, layout)
        self.attention = ParallelSelfAttention(
            cfg, layout=layout, precision=precision, rngs=rngs, causal=causal
        )
        self.ln2 = norm(cfg, layout)
        block = MoEBlock if sparse else ParallelMLP
        self.sparse = sparse
        self.mlp = block(cfg, layout=layout, precision=precision, rngs=rngs)

    def __call__(self, x, *, key=None, mask=None, cache=None, pos=None, token_weights=None):
        """x after the layer, and (training) a sparse layer's routing statistics: (x, stats);
        with a KV `cache`, (x, the new cache). `token_weights` (b, s): the tokens the loss
        covers, for the statistics (None: all)."""
        k_attn, k1, k2 = jax.random.split(key, 3) if key is not None else (None, None, None)
        drop = lambda y, k: dropout(
            y, self.hidden_dropout, k, self.layout, self.layout.between_blocks
        )  # noqa: E731

        def attend(h, norm=None):
            if cache is None:
                return self.attention(h, key=k_attn, mask=mask, norm=norm), None
            return self.attention(h, key=k_attn, mask=mask, cache=cache, pos=pos, norm=norm)

        with jax.named_scope("attention"):
            if self.placement == "pre":
                a, new_cache = attend(x, norm=self.ln1)
                x = x + drop(a, k1)
            else:
                a, new_cache = attend(x)
                x = self.ln1(x + drop(a, k1))
        stats = None

        def mlp(h, norm=None):
            nonlocal stats
            kwargs = {"token_weights": token_weights} if self.sparse else {}
            out = self.mlp(h, norm=norm, key=self.adapter_key(k2), **kwargs)
            if self.sparse:
                out, stats = out
            return out

        with jax.named_scope("mlp"):
            if self.placement == "pre":
                x = x + drop(mlp(x, norm=self.ln2), k2)
            else:
                x = self.ln2(x + drop(mlp(x), k2))
        x = self.layout.constrain(x, self.layout.between_blocks)
        if cache is not None:
            return x, new_cache
        return (x, stats) if self.sparse else x

    def adapter_key(self, key):
        """The MLP adapters' dropout key (derived: the layer's own keys stay as without them)."""
        return None if key is None or not self.lora_dropout else key
