"""The hand-written backward passes of megajax/core/ops.py equal autodiff of the plain formulas,
and keep only what they claim to keep."""

import jax
import jax.numpy as jnp
import numpy as np
from jax import ad_checkpoint
from jax.extend.random import threefry_2x32
from tolerances import assert_tree_close

from megajax.core.ops import (
    apply_dropout,
    attention_context,
    attention_scores,
    keep_mask,
    layer_norm,
    masked_softmax,
)

RNG = np.random.default_rng(0)


def plain_layer_norm(x, scale, bias, eps):
    mean = x.mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(
        jnp.square(x - mean).mean(-1, keepdims=True) + eps
    ) * scale + bias


def plain_masked_softmax(scores, keep):
    return jax.nn.softmax(jnp.where(keep, scores, jnp.finfo(jnp.float32).min), axis=-1)


def grads(f, *args):
    """Gradients of a random projection of f's output (every output element weighs in), compiled
    as a train step compiles them (one program, not one per operation)."""
    w = jnp.asarray(
        np.random.default_rng(1).normal(size=jax.eval_shape(f, *args).shape), jnp.float32
    )
    return jax.jit(jax.grad(lambda *a: (f(*a) * w).sum(), argnums=tuple(range(len(args)))))(*args)


def test_layer_norm_matches_autodiff():
    x = jnp.asarray(RNG.normal(2.0, 3.0, (6, 5, 32)), jnp.float32)
    scale, bias = (jnp.asarray(RNG.normal(size=32), jnp.float32) for _ in range(2))
    ours = lambda x, s, b: layer_norm(x, s, b, 1e-5)  # noqa: E731
    plain = lambda x, s, b: plain_layer_norm(x, s, b, 1e-5)  # noqa: E731
    assert_tree_close(plain(x, scale, bias), ours(x, scale, bias), what="forward")
    assert_tree_close(grads(plain, x, scale, bias), grads(ours, x, scale, bias), what="gradients")


def test_masked_softmax_matches_autodiff_and_masks():
    scores = jnp.asarray(RNG.normal(size=(2, 3, 8, 8)) * 4, jnp.float32)
    causal = jnp.tril(jnp.ones((8, 8), bool))[None, None]
    padding = jnp.asarray(RNG.random((2, 1, 1, 8)) > 0.3).at[..., 0].set(True)
    for keep in (causal, causal & padding):
        ours = lambda s: masked_softmax(s, keep, jnp.float32)  # noqa: E731
        probs = ours(scores)
        assert float(jnp.abs(jnp.where(keep, 0.0, probs)).max()) == 0.0
        assert_tree_close(plain_masked_softmax(scores, keep), probs, what="forward")
        assert_tree_close(
            grads(lambda s: plain_masked_softmax(s, keep), scores),
            grads(ours, scores),
            what="gradients",
        )


def test_dropout_matches_autodiff_and_keeps_only_the_mask():
    x = jnp.asarray(RNG.normal(size=(4, 16, 32)), jnp.bfloat16)
    keep = jnp.asarray(RNG.random((4, 16, 32)) > 0.1)
    plain = lambda x: jnp.where(keep, x.astype(jnp.float32) / 0.9, 0.0)  # noqa: E731
    ours = lambda x: apply_dropout(x, keep, 0.1).astype(jnp.float32)  # noqa: E731
    # one bfloat16 rounding of the exactly scaled value
    np.testing.assert_allclose(ours(x), plain(x), rtol=2**-8, atol=0)
    np.testing.assert_array_equal(
        grads(ours, x)[0], grads(lambda x: apply_dropout(x, keep, 0.1), x)[0]
    )
    expected = jnp.where(keep, jnp.ones_like(x, jnp.float32) / 0.9, 0.0).astype(jnp.bfloat16)
    np.testing.assert_allclose(
        jax.grad(lambda x: ours(x).sum())(x).astype(jnp.float32),
        expected.astype(jnp.float32),
        rtol=2**-8,
    )


def test_residuals_are_what_megatron_keeps(capsys):
    """LayerNorm keeps its 16-bit input and two float32 numbers per row; the softmax its 16-bit
    output and the (broadcast, not materialised) mask; dropout its boolean mask."""
    x = jnp.ones((4, 16, 32), jnp.bfloat16)
    scale = bias = jnp.ones((32,), jnp.float32)
    ad_checkpoint.print_saved_residuals(
        lambda x, s, b: layer_norm(x, s, b, 1e-5).sum(), x, scale, bias
    )
    scores = jnp.ones((4, 2, 16, 16), jnp.float32)
    keep = jnp.tril(jnp.ones((16, 16), bool))[None, None]
    ad_checkpoint.print_saved_residuals(
        lambda s: masked_softmax(s, keep, jnp.bfloat16).astype(jnp.float32).sum(), scores
    )
    ad_checkpoint.print_saved_residuals(
        lambda x: (
            apply_dropout(x, keep[0, 0][None].repeat(4, 0)[..., :16], 0.1).astype(jnp.float32).sum()
        ),
        jnp.ones((4, 16, 16), jnp.bfloat16),
    )
    shapes = sorted(
        line.split(" ")[0] for line in capsys.readouterr().out.splitlines() if "[" in line
    )
    # LayerNorm (+ scale)
    assert shapes == sorted(
        [
            "bf16[4,16,32]",
            "f32[4,16,1]",
            "f32[4,16,1]",
            "f32[32]",
            # softmax
            "bf16[4,2,16,16]",
            "bool[1,1,16,16]",
            # dropout
            "bool[4,16,16]",
        ]
    ), shapes


