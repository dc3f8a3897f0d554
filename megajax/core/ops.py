"""LayerNorm, the attention softmax and dropout with hand-written backward passes that keep
only what Megatron keeps for them (Korthikanti et al. 2022, section 4.1).

Left to autodiff, a float32-statistics LayerNorm on 16-bit activations saves three float32
copies of its input for the backward pass (12 bytes an element instead of 2), and a softmax
over float32 scores saves the scores, their exponentials and the broadcast masks (9 bytes a
score instead of 2). At GPT-2 shapes that was two thirds of a layer's activation memory. Here
LayerNorm saves its input in the activations' dtype and two float32 numbers per row; the
softmax saves its output in the activations' dtype (and the broadcast masks, never a
(b, heads, q, k) array), from which its backward pass follows; dropout
saves its boolean mask alone (drawn by `keep_mask`, a function of the key and each element's
global position).

The attention matmuls, q k^T and p v, also have their own backward pass on the CPU, for speed
alone: the same products as autodiff's, in the forms XLA:CPU's matmul library takes. Without
attention dropout, and with more than a block of scores on a device, the CPU goes further: its
attention core (blocked_attention.py) keeps no probabilities at all and recomputes them.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.extend.random import threefry2x32_p

from megajax.core.precision import low_precision_product, row_major


def zero_cotangent(x):
    """The cotangent of an integer or boolean input of a custom VJP: float0 zeros."""
    return jnp.zeros(jnp.shape(x), jax.dtypes.float0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def layer_norm(x, scale, bias, eps: float):
    """LayerNorm over the last axis with float32 statistics; the result in x's dtype."""
    return _layer_norm_fwd(x, scale, bias, eps)[0]


def _stats(x32, eps):
    mean = x32.mean(-1, keepdims=True)
    return mean, jax.lax.rsqrt(jnp.square(x32 - mean).mean(-1, keepdims=True) + eps)


def _layer_norm_fwd(x, scale, bias, eps):
    mean, rstd = _stats(x.astype(jnp.float32), eps)
    y = (x.astype(jnp.float32) - mean) * rstd * scale + bias
    return y.astype(x.dtype), (x, mean, rstd, scale)


def _layer_norm_bwd(eps, residuals, g):
    x, mean, rstd, scale = residuals
    g32 = g.astype(jnp.float32)
    xhat = (x.astype(jnp.float32) - mean) * rstd
    rows = tuple(range(x.ndim - 1))
    gx = g32 * scale
    dx = rstd * (gx - gx.mean(-1, keepdims=True) - xhat * (gx * xhat).mean(-1, keepdims=True))
    return dx.astype(x.dtype), (g32 * xhat).sum(rows), g32.sum(rows)


