"""The attention core through `jax.nn.dot_product_attention` (model.attention = "fused").

On NVIDIA GPUs it asks for cuDNN's flash attention by name: `implementation=None` falls back to
XLA's attention (jax 0.10-0.12), which writes the (b, heads, q, k) scores to memory like
megajax's own core. cuDNN takes bf16/fp16 only, head dims that are multiples of 8 (up to 128,
256 on Hopper) and a mask as a (b, 1, q, k) bias; causal masking it takes as a flag, and it then
skips the masked half of the work. Where cuDNN refuses the shapes (jax checks them while
tracing), XLA's attention runs instead, with a warning that says why.

The heads stay split over "model" as the inputs are: cuDNN's kernel is partitioned along batch
and heads, so no collective is added (tests/test_attention.py audits it).
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp

from megajax.core.ops import is_segments, same_segment

CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)


def implementation(dtype, platform: str) -> str:
    """The attention implementation: "cudnn" where the flash kernel can take the inputs, "xla"
    elsewhere."""
    return "cudnn" if platform == "gpu" and jnp.dtype(dtype) in CUDNN_DTYPES else "xla"


def fused_attention_core(
    q, k, v, key_mask, *, causal: bool, scale: float, platform: str, window: int = 0
):
    """softmax(q k^T scale + masks) v for q, k, v (b, heads, s, d), queries and keys at positions
    0..s-1; key_mask (b, k) True where a key may be attended to, or (b, s) segment ids (a query
    attends within its segment), or None; `window` > 0: a query attends to itself and the
    window - 1 keys before it (jax's local_window_size). Returns (b, heads, q, d)."""
    # asked for only with a window: the call is otherwise as it was
    local = {"local_window_size": (window - 1, 0)} if window else {}
    # (b, s, heads, d), as jax takes them
    heads_second = lambda t: jnp.moveaxis(t, 1, 2)  # noqa: E731
    q, k, v = heads_second(q), heads_second(k), heads_second(v)
    if is_segments(key_mask):
        mask = same_segment(key_mask, key_mask)
    else:
        mask = None if key_mask is None else key_mask[:, None, None, :]
    if implementation(q.dtype, platform) == "cudnn":
        # cuDNN's mask must span the queries: (b, 1, q, k), broadcast per sequence, not per head.
        full = (
            None
            if mask is None
            else jnp.broadcast_to(mask, (q.shape[0], 1, q.shape[1], k.shape[1]))
        )
        try:
            return heads_second(
                jax.nn.dot_product_attention(
                    q,
                    k,
                    v,
                    mask=full,
                    is_causal=causal,
                    scale=scale,
                    implementation="cudnn",
                    **local,
                )
            )
        # shapes, dtypes or cuDNN version
        except (NotImplementedError, ValueError, RuntimeError) as e:
            warnings.warn(
                f"cuDNN flash attention refused these shapes ({e}); XLA's attention runs instead",
                stacklevel=2,
            )
    dtype = q.dtype
    if platform == "cpu" and dtype == jnp.float16:
        # XLA's attention asks for float16 x float16 -> float32 products, which XLA:CPU has no
        # kernel for: on the CPU it runs in float32, and its output is rounded back.
        q, k, v = (t.astype(jnp.float32) for t in (q, k, v))
    out = jax.nn.dot_product_attention(
        q, k, v, mask=mask, is_causal=causal, scale=scale, implementation="xla", **local
    )
    return heads_second(out.astype(dtype))
