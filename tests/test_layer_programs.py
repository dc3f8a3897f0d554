"""train.layer_programs: the step as one compiled program per layer gives the single-program
step's result, keeps the four all-reduces per layer, and refuses what it does not support."""

import dataclasses

import jax
import numpy as np
import pytest
from conftest import mesh_for, tiny_config
from helpers import tiered
from tolerances import F16_U, F32, adam_tolerance, assert_tree_close

from megajax.config import ConfigError
from megajax.mesh_shape import MeshShape
from megajax.tools.hlo import parse_collectives
from megajax.training.layer_programs import LayerProgramStep
from megajax.training.step import make_trainer


def _programs(cfg):
    return dataclasses.replace(
        cfg, train=dataclasses.replace(cfg.train, layer_programs=True)
    ).validate()


def _two_steps(cfg, mesh, step_fn_of):
    """Two optimizer steps from the same start: (params, optimizer state, metrics of each, the
    first step's gradients)."""
    tr = make_trainer(cfg, mesh)
    params, opt = tr.init_state(seed=0)
    step = step_fn_of(tr)
    rng = np.random.default_rng(0)
    metrics, grads = [], None
    for i in range(2):
        batch = jax.device_put(
            tr.task.synthetic_batch(cfg, cfg.train.batch_size, rng), tr.batch_sharding
        )
        if grads is None:
            grads = jax.device_get(
                jax.jit(tr.gradients)(params, batch, tr.step_key(i), tr.loss_scale(opt))[1]
            )
        params, opt, m = step(params, opt, batch, np.int32(i))
        metrics.append(jax.device_get(m))
    return jax.device_get(params), jax.device_get(opt), metrics, grads


def assert_params_close(want, got, grads, lr: float, steps: int):
    """Parameters after `steps` Adam updates from gradients equal within F32: per entry within
    Adam's amplification of the gradient's error (tolerances.adam_tolerance; an entry whose
    gradient is zero up to rounding, as the key bias's, moves by up to 2 lr a step) plus F32
    of the array's scale."""
    scale = max(float(np.abs(g).max()) for g in jax.tree.leaves(grads))
    flat = jax.tree_util.tree_flatten_with_path(want)[0]
    for (path, w), g, x in zip(flat, jax.tree.leaves(grads), jax.tree.leaves(got)):
        bound = adam_tolerance(g, scale, lr, steps) + F32 * np.abs(w).max()
        err = np.abs(np.asarray(x, np.float64) - np.asarray(w, np.float64))
        assert (err <= bound).all(), f"params {jax.tree_util.keystr(path)}: {err.max()}"


@pytest.mark.parametrize(
    "kind, mesh, model",
    tiered(
        [
            ("gpt", "1x1", {}),
            # tensor and data parallel, microbatches, dropout
            ("gpt", "2x4", {}),
            ("gpt", "1x4", {"remat": "full", "sequence_parallel": True}),
            # the stack's padding mask and BERT's heads
            ("bert", "2x2", {"remat": "selective"}),
            ("gpt", "2x2", {"compute_dtype": "float16"}),  # the loss scale reaches the programs
        ],
        ("gpt", "2x4", {}),
    ),
)
def test_layer_programs_give_the_single_program_step(kind, mesh, model):
    cfg = tiny_config(kind=kind, num_layers=3, **model)
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, microbatches=2)).validate()
    m = mesh_for(mesh)
    want = _two_steps(cfg, m, lambda tr: tr.jit_step(donate=False))
    got = _two_steps(_programs(cfg), m, lambda tr: tr.compiled_step())
    assert isinstance(make_trainer(_programs(cfg), m).compiled_step(), LayerProgramStep)
    metric_tol = F32
    if model.get("compute_dtype") == "float16":
        # The same float16 operations in other programs: a float32 rounding difference may flip
        # a float16 rounding (one unit of an operand), which Adam can turn into up to 2 lr per
        # entry and step (tolerances.adam_tolerance's cap); the metrics stay within 4 units.
        for w, g in zip(jax.tree.leaves(want[0]), jax.tree.leaves(got[0])):
            np.testing.assert_allclose(g, w, rtol=0, atol=2 * 2 * cfg.train.lr)
        metric_tol = 4 * F16_U  # grad_norm and loss_scale catch a loss scale left out
    else:
        assert_params_close(want[0], got[0], want[3], cfg.train.lr, steps=2)
        assert_tree_close(want[1], got[1], F32, what="optimizer state")
    for w, g in zip(want[2], got[2]):
        assert set(w) == set(g)
        for k in w:
            np.testing.assert_allclose(g[k], w[k], rtol=metric_tol, atol=0, err_msg=k)
    assert want[2][1]["loss"] != want[2][0]["loss"]  # the second step saw the first's update


def _model_axis(hlo: str, mesh_shape) -> list:
    return [(c.kind, c.count) for c in parse_collectives(hlo, mesh_shape) if c.axis == "model"]


def test_each_layer_program_holds_two_of_the_four_all_reduces():
    """The paper's f and g per layer: the forward program all-reduces after attention and after
    the MLP, the backward program before each (the transposes of g and f); nothing else over
    "model"."""
    cfg = _programs(tiny_config(num_layers=2, hidden_dropout=0.0, attention_dropout=0.0))
    mesh = mesh_for("1x4")
    step = make_trainer(cfg, mesh).compiled_step()
    tr = step.tr
    params, _ = tr.init_state(seed=0)
    batch = jax.device_put(
        tr.task.synthetic_batch(cfg, 8, np.random.default_rng(0)), tr.batch_sharding
    )
    x, aux, _ = step._pre(params, batch, np.int32(0), np.int32(0))
    fwd_hlo = step._forward.lower(params, np.int32(0), x, aux).compile().as_text()
    _, pullback = step._forward(params, np.int32(0), x, aux)
    grads = step._zeros(params)[1]
    bwd_hlo = step._backward.lower(params, pullback, grads, np.int32(0), x).compile().as_text()
    # the forward program keeps no copy of the layer's weights: the backward slices them again
    layer_weight_shapes = {w.shape[1:] for w in jax.tree.leaves(params["layers"]["stacked"])}
    assert (
        jax.tree.leaves(pullback)
        and not {a.shape for a in jax.tree.leaves(pullback)} & layer_weight_shapes
    )
    assert _model_axis(fwd_hlo, MeshShape(model=4)) == [("all-reduce", 1)] * 2
    assert _model_axis(bwd_hlo, MeshShape(model=4)) == [("all-reduce", 1)] * 2


def test_layer_programs_refuse_what_they_do_not_run():
    base = tiny_config()
    with pytest.raises(ConfigError, match="model.scan_layers = true"):
        _programs(tiny_config(scan_layers=False))
    for key in ("shard_optimizer", "shard_params"):
        cfg = dataclasses.replace(base, train=dataclasses.replace(base.train, **{key: True}))
        with pytest.raises(ConfigError, match="plain data parallelism"):
            _programs(cfg)
