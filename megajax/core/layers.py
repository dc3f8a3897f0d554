"""Megatron's tensor-parallel building blocks as Flax NNX modules.

Each weight carries its PartitionSpec (from megajax/core/sharding.py) as NNX sharding metadata.
Inside a block, activations stay split over "model"; the single all-reduce per block is
`layout.reduce_to_replicated` in RowParallelLinear (g forward, f backward).
LayerNorm, dropout and residual adds run duplicated on every device of the model axis.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from megajax.config import ModelConfig
from megajax.core import sharding as S
from megajax.core.blocked_attention import blocked_attention, blocked_attention_pays
from megajax.core.fused_attention import fused_attention_core
from megajax.core.loss import vocab_parallel_lookup
from megajax.core.ops import (apply_dropout, attention_context, attention_scores, keep_mask, layer_norm,
                              masked_softmax)
from megajax.core.precision import Precision, logits_product, matmul


def param(init, spec, key, shape):
    """A float32 weight carrying its PartitionSpec as metadata. The sharding is applied by
    megajax itself (jit out_shardings when the model is built), not eagerly by Flax, which
    would need a global mesh."""
    return nnx.Param(nnx.with_partitioning(init, spec)(key, shape, jnp.float32), eager_sharding=False)


def dropout(x, rate: float, key, layout: S.Layout, spec):
    """Dropout whose mask depends only on the key and each element's global position: identical
    on every mesh, whether the rows are computed whole (GSPMD) or per data shard (the data-manual
    step of ZeRO / FSDP, where `layout.row_ids` offsets them)."""
    if key is None or rate == 0.0:
        return x
    return apply_dropout(x, layout.constrain(keep_mask(key, x.shape, rate, layout.row_ids(x.shape[0])), spec), rate)


class LayerNorm(nnx.Module):
    """LayerNorm with float32 statistics; its parameters are replicated over the mesh.
    `rows_2d`: normalise a (rows, hidden) view, faster on XLA:CPU; off for sequence-parallel
    activations, whose (b, s/tp) split the merged rows would lose (XLA would gather them)."""

    def __init__(self, dim: int, eps: float = 1e-5, rows_2d: bool = True):
        self.eps, self.rows_2d = eps, rows_2d
        self.scale = param(nnx.initializers.ones, S.REPLICATED_BIAS, jax.random.key(0), (dim,))
        self.bias = param(nnx.initializers.zeros, S.REPLICATED_BIAS, jax.random.key(0), (dim,))

    def __call__(self, x):
        # On (rows, hidden): XLA:CPU's backward (column sums for scale/bias) is ~1.5x faster in 2-D.
        rows = x.reshape(-1, x.shape[-1]) if self.rows_2d else x
        return layer_norm(rows, self.scale[...], self.bias[...], self.eps).reshape(x.shape)


class _Linear(nnx.Module):
    """W (d_in, d_out) and b (d_out,) split as the subclass's specs say, and the local x W.

    The three linear layers differ only in those specs and in what follows the local matmul:
    nothing (column), the all-reduce (row) or a replicated constraint."""
    KERNEL_SPEC: S.P
    BIAS_SPEC: S.P

    def __init__(self, d_in: int, d_out: int, *, layout: S.Layout, precision: Precision, std: float,
                 rngs: nnx.Rngs):
        self.layout, self.precision = layout, precision
        self.kernel = param(nnx.initializers.normal(std), self.KERNEL_SPEC, rngs.params(), (d_in, d_out))
        self.bias = param(nnx.initializers.zeros, self.BIAS_SPEC, rngs.params(), (d_out,))

    def local_matmul(self, x):
        return matmul(x.astype(self.precision.compute), self.kernel[...], self.precision.matmul,
                      self.precision.stacked_residuals)

    def local_bias(self):
        return self.bias[...].astype(self.precision.compute)


class ColumnParallelLinear(_Linear):
    """y = x W + b with W split by columns: each device computes out/tp features, no communication.
    With sequence parallelism x arrives split along the sequence and is all-gathered first
    (Megatron's f becomes an all-gather forward, a reduce-scatter backward)."""
    KERNEL_SPEC, BIAS_SPEC = S.COLUMN, S.COLUMN_BIAS

    def __init__(self, *args, regather: bool = True, **kwargs):
        super().__init__(*args, **kwargs)
        self.regather = regather    # False under full remat, which recomputes the gather anyway

    def __call__(self, x):
        y = self.gathered_matmul(x) if self.layout.sequence_parallel else self.local_matmul(x)
        return self.layout.constrain(y + self.local_bias(), S.ACT_COLUMN)

    def gathered_matmul(self, x):
        # Checkpointed, as Megatron does: the backward pass keeps the (b, s/tp, h) shard and
        # all-gathers it again for the weight gradient, instead of keeping the whole sequence.
        # In a scanned stack; in unrolled layers XLA may merge the two gathers (jax 0.10's does),
        # which keeps the whole input as without the checkpoint.
        def local(x, w):
            return matmul(_gather_sequence(x).astype(self.precision.compute), w, self.precision.matmul,
                          self.precision.stacked_residuals)
        local = jax.checkpoint(local) if self.regather else local
        return self.layout.shard_map(local, (S.ACT_SEQUENCE, S.P(*S.COLUMN)), S.ACT_COLUMN)(x, self.kernel[...])


class RowParallelLinear(_Linear):
    """y = x W + b with W split by rows: partial sums all-reduced over "model", then the bias.
    With sequence parallelism they are reduce-scattered along the sequence instead (g becomes
    a reduce-scatter forward, an all-gather backward)."""
    KERNEL_SPEC, BIAS_SPEC = S.ROW, S.REPLICATED_BIAS

    def __call__(self, x):
        if self.layout.sequence_parallel:
            return self.scattered_matmul(x) + self.local_bias()
        return self.layout.reduce_to_replicated(self.local_matmul(x)) + self.local_bias()

    def scattered_matmul(self, x):
        def local(x, w):
            y = matmul(x.astype(self.precision.compute), w, self.precision.matmul,
                       self.precision.stacked_residuals)
            with jax.named_scope("g_reduce_scatter"):
                return jax.lax.psum_scatter(y, S.MODEL, scatter_dimension=1, tiled=True)
        return self.layout.shard_map(local, (S.ACT_COLUMN, S.P(*S.ROW)), S.ACT_SEQUENCE)(x, self.kernel[...])


def _gather_sequence(x):
    """Inside a shard_map: (b, s/tp, h) -> (b, s, h), Megatron's f under sequence parallelism."""
    with jax.named_scope("f_all_gather"):
        return jax.lax.all_gather(x, S.MODEL, axis=1, tiled=True)


class ReplicatedLinear(_Linear):
    """y = x W + b with W whole on every device: for the small heads (BERT's MLM transform,
    pooler, classifiers), computed duplicated like LayerNorm, so they add no collective."""
    KERNEL_SPEC, BIAS_SPEC = S.REPLICATED_2D, S.REPLICATED_BIAS

    def __call__(self, x):
        y = self.local_matmul(x) + self.local_bias()
        return self.layout.constrain(y, S.P(S.DATA, *([None] * (y.ndim - 1))))


class VocabParallelEmbedding(nnx.Module):
    """Token embedding split along the vocabulary; also the tied output layer."""

    def __init__(self, vocab: int, dim: int, *, layout: S.Layout, precision: Precision, std: float,
                 rngs: nnx.Rngs):
        self.layout, self.dtype = layout, precision.compute
        self.table = param(nnx.initializers.normal(std), S.VOCAB, rngs.params(), (vocab, dim))

    def __call__(self, ids):
        """Each device looks up the ids it owns (zeros elsewhere); one all-reduce sums them."""
        return vocab_parallel_lookup(self.table[...].astype(self.dtype), ids, self.layout)

    def attend(self, x, sequence_sharded: bool = False):
        """Vocab-parallel logits x E^T, float32, left split over "model" (never gathered).
        `sequence_sharded` x (b, s/tp, h) is all-gathered first, in the same shard_map, so the
        backward pass reduce-scatters x's gradient instead of all-reducing it."""
        if sequence_sharded:
            return self.gathered_attend(x)
        with jax.named_scope("logits"):
            logits = logits_product(x, self.table[...], self.dtype)
            return self.layout.constrain(logits, S.P(S.DATA, None, S.MODEL))

    def gathered_attend(self, x):
        def local(x, table):
            return logits_product(_gather_sequence(x), table, self.dtype)
        with jax.named_scope("logits"):
            return self.layout.shard_map(local, (S.ACT_SEQUENCE, S.P(*S.VOCAB)), S.P(S.DATA, None, S.MODEL))(
                x, self.table[...])


class ParallelMLP(nnx.Module):
    """Column-parallel fc1, GeLU local to each device, row-parallel fc2, one all-reduce."""

    def __init__(self, cfg: ModelConfig, *, layout: S.Layout, precision: Precision, rngs: nnx.Rngs):
        out_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)
        self.approximate_gelu = cfg.gelu == "tanh"
        self.fc1 = ColumnParallelLinear(cfg.hidden, cfg.ffn, layout=layout, precision=precision,
                                        regather=cfg.remat != "full", std=cfg.init_std, rngs=rngs)
        self.fc2 = RowParallelLinear(cfg.ffn, cfg.hidden, layout=layout, precision=precision,
                                     std=out_std, rngs=rngs)
        self.recompute_norm_gelu = precision.recompute_norm_gelu

    def __call__(self, x, norm=None):
        """fc2(GeLU(fc1(x))), or of norm(x): the LayerNorm before the block, which with
        `recompute_norm_gelu` the backward pass recomputes from x (kept anyway) instead of keeping."""
        # Exact (erf) GeLU by default, as Megatron-LM; "tanh" is GPT-2's approximation, cheaper on
        # CPUs. Recomputed in the backward pass from its input, which is saved anyway: that keeps
        # no (b, s, ffn) intermediates alive and is ~5% faster on XLA:CPU (bench/shakespeare_char.py).
        gelu = jax.checkpoint(lambda h: jax.nn.gelu(h, approximate=self.approximate_gelu))
        first = lambda x: self.fc1(x if norm is None else norm(x))   # noqa: E731
        second = lambda h: self.fc2(gelu(h))                         # noqa: E731
        if self.recompute_norm_gelu:    # keeps x and fc1's output, not LayerNorm's and the GeLU's too
            first, second = jax.checkpoint(first), jax.checkpoint(second)
        return second(first(x))


