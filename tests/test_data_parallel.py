"""ZeRO-1 (`train.shard_optimizer`) and FSDP (`train.shard_params`) compute what plain data
parallelism computes, with the data-axis collectives the audit says, and their states are
1/N as large and interchangeable with plain ones through checkpoints."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import mesh_for, tiny_config
from helpers import tiered
from tolerances import F32, adam_tolerance, assert_close

from megajax.runs.checkpoint import Checkpoints
from megajax.tools.audit import audit
from megajax.training.memory import per_device_bytes
from megajax.training.step import make_trainer

MODES = ("plain", "shard_optimizer", "shard_params")
KEY = jax.random.key(3)
TOKENS = np.asarray(jax.random.randint(jax.random.key(7), (16, 17), 0, 100))


def config(mode: str = "plain", microbatches: int = 1, **model):
    cfg = tiny_config(**model)  # dropout on (0.1 hidden and attention)
    return dataclasses.replace(
        cfg,
        train=dataclasses.replace(
            cfg.train,
            batch_size=16,
            microbatches=microbatches,
            shard_optimizer=mode == "shard_optimizer",
            shard_params=mode == "shard_params",
        ),
    ).validate()


def run(spec: str, microbatches: int, mode: str):
    """Losses, gradient norms and parameters of three steps, and the states' specs."""
    trainer = make_trainer(config(mode, microbatches), mesh_for(spec))
    p, o = trainer.init_state(seed=0)
    tokens = jax.device_put(TOKENS, trainer.batch_sharding)
    out = dict(param_specs=[x.sharding.spec for x in jax.tree.leaves(p)])
    if mode == "plain":  # the first step's gradients: the scale of Adam's per-entry bound
        out["grads"] = jax.device_get(jax.jit(trainer.gradients)(p, tokens, KEY)[1])
    step, losses, norms = trainer.jit_step(), [], []
    for i in range(3):
        p, o, m = step(p, o, tokens, jnp.int32(i))
        losses.append(float(m["loss"]))
        norms.append(float(m["grad_norm"]))
    return dict(
        out,
        losses=losses,
        norms=norms,
        final=jax.device_get(p),
        opt_specs=[x.sharding.spec for x in jax.tree.leaves(o)],
    )


@pytest.mark.parametrize(
    "spec,microbatches", tiered([("2x4", 2), ("4x2", 4), ("8x1", 2)], ("2x4", 2))
)
def test_sharded_data_parallel_matches_plain(spec, microbatches):
    """Both schemes, gradient accumulation and dropout on; float32 throughout, so losses and
    gradient norms within F32 of their scale (tests/tolerances.py), parameters within Adam's
    per-entry bound. (Gradients themselves: tests/test_bert.py.)"""
    ref = run(spec, microbatches, "plain")
    for mode in MODES[1:]:
        got = run(spec, microbatches, mode)
        assert_close(got["losses"], ref["losses"], what=f"{mode}: losses of 3 steps")
        assert_close(got["norms"], ref["norms"], what=f"{mode}: gradient norms of 3 steps")
        for (path, x), y in zip(
            jax.tree_util.tree_flatten_with_path(ref["final"])[0], jax.tree.leaves(got["final"])
        ):
            g = np.asarray(functools.reduce(lambda t, k: t[k.key], path, ref["grads"]))
            bound = adam_tolerance(g, np.abs(g).max(), 1e-2, steps=3) + F32 * np.abs(x).max()
            assert (np.abs(y - x) <= bound).all(), f"{mode} {jax.tree_util.keystr(path)}"
        # The states really are split over "data": the optimizer moments (ZeRO), parameters (FSDP).
        assert sum("data" in str(s) for s in got["opt_specs"]) >= 2 * len(got["param_specs"]) - 4
        assert any("data" in str(s) for s in got["param_specs"]) == (mode == "shard_params")


def _data(r, **kw):
    return r.select(axis="data", **kw)


@pytest.mark.parametrize(
    "spec,microbatches", tiered([("2x4", (1, 2)), ("8x1", (2,))], ("2x4", (1, 2)))
)
def test_zero_reduces_gradients_once_per_step(spec, microbatches):
    """One reduce-scatter per gradient and one all-gather per parameter, whatever the number of
    microbatches: exactly the bytes of one all-reduce (ratio 1.000); no gradient all-reduce
    remains, and the model axis keeps Megatron's collectives exactly."""
    results = {m: audit(config("shard_optimizer", m), mesh_for(spec)) for m in microbatches}
    n_params = len(
        jax.tree.leaves(make_trainer(config(), mesh_for(spec)).modeldef.abstract_params())
    )
    for m, r in results.items():
        assert not _data(r, origin="gradients", kind="all-reduce")
        scatters, gathers = (
            _data(r, origin="gradients", kind="reduce-scatter"),
            _data(r, origin="params"),
        )
        assert len(scatters) == len(gathers) == n_params and all(
            c.count == 1 for c in scatters + gathers
        )
        assert {c.kind for c in gathers} == {"all-gather"}
        assert r.data_scheme == "zero" and r.data_axis_ratio == pytest.approx(1.0, abs=1e-9)
        _model_axis_as_megatron(r)
        # Nothing else crosses "data" but scalars (the loss normaliser, metrics, the grad norm).
        assert all(c.shape == () for c in _data(r) if c.origin not in ("gradients", "params")), m
    if len(results) == 2:
        assert results[1].data_axis_sent("gradients") == results[2].data_axis_sent("gradients")
    assert "1.000 x the minimum" in results[microbatches[-1]].table()


