"""model.compute_dtype = "mixed": bfloat16 matmul operands, float32 accumulation and activations."""
import dataclasses
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import mesh_for, tiny_config

from megajax.audit import audit
from megajax.precision import matmul
from megajax.train_step import make_trainer


def _bf16(a):
    """float64 copy of `a` rounded to bfloat16: the operands the mixed matmul multiplies."""
    return np.asarray(a, np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)


def test_mixed_matmul_and_its_gradients_match_a_float64_reference():
    kx, kw, kg = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (3, 40, 48))
    w = jax.random.normal(kw, (48, 56)) * 0.1
    g = jax.random.normal(kg, (3, 40, 56))

    y, vjp = jax.vjp(lambda x, w: matmul(x, w, jnp.bfloat16), x, w)
    dx, dw = vjp(g)
    assert y.dtype == dx.dtype == dw.dtype == jnp.float32

    x2, g2 = np.asarray(x).reshape(-1, 48), np.asarray(g).reshape(-1, 56)
    want_y = _bf16(x2) @ _bf16(w)
    want_dx = _bf16(g2) @ _bf16(w).T           # the incoming gradient is rounded too
    want_dw = _bf16(x2).T @ _bf16(g2)
    for got, want in ((y, want_y), (dx, want_dx), (dw, want_dw)):
        got = np.asarray(got).reshape(want.shape)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    # ... and they are not float32 results: rounding the operands changes them measurably.
    assert np.abs(np.asarray(y).reshape(-1, 56) - x2 @ np.asarray(w, np.float64)).max() > 1e-3


def _bf16_dots(hlo: str) -> int:
    """Matmuls in the compiled program whose two operands are bfloat16."""
    n = 0
    for m in re.finditer(r"= \S+ dot\(([^)]*)\)", hlo):
        operands = m.group(1).split(", ")
        types = [re.search(rf"%{re.escape(o.lstrip('%'))} = (\w+)\[", hlo) for o in operands]
        if all(t and t.group(1) == "bf16" for t in types):
            n += 1
    return n


def test_every_linear_matmul_runs_in_bfloat16_forward_and_backward():
    """Read from XLA:CPU's compiled step: QKV, output projection, fc1 and fc2 of every layer,
    each 3 times (y = xW, dx = g W^T, dW = x^T g), as bf16 x bf16 matmuls; XLA would
    otherwise quietly run the backward ones in float32."""
    layers = 2
    cfg = tiny_config(num_layers=layers, compute_dtype="mixed", scan_layers=False)
    hlo = make_trainer(cfg, mesh_for("1x1")).lower_step().compile().as_text()
    assert _bf16_dots(hlo) == 4 * 3 * layers
    float32 = tiny_config(num_layers=layers, scan_layers=False)
    assert _bf16_dots(make_trainer(float32, mesh_for("1x1")).lower_step().compile().as_text()) == 0


def test_mixed_precision_is_mesh_invariant_with_megatron_collectives():
    cfg = tiny_config(compute_dtype="mixed", hidden_dropout=0.0, attention_dropout=0.0)
    tokens = np.asarray(jax.random.randint(jax.random.key(7), (8, cfg.model.seq_len + 1), 0, cfg.model.vocab_size))
    results = {}
    for spec in ("1x1", "2x4"):
        trainer = make_trainer(cfg, mesh_for(spec))
        params, _ = trainer.init_state(seed=0)
        batch = jax.device_put(tokens, trainer.batch_sharding)
        results[spec] = jax.device_get(jax.jit(jax.value_and_grad(trainer.loss_fn))(params, batch, None))
    (loss1, g1), (loss8, g8) = results["1x1"], results["2x4"]
    assert loss8 == pytest.approx(loss1, rel=1e-5)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(g1)[0], jax.tree.leaves(g8)):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-4 * np.abs(a).max(), err_msg=jax.tree_util.keystr(path))
    # The float32 model's gradients differ by the bf16 rounding: mixed is really in effect.
    f32 = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, compute_dtype="float32"))
    trainer = make_trainer(f32, mesh_for("1x1"))
    params, _ = trainer.init_state(seed=0)
    loss32 = float(jax.jit(trainer.loss_fn)(params, jax.device_put(tokens, trainer.batch_sharding), None))
    assert loss32 != loss1 and loss32 == pytest.approx(float(loss1), rel=1e-2)

    counts = audit(cfg, mesh_for("2x4")).model_axis_layer_counts()
    assert all(c == {("attention", "forward"): 1, ("mlp", "forward"): 1,
                     ("attention", "backward"): 1, ("mlp", "backward"): 1} for c in counts.values())