class ParallelSelfAttention(nnx.Module):
    """Fused QKV split by heads, attention local to each head group, row-parallel output.

    The QKV kernel's columns are ordered (head, q|k|v, head_dim), so a contiguous column
    shard holds whole heads with their q, k and v: the split needs no re-layout.
    """

    def __init__(self, cfg: ModelConfig, *, layout: S.Layout, precision: Precision, rngs: nnx.Rngs,
                 causal: bool = True):
        self.layout, self.causal = layout, causal
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.attention_dropout = cfg.attention_dropout
        self.fused = fused_attention(cfg, layout)
        self.selective_remat = cfg.remat == "selective"
        self.blocked = cfg.attention_dropout == 0    # where it pays: blocked_attention_pays
        out_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)
        self.qkv = ColumnParallelLinear(cfg.hidden, 3 * cfg.hidden, layout=layout, precision=precision,
                                        regather=cfg.remat != "full",
                                        std=cfg.init_std, rngs=rngs)
        self.out = RowParallelLinear(cfg.hidden, cfg.hidden, layout=layout, precision=precision,
                                     std=out_std, rngs=rngs)
        self.recompute_norm_gelu = precision.recompute_norm_gelu

    def __call__(self, x, *, key=None, mask=None, cache=None, pos=None, norm=None):
        """Self-attention over x (b, s, h), or over norm(x) (as ParallelMLP). With `cache` = (k, v),
        each (b, heads, max_len, head_dim) and split over heads like the weights, x holds the
        tokens at positions pos..pos+s-1: their keys and values are written into the cache and
        the queries attend to every cached position up to their own. Returns the output (and
        the new cache)."""
        b, s, _ = x.shape
        project = lambda x: self.qkv(x if norm is None else norm(x))   # noqa: E731
        project = jax.checkpoint(project) if self.recompute_norm_gelu else project
        qkv = project(x).reshape(b, s, self.num_heads, 3, self.head_dim)
        qkv = self.layout.constrain(qkv, S.P(S.DATA, None, S.MODEL, None, None))
        # (b, heads, s, head_dim): batch dimensions leading, the layout XLA's dots prefer.
        q, k, v = (jnp.moveaxis(qkv[:, :, :, i], 2, 1) for i in range(3))
        q_pos = jnp.arange(s)
        if cache is not None:   # the along-axis form: its indices share pos's integer type (also with x64 on)
            k = jax.lax.dynamic_update_slice_in_dim(cache[0], k.astype(cache[0].dtype), pos, axis=2)
            v = jax.lax.dynamic_update_slice_in_dim(cache[1], v.astype(cache[1].dtype), pos, axis=2)
            k, v = (self.layout.constrain(t, S.KV_CACHE) for t in (k, v))
            cache, q_pos = (k, v), pos + q_pos
        if cache is None and self.fused:
            core = self.fused_core
        elif cache is None and self.blocked and blocked_attention_pays(q, self.ways()):
            core = self.blocked_core    # keeps no probabilities: nothing for selective remat to drop
        else:
            core = jax.checkpoint(self.core) if self.selective_remat else self.core
        ctx = core(q, k, v, q_pos, mask, key)
        ctx = self.layout.constrain(jnp.moveaxis(ctx, 1, 2), S.ACT_HEADS).reshape(b, s, self.num_heads * self.head_dim)
        out = self.out(ctx)
        return out if cache is None else (out, cache)

    def core(self, q, k, v, q_pos, mask, key):
        """softmax(q k^T / sqrt(d) + masks) v, with attention dropout: (b, heads/tp, q, d). Its
        intermediates grow with s^2; selective remat (Korthikanti et al. 2022) recomputes just
        this in the backward pass, from q, k and v, and keeps everything else."""
        scores = attention_scores(q, k)
        scores = self.layout.constrain(scores / math.sqrt(self.head_dim), S.ATTN_SCORES)
        probs = masked_softmax(scores, self.keep(q_pos, k.shape[2], mask), q.dtype)
        probs = dropout(probs, self.attention_dropout, key, self.layout, S.ATTN_SCORES)
        return attention_context(probs, v.astype(q.dtype))

    def blocked_core(self, q, k, v, q_pos, mask, key):
        """The same without attention dropout on the CPU: a few (batch, head) pairs at a time,
        keeping no probabilities (blocked_attention.py); the heads stay split over "model"."""
        del q_pos, key    # positions 0..s-1: no cache
        return blocked_attention(q, k, v.astype(q.dtype), mask, causal=self.causal,
                                 scale=1 / math.sqrt(self.head_dim), ways=self.ways())

    def ways(self) -> tuple[int, int]:
        """How many devices split the batch and the heads (the batch is already this device's
        rows inside the data-manual shard_map)."""
        return 1 if self.layout.data_manual else self.layout.dp, self.layout.tp

    def fused_core(self, q, k, v, q_pos, mask, key):
        """The same through `jax.nn.dot_product_attention` (no attention dropout): cuDNN's flash
        attention on NVIDIA GPUs, XLA's attention elsewhere (fused_attention.py)."""
        del q_pos, key    # positions 0..s-1: no cache
        return fused_attention_core(q, k, v.astype(q.dtype), mask, causal=self.causal,
                                    scale=1 / math.sqrt(self.head_dim), platform=platform(self.layout))

    def keep(self, q_pos, num_keys: int, mask):
        """Which (query, key) pairs attend: causal and padding masks, broadcast, never (b, heads, q, k)."""
        keep = jnp.ones((1, 1, 1, 1), bool)
        if self.causal:
            keep = keep & (q_pos[:, None] >= jnp.arange(num_keys)[None, :])
        if mask is not None:  # (b, k) True where a key may be attended to
            keep = keep & mask[:, None, None, :]
        return keep


