"""Every mesh computes what one device computes: weights, logits, loss, gradients and
optimizer steps, with dropout on (the masks must not depend on the mesh)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import mesh_for, tiny_config
from flax import nnx
from helpers import tiered
from tolerances import F32, adam_tolerance, assert_close, assert_tree_close

from megajax.models.registry import init_model
from megajax.training.step import make_trainer

# Every (data, model) factorisation of the 8 devices: pure data, pure model, and both mixes.
MESHES = ["2x4", "4x2", "1x8", "8x1"]
CFG = tiny_config()
TOKENS = np.asarray(
    jax.random.randint(jax.random.key(7), (8, CFG.model.seq_len + 1), 0, CFG.model.vocab_size)
)
KEY = jax.random.key(3)


def run(mesh, cfg=CFG):
    """Weights, logits, loss and gradients (dropout on), and three optimizer steps on `mesh`."""
    trainer = make_trainer(cfg, mesh)
    md = trainer.modeldef
    p, o = trainer.init_state(seed=0)  # init_model's weights, in this mesh's shardings
    params = jax.tree.map(lambda x: x.copy(), p)  # the step below donates p
    tokens = jax.device_put(TOKENS, trainer.batch_sharding)

    @jax.jit
    def fwd_bwd(params, tokens):
        logits = md.bind(params)(tokens[:, :-1], key=KEY)
        loss, grads = jax.value_and_grad(trainer.loss_fn)(params, tokens, KEY)
        return logits, loss, grads

    logits, loss, grads = jax.device_get(fwd_bwd(params, tokens))
    step = trainer.jit_step()
    losses = []
    for i in range(3):
        p, o, m = step(p, o, tokens, jnp.int32(i))
        losses.append(float(m["loss"]))
    return dict(
        params=jax.device_get(params),
        logits=logits,
        loss=float(loss),
        grads=grads,
        losses=losses,
        final=jax.device_get(p),
    )


@pytest.fixture(scope="module")
def reference():
    return run(mesh_for("1x1"))


@pytest.mark.parametrize("spec", tiered(MESHES, "2x4"))
def test_mesh_matches_single_device(reference, spec):
    assert_matches_reference(reference, run(mesh_for(spec)))


@pytest.mark.parametrize("spec", tiered(["2x4", "1x8"], "2x4"))
def test_sequence_parallel_matches_single_device(reference, spec):
    """Activations split along the sequence between blocks (all-gather / reduce-scatter around
    each block instead of all-reduces): the same numbers as one device without it, with data
    parallelism beside it and with the model axis on every device. (On 8x1 the model axis is one
    device: nothing to split.)"""
    assert_matches_reference(reference, run(mesh_for(spec), tiny_config(sequence_parallel=True)))


def assert_matches_reference(reference, got):
    # The same seed gives bit-identical global weights on every mesh.
    for x, y in zip(jax.tree.leaves(reference["params"]), jax.tree.leaves(got["params"])):
        np.testing.assert_array_equal(x, y)
    # float32 throughout: within F32 of each quantity's scale (tests/tolerances.py).
    assert_close(got["logits"], reference["logits"], what="logits")
    assert_close(got["loss"], reference["loss"], what="loss")
    assert_tree_close(reference["grads"], got["grads"], what="gradient")
    assert_close(got["losses"], reference["losses"], what="losses of 3 steps")
    # Adam normalises each gradient entry by its own size, so an entry's parameter error is
    # its gradient's relative error times lr per step (the key bias, whose gradient is exactly
    # zero since softmax ignores a per-query constant, moves by noise of up to 2 lr per step).
    for path, x in jax.tree_util.tree_flatten_with_path(reference["final"])[0]:
        g = _get(reference["grads"], path)
        bound = adam_tolerance(g, np.abs(g).max(), CFG.train.lr, steps=3) + F32 * np.abs(x).max()
        err = np.abs(_get(got["final"], path) - x)
        assert (err <= bound).all(), (
            f"params after 3 steps {jax.tree_util.keystr(path)}: {err.max()}"
        )


def _get(tree, path):
    for k in path:
        tree = tree[k.key]
    return tree


def test_dropout_is_on_and_matters(reference):
    """Guards the test above: with dropout the loss differs from the deterministic one."""
    mesh = mesh_for("1x1")
    model = init_model(CFG.model, mesh, seed=0)
    t = jnp.asarray(TOKENS)
    deterministic = np.asarray(model(t[:, :-1]))[..., : CFG.model.vocab_size]
    dropped = reference["logits"][..., : CFG.model.vocab_size]
    assert np.linalg.norm(dropped - deterministic) > 0.05 * np.linalg.norm(deterministic)
    assert reference["losses"][2] < reference["losses"][0]


@pytest.mark.full
def test_post_layernorm_is_mesh_invariant_and_differs_from_pre():
    """The original BERT placement (LayerNorm after each residual add) through the same layers."""
    cfg = tiny_config(ln_placement="post").model
    t = jnp.asarray(TOKENS[:, :-1])
    out = {}
    forward = nnx.jit(lambda model: model(t, key=KEY))
    for spec in ("1x1", "2x4"):
        out[spec] = np.asarray(forward(init_model(cfg, mesh_for(spec), seed=0)))
    assert_close(out["2x4"], out["1x1"])
    pre = np.asarray(forward(init_model(tiny_config().model, mesh_for("1x1"), seed=0)))
    assert np.abs(pre - out["1x1"]).max() > 1e-2


def test_gradient_accumulation_equals_one_big_batch():
    """4 microbatches, scanned or unrolled, average to the full-batch gradient (no dropout, so
    the batches are the same); the two accumulation orders are the same sums, bit for bit."""
    import dataclasses

    base = tiny_config(hidden_dropout=0.0, attention_dropout=0.0)
    mesh = mesh_for("2x4")
    results = []
    for micro, unroll in ((1, False), (4, False), (4, True)):
        cfg = dataclasses.replace(
            base,
            train=dataclasses.replace(
                base.train, microbatches=micro, unroll_microbatches=unroll, batch_size=16
            ),
        )
        trainer = make_trainer(cfg, mesh)
        p, o = trainer.init_state(seed=0)
        tokens = jax.device_put(np.concatenate([TOKENS, TOKENS[::-1]]), trainer.batch_sharding)
        p, o, m = trainer.jit_step()(p, o, tokens, jnp.int32(0))
        results.append((float(m["loss"]), float(m["grad_norm"]), jax.device_get(p)))
    grads = jax.device_get(
        jax.jit(jax.grad(trainer.loss_fn))(trainer.init_state(seed=0)[0], tokens, None)
    )
    for accumulated in results[1:]:
        assert_close(accumulated[0], results[0][0], what="loss")
        assert_close(accumulated[1], results[0][1], what="grad norm")
        # One Adam step moves an entry by lr * sign(g): only entries whose gradient is within
        # rounding of zero (the key bias) can differ, by up to 2 lr.
        for (path, x), y in zip(
            jax.tree_util.tree_flatten_with_path(results[0][2])[0], jax.tree.leaves(accumulated[2])
        ):
            g = _get(grads, path)
            bound = (
                adam_tolerance(g, np.abs(g).max(), base.train.lr, steps=1) + F32 * np.abs(x).max()
            )
            assert (np.abs(y - x) <= bound).all(), jax.tree_util.keystr(path)
    assert results[2][:2] == results[1][:2]


@pytest.mark.parametrize(
    "remat,scan,sp",
    tiered(
        [
            ("selective", True, False),
            ("full", True, False),
            ("selective", False, False),
            ("selective", True, True),
            ("full", False, True),
        ],
        ("selective", True, True),
    ),
)
def test_remat_recomputes_the_same_numbers(remat, scan, sp):
    """Selective (the attention core) and full (each layer) recomputation give the loss and
    every gradient of no recomputation, dropout on, on 2x4: only the backward pass's schedule
    changes. Full remat is compared scanned only, as the rest of the suite runs it unrolled."""

    def loss_and_grads(mode):
        cfg = tiny_config(remat=mode, scan_layers=scan, sequence_parallel=sp)
        trainer = make_trainer(cfg, mesh_for("2x4"))
        params, _ = trainer.init_state(seed=0)
        tokens = jax.device_put(TOKENS, trainer.batch_sharding)
        return jax.device_get(jax.jit(jax.value_and_grad(trainer.loss_fn))(params, tokens, KEY))

    (want_loss, want), (loss, got) = loss_and_grads("none"), loss_and_grads(remat)
    assert_close(loss, want_loss, what="loss")
    assert_tree_close(want, got, what=f"gradient with {remat} remat")