layer_norm.defvjp(_layer_norm_fwd, _layer_norm_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def rms_norm(x, scale, eps: float):
    """RMSNorm over the last axis (Zhang and Sennrich 2019; Llama's): x / rms(x) * scale, the
    statistic in float32; keeps x and one float32 number a row for the backward pass."""
    return _rms_norm_fwd(x, scale, eps)[0]


def _rms_norm_fwd(x, scale, eps):
    x32 = x.astype(jnp.float32)
    rstd = jax.lax.rsqrt(jnp.square(x32).mean(-1, keepdims=True) + eps)
    return (x32 * rstd * scale).astype(x.dtype), (x, rstd, scale)


def _rms_norm_bwd(eps, residuals, g):
    x, rstd, scale = residuals
    g32 = g.astype(jnp.float32)
    xhat = x.astype(jnp.float32) * rstd
    gx = g32 * scale
    dx = rstd * (gx - xhat * (gx * xhat).mean(-1, keepdims=True))
    return dx.astype(x.dtype), (g32 * xhat).sum(tuple(range(x.ndim - 1)))


rms_norm.defvjp(_rms_norm_fwd, _rms_norm_bwd)


def is_segments(mask) -> bool:
    """An attention mask given as segment ids (b, s) integers (packed sequences: each token
    attends only to its own segment), rather than a (b, k) boolean mask of the keys."""
    return mask is not None and jnp.issubdtype(mask.dtype, jnp.integer)


def position_keep(q_pos, k_pos, causal: bool, window: int = 0):
    """(q, k) True where a query at q_pos may attend to a key at k_pos: causal, the key not after
    it; with a sliding `window`, also not window or more positions before it."""
    keep = jnp.ones((1, 1), bool)
    if causal:
        keep = keep & (q_pos[:, None] >= k_pos[None, :])
    if window:
        keep = keep & (q_pos[:, None] - k_pos[None, :] < window)
    return keep


def same_segment(q_segments, k_segments):
    """(b, 1, q, k) True where query and key are in the same segment."""
    return q_segments[:, None, :, None] == k_segments[:, None, None, :]


def segment_positions(segments):
    """(b, s) segment ids, each segment contiguous -> each token's position within its segment:
    positions restart at 0 where the id changes."""
    idx = jnp.arange(segments.shape[-1])
    starts = jnp.concatenate(
        [jnp.ones_like(segments[:, :1], bool), segments[:, 1:] != segments[:, :-1]], axis=1
    )
    return idx - jax.lax.cummax(jnp.where(starts, idx, 0), axis=1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def masked_softmax(scores, keep, dtype):
    """softmax(scores) over the last axis where `keep` (broadcastable) is True, 0 elsewhere,
    computed in float32 and returned in `dtype`."""
    return _softmax_fwd(scores, keep, dtype)[0]


def _softmax_fwd(scores, keep, dtype):
    s = jnp.where(keep, scores.astype(jnp.float32), jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(s, axis=-1).astype(dtype)
    return probs, (probs, keep)


def _softmax_bwd(dtype, residuals, g):
    probs, keep = residuals
    p, g32 = probs.astype(jnp.float32), g.astype(jnp.float32)
    # Masked scores get no gradient; only a row with nothing to attend to (uniform, all masked: a
    # sequence of padding alone) has a nonzero p there, hence the select.
    ds = jnp.where(keep, p * (g32 - (g32 * p).sum(-1, keepdims=True)), 0.0)
    return ds, zero_cotangent(keep)  # keep: positions and the padding mask, no gradient


masked_softmax.defvjp(_softmax_fwd, _softmax_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def apply_dropout(x, keep, rate: float):
    """x / (1 - rate) where `keep`, 0 elsewhere. Its backward pass keeps the boolean mask only
    (1 byte an element): autodiff of a select also keeps a broadcast array of zeros."""
    return _scaled_select(x, keep, rate)


def _scaled_select(x, keep, rate):
    # The scale in float32: 1 - rate rounded to bfloat16 (0.9 -> 0.898) would bias every kept value.
    scaled = (x.astype(jnp.float32) / (1.0 - rate)).astype(x.dtype)
    return jax.lax.select(keep, scaled, jnp.zeros_like(x))


def keep_mask(key, shape, rate: float, rows):
    """True with probability 1 - rate: counter-based threefry bits of (global row, position in
    the row), so each device computes just its own slice of the mask with no communication.
    Each threefry call makes two 32-bit words: along an even last axis they serve two neighbours
    (half the calls; a device's slice of that axis, a multiple of 2, never splits a pair)."""
    words = jax.random.key_data(key).reshape(-1)
    pairs = len(shape) > 1 and shape[-1] % 2 == 0
    counters = (*shape[:-1], shape[-1] // 2) if pairs else shape
    counter_row = jnp.broadcast_to(
        rows.astype(jnp.uint32).reshape(-1, *([1] * (len(counters) - 1))), counters
    )
    counter_pos = jnp.broadcast_to(
        jnp.arange(math.prod(counters[1:]), dtype=jnp.uint32).reshape(counters[1:]), counters
    )
    first, second = threefry2x32_p.bind(words[0], words[1], counter_row, counter_pos)
    bits = jnp.stack([first, second], axis=-1).reshape(shape) if pairs else first
    return bits >= jnp.uint32(round(rate * 2.0**32))


def _dropout_fwd(x, keep, rate):
    return _scaled_select(x, keep, rate), keep


def _dropout_bwd(rate, keep, g):
    return _scaled_select(g, keep, rate), zero_cotangent(keep)


apply_dropout.defvjp(_dropout_fwd, _dropout_bwd)


def attention_scores(q, k):
    """q k^T over the last two axes, (..., q, d) x (..., k, d) -> (..., q, k), in float32."""
    if jnp.dtype(q.dtype).itemsize == 2:  # its gradient in 16 bits too, as Megatron's
        return low_precision_product("...qd,...kd->...qk", q, k, q.dtype)
    if not _strided_dots_matter(q, k):
        return jnp.einsum("...qd,...kd->...qk", q, k, preferred_element_type=jnp.float32)
    return _matmul(q, jnp.swapaxes(k, -1, -2))


def attention_context(p, v):
    """p v over the last two axes, (..., q, k) x (..., k, d) -> (..., q, d)."""
    if not _strided_dots_matter(p, v):
        return jnp.einsum("...qk,...kd->...qd", p, v)
    return _matmul(p, v)


def _strided_dots_matter(a, b) -> bool:
    """float32 operands on XLA:CPU: where autodiff's backward would run the strided dots below."""
    return a.dtype == b.dtype == jnp.float32 and jax.default_backend() == "cpu"


# On XLA:CPU the two attention matmuls' autodiff backward passes include one contraction over
# the query axis each, dk = ds^T q and dv = p^T do, with the (q, k) matrix as the transposed
# operand: XLA:CPU runs that as a strided dot at a third of the matmul rate (66 vs 187 GFLOP/s
# at b*heads 64, s 512, d 64). `rows_contracted` transposes only the small (q, d) operand
# instead: 32.5 -> 18.5 ms each, ~5% of bench/step_mfu.py's step.
@jax.custom_vjp
def _matmul(a, b):
    return a @ b


def _matmul_fwd(a, b):
    return a @ b, (a, b)


def _matmul_bwd(residuals, g):
    a, b = residuals
    return g @ jnp.swapaxes(b, -1, -2), rows_contracted(a, g)


_matmul.defvjp(_matmul_fwd, _matmul_bwd)


def rows_contracted(x, y):
    """x^T y over the last two axes, (..., m, i) x (..., m, j) -> (..., i, j), transposing only the
    smaller operand: made row-major and kept from XLA's folding (precision.row_major)."""
    if x.shape[-1] <= y.shape[-1]:
        return jax.lax.optimization_barrier(row_major(jnp.swapaxes(x, -1, -2)) @ y)
    y_t_x = jax.lax.optimization_barrier(row_major(jnp.swapaxes(y, -1, -2)) @ x)
    return jnp.swapaxes(y_t_x, -1, -2)