def platform(layout: S.Layout) -> str:
    """The platform of the layout's devices ("cpu", "gpu", "tpu")."""
    devices = layout.mesh.devices.flat if layout.mesh is not None else jax.devices()
    return next(iter(devices)).platform


def fused_attention(cfg: ModelConfig, layout: S.Layout | None = None, on: str | None = None) -> bool:
    """model.attention: fused when asked, or (auto) on GPUs without attention dropout; on the CPU
    XLA's form keeps the float32 scores for its backward pass, which megajax's own core does not.
    `on`: the platform ("gpu", "cpu") instead of the layout's."""
    if cfg.attention == "auto":
        return cfg.attention_dropout == 0 and (on or platform(layout)) == "gpu"
    return cfg.attention == "fused"


class TransformerLayer(nnx.Module):
    """Attention and MLP blocks with residuals; LayerNorm before each block (pre) or after each add (post)."""

    def __init__(self, cfg: ModelConfig, *, layout: S.Layout, precision: Precision, rngs: nnx.Rngs,
                 causal: bool = True):
        self.layout, self.placement = layout, cfg.ln_placement
        self.hidden_dropout = cfg.hidden_dropout
        self.ln1 = LayerNorm(cfg.hidden, cfg.ln_eps, rows_2d=not layout.sequence_parallel)
        self.attention = ParallelSelfAttention(cfg, layout=layout, precision=precision, rngs=rngs, causal=causal)
        self.ln2 = LayerNorm(cfg.hidden, cfg.ln_eps, rows_2d=not layout.sequence_parallel)
        self.mlp = ParallelMLP(cfg, layout=layout, precision=precision, rngs=rngs)

    def __call__(self, x, *, key=None, mask=None, cache=None, pos=None):
        k_attn, k1, k2 = jax.random.split(key, 3) if key is not None else (None, None, None)
        drop = lambda y, k: dropout(y, self.hidden_dropout, k, self.layout, self.layout.between_blocks)  # noqa: E731

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
        with jax.named_scope("mlp"):
            if self.placement == "pre":
                x = x + drop(self.mlp(x, norm=self.ln2), k2)
            else:
                x = self.ln2(x + drop(self.mlp(x), k2))
        x = self.layout.constrain(x, self.layout.between_blocks)
        return x if cache is None else (x, new_cache)