@pytest.mark.parametrize("spec,microbatches", tiered([("2x4", 2), ("8x1", 1)], ("2x4", 2)))
def test_fsdp_gathers_each_layer_forward_and_backward(spec, microbatches):
    """Inside the scanned stack, per layer and microbatch: one all-gather of each split weight
    forward, one again in the backward pass for those it reads (kernels and LayerNorm scales),
    one reduce-scatter of each gradient; counted by the scan's trip count."""
    cfg = config("shard_params", microbatches)
    r = audit(cfg, mesh_for(spec))
    trainer = make_trainer(cfg, mesh_for(spec))
    dims = jax.tree_util.tree_flatten_with_path(trainer.data_parallel.dims)[0]
    layer = [(jax.tree_util.keystr(p), d) for p, d in dims if p[0].key == "layers" and d >= 0]
    read = [p for p, _ in layer if p.endswith("['kernel']") or p.endswith("['scale']")]
    per_step = cfg.model.num_layers * microbatches
    fwd = _data(r, origin="params", layer="all", direction="forward")
    bwd = _data(r, origin="params", layer="all", direction="recompute")
    rs = _data(r, origin="gradients", layer="all", kind="reduce-scatter")
    assert len(fwd) == len(rs) == len(layer) and len(bwd) == len(read)
    assert all(c.count == per_step for c in fwd + bwd + rs)
    assert {c.kind for c in fwd + bwd} == {"all-gather"}
    assert r.data_axis_regathered == round(r.data_axis_minimum["regather"])
    assert r.data_scheme == "fsdp" and r.data_axis_ratio == pytest.approx(1.0, abs=1e-9)
    _model_axis_as_megatron(r)


def _model_axis_as_megatron(r):
    """The model axis exactly as without ZeRO / FSDP (tests/test_audit.py); nothing on a 1-wide
    one."""
    if r.mesh.model == 1:
        assert not r.select(axis="model")
    else:
        assert r.ratio == pytest.approx(1.0, abs=0.005) and "forward [2], backward [2]" in r.table()


@pytest.mark.parametrize("spec", ["2x4", "8x1"])
def test_sharded_states_are_one_nth(spec):
    """Per-device optimizer state with ZeRO on an N-way data axis, and parameters too with
    FSDP, at most 1/N + 2% of plain data parallelism's."""
    mesh = mesh_for(spec)
    n = mesh.shape["data"]
    sizes = {
        mode: [per_device_bytes(x) for x in make_trainer(config(mode), mesh).abstract_state()]
        for mode in MODES
    }
    (params, opt) = sizes["plain"]
    assert (
        sizes["shard_optimizer"][0] == params
        and sizes["shard_optimizer"][1] <= (1 / n + 0.02) * opt
    )
    assert (
        sizes["shard_params"][0] <= (1 / n + 0.02) * params
        and sizes["shard_params"][1] <= (1 / n + 0.02) * opt
    )


@pytest.mark.full
def test_checkpoints_move_between_modes_and_meshes(tmp_path):
    """A state saved by any mode on one mesh restores bitwise into any other mode and mesh."""
    saved = {}
    for mode, spec in (("shard_params", "2x4"), ("plain", "4x2")):
        trainer = make_trainer(config(mode, 2), mesh_for(spec))
        p, o = trainer.init_state(seed=0)
        p, o, _ = trainer.jit_step()(
            p, o, jax.device_put(TOKENS, trainer.batch_sharding), jnp.int32(0)
        )
        ckpt = Checkpoints(tmp_path / mode, async_save=False)
        assert ckpt.save(1, p, o, {"step": 1}) is None
        ckpt.close()
        saved[mode] = jax.device_get((p, o))
    for source, (mode, spec) in (
        ("shard_params", ("plain", "1x8")),
        ("shard_params", ("shard_optimizer", "4x2")),
        ("plain", ("shard_params", "8x1")),
        ("plain", ("shard_optimizer", "2x4")),
    ):
        trainer = make_trainer(config(mode, 2), mesh_for(spec))
        ckpt = Checkpoints(tmp_path / source, async_save=False)
        p, o, _ = ckpt.restore(1, *trainer.abstract_state())
        ckpt.close()
        for want, got in zip(
            jax.tree.leaves(saved[source]), jax.tree.leaves(jax.device_get((p, o)))
        ):
            np.testing.assert_array_equal(got, want)
        shardings = jax.tree.leaves(trainer.abstract_state())
        assert [x.sharding for x in jax.tree.leaves((p, o))] == [x.sharding for x in shardings]
