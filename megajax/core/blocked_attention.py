"""The attention core on the CPU without attention dropout: (batch, head) pairs a few at a time,
so that each block's (q, k) scores, probabilities and their gradients stay in the caches
instead of going through memory as (b, heads, s, s) arrays, and no probabilities are kept for
the backward pass.

At bench/step_mfu.py's shapes (b 8, 8 heads, s 512) each of those arrays is 64 MiB, and XLA:CPU
wrote, read and rewrote several of them per layer. Here the forward pass keeps q, k, v, its
output and two float32 numbers per query (the scores' row max and the exponentials' inverse
row sum); the backward pass recomputes each block's probabilities exactly from them (one more
q k^T and one exp, which cost less than the memory traffic they replace). With a causal mask alone,
each tile of QUERY_TILE queries meets only the keys up to its last query, skipping part of
the masked (q, k) work. The arithmetic is that of `ops.masked_softmax` between
`ops.attention_scores` and `ops.attention_context`, in another order.

The loop runs over whole blocks of each device's own pairs: the batch and the heads are split
into (ways, blocks, per block), with "ways" the devices that split them (the "data" and "model"
axes), so a block spans every device and holds a contiguous slab of each device's rows: the
loop adds no collective and no transposed copy.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from megajax.core.ops import is_segments, position_keep, rows_contracted, zero_cotangent

# Scores per block on each device: 8 MiB of float32 (2 MiB blocks were ~4% slower at s 512 on a
# 2-core Xeon, where one (batch, head) pair of 1-2 MiB alone also ran slower than two).
BLOCK_BYTES = 8 << 20


def blocked_attention_pays(q, ways: tuple[int, int] = (1, 1)) -> bool:
    """float32 activations on XLA:CPU whose (b, heads, s, s) scores on a device exceed a block:
    there the memory traffic of those arrays is what the attention core's time goes to. Smaller
    ones stay in the caches anyway, and the plain core, which keeps its probabilities, saves
    the recomputation. GPUs take jax.nn.dot_product_attention (model.attention)."""
    b, h, s, _ = q.shape
    scores = 4 * b * h * s * s // (ways[0] * ways[1])
    return q.dtype == jnp.float32 and jax.default_backend() == "cpu" and scores > BLOCK_BYTES


def blocked_attention(
    q,
    k,
    v,
    key_mask,
    *,
    causal: bool,
    scale: float,
    ways: tuple[int, int] = (1, 1),
    window: int = 0,
):
    """softmax(q k^T * scale, masked) v for q, k, v (b, heads, s, d), the same s for queries and
    keys. Masked: causal (a query sees the keys up to its own position) and, if `key_mask` (b, s)
    is given, only the keys where it is True, or with (b, s) integer segment ids those of the
    query's segment; `window` > 0: only the key of the query's own position and the window - 1
    before it. A query with nothing to attend to attends to all keys uniformly, as
    jax.nn.softmax does. `ways`: how many devices split the batch and the heads."""
    ways = tuple(w if n % w == 0 else 1 for w, n in zip(ways, q.shape[:2]))  # not split that way
    blocks = _blocks(q.shape, ways)
    return _attention(q, k, v, key_mask, (causal, window), scale, ways, blocks)


def _blocks(shape, ways) -> tuple[int, int]:
    """(batch blocks, head blocks) per device: blocks of about BLOCK_BYTES of scores, at least two
    pairs each where a device has two, split along the heads or along the batch but not both, so
    that a block is contiguous in each device's memory."""
    b, h, s, _ = shape
    local_b, local_h = b // ways[0], h // ways[1]
    pairs = min(local_b * local_h, max(2, BLOCK_BYTES // (4 * s * s)))
    if pairs >= local_h:  # whole heads: blocks of batch rows
        per_block = max(
            d for d in range(1, local_b + 1) if local_b % d == 0 and d * local_h <= pairs
        )
        return local_b // per_block, 1
    per_block = max(d for d in range(1, local_h + 1) if local_h % d == 0 and d <= pairs)
    return local_b, local_h // per_block


def _to_blocks(t, ways, blocks):
    """(b, h, ...) -> (blocks, pairs a block, ...), block-major. A block's (batch, head) pairs are
    one axis, which `_block_shaped` splits inside the loop: a (blocks, 1, heads, ...) array (one
    batch row a block) made XLA:CPU pick a layout for it that it then copied whole, per layer."""
    (wb, wh), (nb, nh) = ways, blocks
    b, h, *rest = t.shape
    t = t.reshape(wb, nb, b // (wb * nb), wh, nh, h // (wh * nh), *rest)
    t = jnp.moveaxis(t, (1, 4), (0, 1))
    return t.reshape(nb * nh, (b // nb) * (h // nh), *rest)


def _block_shaped(t, shape, blocks):
    """One block's (pairs, ...) as (b / batch blocks, h / head blocks, ...)."""
    return t.reshape(shape[0] // blocks[0], shape[1] // blocks[1], *t.shape[1:])


def _pairs(t):
    """`_block_shaped`'s inverse: (b / batch blocks, h / head blocks, ...) -> (pairs, ...)."""
    return t.reshape(t.shape[0] * t.shape[1], *t.shape[2:])


def _from_blocks(t, ways, blocks, shape):
    """(blocks, pairs a block, ...) -> (b, h, ...) of the original `shape`."""
    (wb, wh), (nb, nh) = ways, blocks
    b, h = shape[:2]
    rest = t.shape[2:]
    t = t.reshape(nb, nh, wb, b // (wb * nb), wh, h // (wh * nh), *rest)
    t = jnp.moveaxis(t, (0, 1), (1, 4))
    return t.reshape(b, h, *rest)


def _mask_blocks(key_mask, ways, blocks):
    """(b, s) key mask or segment ids -> a (b / batch blocks, 1, 1, s) one per block, or None."""
    if key_mask is None:
        return None
    (wb, _), (nb, nh) = ways, blocks
    b, s = key_mask.shape
    rows = jnp.moveaxis(key_mask.reshape(wb, nb, b // (wb * nb), s), 1, 0).reshape(nb, b // nb, s)
    return jnp.repeat(rows, nh, axis=0)[:, :, None, None, :]


# Causal attention in tiles of this many queries, each against the keys up to its last query
# only: at s 512, two tiles skip a quarter of the (q, k) work (the attention core ~18% faster on
# a 2-core Xeon; tiles of 128 no faster, 64 slower).
QUERY_TILE = 256


def _tiles(s, masking, key_mask):
    """(first query, end query, end key) of each tile of queries. Only causal attention without a
    key mask is tiled: with one, a query may see no key at all and then attends to all s keys
    uniformly (as jax.nn.softmax gives), which a tile that skips keys would not. (A query always
    sees its own segment's start: segment ids keep the tiles.)"""
    if not masking[0] or (key_mask is not None and not is_segments(key_mask)):
        return [(0, s, s)]
    return [
        (lo, min(lo + QUERY_TILE, s), min(lo + QUERY_TILE, s)) for lo in range(0, s, QUERY_TILE)
    ]


def _keep(lo, hi, kend, masking, key_mask):
    keep = position_keep(jnp.arange(lo, hi), jnp.arange(kend), *masking)
    if is_segments(key_mask):  # (bb, 1, 1, s): the queries' ids against the keys'
        return keep & (jnp.swapaxes(key_mask, -1, -2)[..., lo:hi, :] == key_mask[..., :kend])
    return keep if key_mask is None else keep & key_mask[..., :kend]


def _scores(q, k, keep, scale):
    return jnp.where(keep, (q @ jnp.swapaxes(k, -1, -2)) * scale, jnp.finfo(jnp.float32).min)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _attention(q, k, v, key_mask, masking, scale, ways, blocks):
    return _attention_fwd(q, k, v, key_mask, masking, scale, ways, blocks)[0]


def _attention_fwd(q, k, v, key_mask, masking, scale, ways, blocks):
    shape = q.shape

    def block(xs):
        mask = xs[3]
        q, k, v = (_block_shaped(t, shape, blocks) for t in xs[:3])
        parts = []
        for lo, hi, kend in _tiles(q.shape[-2], masking, mask):
            s = _scores(
                q[..., lo:hi, :], k[..., :kend, :], _keep(lo, hi, kend, masking, mask), scale
            )
            row_max = s.max(-1, keepdims=True)
            e = jnp.exp(s - row_max)
            inv_sum = 1 / e.sum(-1, keepdims=True)
            # normalised on (q, d)
            parts.append(((e @ v[..., :kend, :]) * inv_sum, row_max, inv_sum))
        out, row_max, inv_sum = (jnp.concatenate(t, axis=-2) for t in zip(*parts))
        # no axis of 1 (`_to_blocks`)
        return _pairs(out), _pairs(row_max[..., 0]), _pairs(inv_sum[..., 0])

    split = functools.partial(_to_blocks, ways=ways, blocks=blocks)
    out, row_max, inv_sum = jax.lax.map(
        block, (split(q), split(k), split(v), _mask_blocks(key_mask, ways, blocks))
    )
    out = _from_blocks(out, ways, blocks, shape)
    return out, (q, k, v, out, key_mask, row_max, inv_sum)


def _attention_bwd(masking, scale, ways, blocks, residuals, g):
    q, k, v, out, key_mask, row_max, inv_sum = residuals
    shape = q.shape

    def block(xs):
        mask = xs[5]
        q, k, v, out, g = (_block_shaped(t, shape, blocks) for t in xs[:5])
        row_max, inv_sum = (_block_shaped(t, shape, blocks)[..., None] for t in xs[6:])
        dq, dk, dv = [], jnp.zeros_like(k), jnp.zeros_like(v)
        for lo, hi, kend in _tiles(q.shape[-2], masking, mask):
            keep = _keep(lo, hi, kend, masking, mask)
            qt, gt, kt, vt = q[..., lo:hi, :], g[..., lo:hi, :], k[..., :kend, :], v[..., :kend, :]
            p = (
                jnp.exp(_scores(qt, kt, keep, scale) - row_max[..., lo:hi, :])
                * inv_sum[..., lo:hi, :]
            )
            # sum_k p dp over a row is sum_d out g: on (q, d), where XLA:CPU would fuse a (q, k)
            # reduction into the dp matmul and run both at a third of the matmul rate.
            delta = (gt * out[..., lo:hi, :]).sum(-1, keepdims=True)
            ds = jnp.where(keep, p * (gt @ jnp.swapaxes(vt, -1, -2) - delta), 0.0) * scale
            dq.append(ds @ kt)
            dk = dk.at[..., :kend, :].add(rows_contracted(ds, qt))
            dv = dv.at[..., :kend, :].add(rows_contracted(p, gt))
        return _pairs(jnp.concatenate(dq, axis=-2)), _pairs(dk), _pairs(dv)

    split = functools.partial(_to_blocks, ways=ways, blocks=blocks)
    grads = jax.lax.map(
        block,
        (
            split(q),
            split(k),
            split(v),
            split(out),
            split(g),
            _mask_blocks(key_mask, ways, blocks),
            row_max,
            inv_sum,
        ),
    )
    dq, dk, dv = (_from_blocks(t, ways, blocks, shape) for t in grads)
    return dq, dk, dv, None if key_mask is None else zero_cotangent(key_mask)


_attention.defvjp(_attention_fwd, _attention_bwd)
