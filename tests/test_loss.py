"""The fused vocab-parallel cross-entropy against optax on the gathered logits."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import mesh_for
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from tolerances import assert_close

from megajax.core.loss import vocab_parallel_cross_entropy, vocab_parallel_lookup
from megajax.core.sharding import Layout

VOCAB, PADDED = 1000, 1024


@pytest.mark.parametrize("spec", ["1x1", "2x4", "1x8"])
def test_matches_optax_value_and_gradient(spec):
    mesh = mesh_for(spec)
    layout = Layout(mesh)
    k1, k2 = jax.random.split(jax.random.key(0))
    logits = 4.0 * jax.random.normal(k1, (8, 12, PADDED), jnp.float32)
    targets = jax.random.randint(k2, (8, 12), 0, VOCAB)
    logits_s = jax.device_put(logits, NamedSharding(mesh, P("data", None, "model")))
    targets_s = jax.device_put(targets, NamedSharding(mesh, P("data", None)))

    def ours(lg):
        return vocab_parallel_cross_entropy(lg, targets_s, layout, VOCAB).mean()

    def reference(lg):  # optax on the unpadded vocabulary
        return optax.softmax_cross_entropy_with_integer_labels(lg[..., :VOCAB], targets).mean()

    v, g = jax.jit(jax.value_and_grad(ours))(logits_s)
    v_ref, g_ref = jax.value_and_grad(reference)(logits)
    assert_close(v, v_ref)  # float32: within F32 of the scale (tests/tolerances.py)
    assert_close(g, g_ref)
    assert np.all(np.asarray(g)[..., VOCAB:] == 0)  # padding columns get no gradient


def test_per_token_values_and_no_logits_all_gather():
    mesh = mesh_for("2x4")
    layout = Layout(mesh)
    logits = jax.random.normal(jax.random.key(1), (4, 6, PADDED)) * 10
    targets = jnp.arange(24).reshape(4, 6) * 41 % VOCAB
    fn = jax.jit(
        lambda lg, t: vocab_parallel_cross_entropy(lg, t, layout, VOCAB),
        in_shardings=(
            NamedSharding(mesh, P("data", None, "model")),
            NamedSharding(mesh, P("data", None)),
        ),
    )
    got = fn(logits, targets)
    ref = optax.softmax_cross_entropy_with_integer_labels(logits[..., :VOCAB], targets)
    assert_close(got, ref)
    hlo = fn.lower(logits, targets).compile().as_text()
    assert "all-gather" not in hlo and "all-to-all" not in hlo
    # Only (batch/data, seq) = (2, 6) arrays are all-reduced, never vocab-sized ones.
    import re

    shapes = re.findall(r"= (f32\[[\d,]*\])\S* all-reduce\(", hlo)
    assert shapes and set(shapes) == {"f32[2,6]"}


def test_vocab_parallel_lookup_equals_take():
    mesh = mesh_for("2x4")
    table = jax.random.normal(jax.random.key(2), (PADDED, 16))
    ids = jax.random.randint(jax.random.key(3), (4, 10), 0, PADDED)
    got = jax.jit(
        lambda t, i: vocab_parallel_lookup(t, i, Layout(mesh)),
        in_shardings=(NamedSharding(mesh, P("model", None)), NamedSharding(mesh, P("data", None))),
    )(table, ids)
    np.testing.assert_array_equal(got, jnp.take(table, ids, axis=0))
