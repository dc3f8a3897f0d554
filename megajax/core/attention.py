"""Self-attention, Megatron's way: queries, keys and values split by heads over "model", the
attention local to each device's heads, the output projection row-parallel with one all-reduce.

Grouped-query attention (Llama, Mistral, Qwen2: fewer key/value heads than query heads) keeps
the split: when the model axis divides the key/value heads they are split like the queries;
when it is a multiple of them each device holds the key/value head its query heads read
(replicated, as torchtitan and MaxText do), and their gradient is summed over the copies.
Rotary positions turn each device's queries and keys (core/rope.py); no collective is added.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from megajax import analytic
from megajax.core import sharding as S
from megajax.core.blocked_attention import blocked_attention, blocked_attention_pays
from megajax.core.fused_attention import fused_attention_core
from megajax.core.layers import (
    ColumnParallelLinear,
    FusedColumnParallelLinear,
    RowParallelLinear,
    dropout,
)
from megajax.core.lora import adapter, adapter_keys
from megajax.core.norms import RMSNorm
from megajax.core.ops import (
    attention_context,
    attention_scores,
    is_segments,
    masked_softmax,
    position_keep,
    same_segment,
    segment_positions,
)
from megajax.core.precision import Precision
from megajax.core.rope import apply_rotary, rotary_angles
from megajax.mesh_shape import MeshShape
from megajax.model_config import ModelConfig


def kv_copies(cfg: ModelConfig, mesh: MeshShape) -> int:
    """On how many devices each key/value head lives (analytic.kv_copies)."""
    return analytic.kv_copies(cfg.num_heads, cfg.kv_heads, mesh)


def copied_weights(cfg: ModelConfig, mesh: MeshShape) -> dict[str, int]:
    """{weight name: the share of it each device computes a gradient for} of the weights held in
    copies: grouped-query attention's key/value kernel and bias (and LoRA's B of them) when
    kv_copies > 1."""
    copies = kv_copies(cfg, mesh)
    if copies == 1:
        return {}
    # (LoRA's B of the key/value part is held in copies like the kernel: core/layers.py)
    return {
        "kv_kernel": cfg.kv_heads,
        "kv_bias": cfg.kv_heads,
        **({"b_kv": cfg.kv_heads} if "qkv" in cfg.lora_target_list else {}),
    }


def stored_kv_heads(cfg: ModelConfig, mesh: MeshShape) -> int:
    """Key/value heads as the model axis holds them (a KV cache's heads): each one once, or each
    device's copy when they are replicated."""
    return cfg.kv_heads * kv_copies(cfg, mesh)


class ParallelSelfAttention(nnx.Module):
    """Queries, keys and values split by heads, attention local to each device's heads,
    row-parallel output.

    Multi-head attention has one QKV kernel whose columns are ordered (head, q|k|v, head_dim),
    so a contiguous column shard holds whole heads with their q, k and v: the split needs no
    re-layout. Grouped-query attention has a query kernel (heads, head_dim) and a key/value
    kernel (kv heads, k|v, head_dim), run as one matmul (FusedColumnParallelLinear).
    """

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        layout: S.Layout,
        precision: Precision,
        rngs: nnx.Rngs,
        causal: bool = True,
    ):
        self.layout, self.causal = layout, causal
        self.num_heads, self.head_dim, self.cfg = cfg.num_heads, cfg.head_dim, cfg
        self.grouped = cfg.kv_heads < cfg.num_heads
        self.attention_dropout = cfg.attention_dropout
        self.fused = fused_attention(cfg, layout)
        self.selective_remat = cfg.remat == "selective"
        self.blocked = cfg.attention_dropout == 0  # where it pays: blocked_attention_pays
        out_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)
        common = dict(
            layout=layout,
            precision=precision,
            regather=cfg.remat != "full",
            std=cfg.init_std,
            rngs=rngs,
            use_bias=cfg.bias != "none",
        )
        width = cfg.num_heads * cfg.head_dim
        if self.grouped:
            parts = [
                ("q", width, 1),
                ("kv", 2 * cfg.kv_heads * cfg.head_dim, kv_copies(cfg, layout.shape)),
            ]
            self.qkv = FusedColumnParallelLinear(
                cfg.hidden,
                parts,
                lora=adapter(cfg, "qkv", cfg.hidden, 0, column=True, rngs=rngs, parts=parts),
                **common,
            )
        else:
            self.qkv = ColumnParallelLinear(
                cfg.hidden,
                3 * width,
                lora=adapter(cfg, "qkv", cfg.hidden, 3 * width, column=True, rngs=rngs),
                **common,
            )
        self.out = RowParallelLinear(
            width,
            cfg.hidden,
            layout=layout,
            precision=precision,
            std=out_std,
            rngs=rngs,
            use_bias=cfg.bias == "all",
            lora=adapter(cfg, "out", width, cfg.hidden, column=False, rngs=rngs),
        )
        self.recompute_norm_gelu = precision.recompute_norm_gelu
        if cfg.qk_norm:  # over each head's features: (b, heads, s, d) kept as it is split
            self.q_norm = RMSNorm(cfg.head_dim, cfg.ln_eps, rows_2d=False)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.ln_eps, rows_2d=False)

    def __call__(self, x, *, key=None, mask=None, cache=None, pos=None, norm=None):
        """Self-attention over x (b, s, h), or over norm(x) (as ParallelMLP). With `cache` = (k, v),
        each (b, heads, max_len, head_dim) and split over heads like the weights, x holds the
        tokens at positions pos..pos+s-1: their keys and values are written into the cache and
        the queries attend to every cached position up to their own. `mask`: (b, k) booleans,
        the keys that may be attended to, or (b, s) integer segment ids (packed sequences: a
        token attends within its segment, its rotary position counted from the segment's
        start). Returns the output (and the new cache)."""
        b, s, _ = x.shape
        k_qkv, k_out = adapter_keys(key, 2)
        project = lambda x: self.qkv(x if norm is None else norm(x), k_qkv)  # noqa: E731
        project = jax.checkpoint(project) if self.recompute_norm_gelu else project
        q, k, v = self.split_heads(project(x))
        if self.cfg.qk_norm:  # before the rotation and the cache, as Qwen3's
            q, k = self.q_norm(q), self.k_norm(k)
        q_pos = jnp.arange(s) if pos is None else pos + jnp.arange(s)
        if self.cfg.positions == "rope":
            if is_segments(mask):  # (b, 1, s, d/2): per row, broadcast over the heads
                cos, sin = (t[:, None] for t in rotary_angles(self.cfg, segment_positions(mask)))
            else:
                cos, sin = rotary_angles(self.cfg, q_pos)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        # the along-axis form: its indices share pos's integer type (also with x64 on)
        if cache is not None:
            k = jax.lax.dynamic_update_slice_in_dim(cache[0], k.astype(cache[0].dtype), pos, axis=2)
            v = jax.lax.dynamic_update_slice_in_dim(cache[1], v.astype(cache[1].dtype), pos, axis=2)
            k, v = (self.layout.constrain(t, S.KV_CACHE) for t in (k, v))
            cache = (k, v)
        if cache is None and self.fused:
            core = self.fused_core
        elif cache is None and self.blocked and blocked_attention_pays(q, self.ways()):
            # keeps no probabilities: nothing for selective remat to drop
            core = self.blocked_core
        else:
            core = jax.checkpoint(self.core) if self.selective_remat else self.core
        with jax.named_scope("attention_core"):  # the profiler's "attention" (--profile)
            ctx = core(q, *self.shared_kv(k, v, core), q_pos, mask, key)
        ctx = self.layout.constrain(jnp.moveaxis(ctx, 1, 2), S.ACT_HEADS)
        out = self.out(ctx.reshape(b, s, self.num_heads * self.head_dim), k_out)
        return out if cache is None else (out, cache)

    def split_heads(self, projected):
        """The projection's output as q (b, heads, s, d) and k, v (b, kv heads as stored, s, d):
        batch dimensions leading, the layout XLA's dots prefer; the heads stay split."""
        b, s = projected.shape[:2]
        if not self.grouped:
            qkv = projected.reshape(b, s, self.num_heads, 3, self.head_dim)
            qkv = self.layout.constrain(qkv, S.P(S.DATA, None, S.MODEL, None, None))
            return (jnp.moveaxis(qkv[:, :, :, i], 2, 1) for i in range(3))
        d = self.head_dim
        q_width = self.qkv.widths()[0]
        q = projected[..., :q_width].reshape(b, s, self.num_heads, d)
        # (b, s, kv heads as stored, k|v, d)
        kv = projected[..., q_width:].reshape(b, s, -1, 2, d)
        q = self.layout.constrain(q, S.ACT_HEADS)
        kv = self.layout.constrain(kv, S.P(S.DATA, None, S.MODEL, None, None))
        return (
            jnp.moveaxis(q, 2, 1),
            jnp.moveaxis(kv[:, :, :, 0], 2, 1),
            jnp.moveaxis(kv[:, :, :, 1], 2, 1),
        )

    def shared_kv(self, k, v, core):
        """k, v for the core: the fused core takes grouped heads as they are; megajax's cores
        take one key/value head per query head, repeated on each device (its own heads only)."""
        groups = self.num_heads // k.shape[1]
        if groups == 1 or core == self.fused_core:
            return k, v

        def repeat(t):
            return self.layout.constrain(jnp.repeat(t, groups, axis=1), S.ATTN_SCORES)

        return repeat(k), repeat(v)

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
        del q_pos, key  # positions 0..s-1: no cache
        return blocked_attention(
            q,
            k,
            v.astype(q.dtype),
            mask,
            causal=self.causal,
            scale=1 / math.sqrt(self.head_dim),
            ways=self.ways(),
            window=self.cfg.sliding_window,
        )

    def ways(self) -> tuple[int, int]:
        """How many devices split the batch and the heads (the batch is already this device's
        rows inside the data-manual shard_map)."""
        return 1 if S.DATA in self.layout.manual else self.layout.dp, self.layout.tp

    def fused_core(self, q, k, v, q_pos, mask, key):
        """The same through `jax.nn.dot_product_attention` (no attention dropout): cuDNN's flash
        attention on NVIDIA GPUs, XLA's attention elsewhere (fused_attention.py)."""
        del q_pos, key  # positions 0..s-1: no cache
        return fused_attention_core(
            q,
            k,
            v.astype(q.dtype),
            mask,
            causal=self.causal,
            scale=1 / math.sqrt(self.head_dim),
            platform=platform(self.layout),
            window=self.cfg.sliding_window,
        )

    def keep(self, q_pos, num_keys: int, mask):
        """Which (query, key) pairs attend: causal, sliding-window, padding and segment masks,
        broadcast, never (b, heads, q, k). The positions are absolute (the cache's too), so a
        query past the window sees only its last sliding_window keys, as in training."""
        keep = position_keep(q_pos, jnp.arange(num_keys), self.causal, self.cfg.sliding_window)
        if is_segments(mask):
            keep = keep & same_segment(mask, mask)
        elif mask is not None:  # (b, k) True where a key may be attended to
            keep = keep & mask[:, None, None, :]
        return keep


def platform(layout: S.Layout) -> str:
    """The platform of the layout's devices ("cpu", "gpu", "tpu")."""
    devices = layout.mesh.devices.flat if layout.mesh is not None else jax.devices()
    return next(iter(devices)).platform


def fused_attention(
    cfg: ModelConfig, layout: S.Layout | None = None, on: str | None = None
) -> bool:
    """model.attention: fused when asked, or (auto) on GPUs without attention dropout; on the CPU
    XLA's form keeps the float32 scores for its backward pass, which megajax's own core does not.
    `on`: the platform ("gpu", "cpu") instead of the layout's."""
    if cfg.attention == "auto":
        return cfg.attention_dropout == 0 and (on or platform(layout)) == "gpu"
    return cfg.attention == "fused"