def test_attention_matmuls_match_autodiff_and_avoid_the_strided_dot():
    """The attention matmuls' own VJPs (XLA:CPU: the query-axis contractions as (y^T x)^T) give
    autodiff's gradients, and no dot in the compiled backward contracts its left operand over
    its rows, the form XLA:CPU runs at a third of the matmul rate."""
    q, k, v = (jnp.asarray(RNG.normal(size=(2, 3, 24, 16)), jnp.float32) for _ in range(3))
    p = jax.nn.softmax(jnp.asarray(RNG.normal(size=(2, 3, 24, 24)), jnp.float32), axis=-1)
    plain_scores = lambda q, k: jnp.einsum("bhqd,bhkd->bhqk", q, k)  # noqa: E731
    plain_context = lambda p, v: jnp.einsum("bhqk,bhkd->bhqd", p, v)  # noqa: E731
    for ours, plain, args in (
        (attention_scores, plain_scores, (q, k)),
        (attention_context, plain_context, (p, v)),
    ):
        assert_tree_close(plain(*args), ours(*args), what="forward")
        assert_tree_close(grads(plain, *args), grads(ours, *args), what="gradients")
        # A dot whose left operand is contracted over its rows (dimension 2 of (b, h, rows, cols)):
        # autodiff's backward has one, ours has none on the CPU.
        row_dots = [
            sum(
                " dot(" in line and "lhs_contracting_dims={2}" in line
                for line in jax.jit(lambda *a, f=f: grads(f, *a))
                .lower(*args)
                .compile()
                .as_text()
                .splitlines()
            )
            for f in (plain, ours)
        ]
        assert row_dots == [1, 0] or jax.default_backend() != "cpu", row_dots


def test_bfloat16_scores_take_their_gradient_in_bfloat16():
    """16-bit q k^T: float32 scores (exact here: bf16 products summed in float32 over d = 16),
    and a backward pass on the scores' gradient rounded to bf16, as Megatron's half-precision
    scores have it: dq = bf16(g) k and dk = bf16(g)^T q, each rounded once to bf16 (1 u)."""
    import ml_dtypes
    from tolerances import BF16_U, F32, assert_close

    q, k = (jnp.asarray(RNG.normal(size=(2, 3, 24, 16)), jnp.bfloat16) for _ in range(2))
    g = jnp.asarray(RNG.normal(size=(2, 3, 24, 24)), jnp.float32)
    scores, vjp = jax.vjp(attention_scores, q, k)
    dq, dk = vjp(g)
    assert (scores.dtype, dq.dtype, dk.dtype) == (jnp.float32, jnp.bfloat16, jnp.bfloat16)
    q64, k64 = (np.asarray(t, np.float64) for t in (q, k))
    g16 = np.asarray(g).astype(ml_dtypes.bfloat16).astype(np.float64)
    assert_close(scores, np.einsum("bhqd,bhkd->bhqk", q64, k64), tol=F32)
    assert_close(dq, np.einsum("bhqk,bhkd->bhqd", g16, k64), tol=BF16_U)
    assert_close(dk, np.einsum("bhqk,bhqd->bhkd", g16, q64), tol=BF16_U)


def test_dropout_mask_is_threefry_of_global_row_and_position():
    """The keep mask by hand: threefry2x32 of (global row, counter) under the key; each call's two
    words serve two neighbours along an even last axis, an odd one takes the first word only.
    Its keep rate is 1 - rate within 4.5 standard deviations."""
    key, rate = jax.random.key(5), 0.25
    words = jax.random.key_data(key).reshape(-1)
    threshold = round(rate * 2.0**32)
    for shape in ((3, 4, 6), (3, 5)):
        rows = np.arange(3, dtype=np.uint32) + 8  # a data shard's global rows
        pairs = shape[-1] % 2 == 0
        per_row = int(np.prod(shape[1:])) // (2 if pairs else 1)
        row = np.repeat(rows, per_row)
        pos = np.tile(np.arange(per_row, dtype=np.uint32), len(rows))
        out = np.asarray(threefry_2x32(words, np.concatenate([row, pos])))
        first, second = out[: row.size], out[row.size :]
        bits = np.stack([first, second], -1).reshape(shape) if pairs else first.reshape(shape)
        mask = np.asarray(keep_mask(key, shape, rate, jnp.asarray(rows)))
        np.testing.assert_array_equal(mask, bits >= threshold)
    big = np.asarray(keep_mask(key, (64, 128, 128), rate, jnp.arange(64)))
    n = big.size
    assert abs(big.mean() - (1 - rate)) < 4.5 * np.sqrt(rate * (1 - rate) / n)
