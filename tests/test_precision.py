"""model.compute_dtype = "mixed": bfloat16 matmul operands, float32 accumulation and activations."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import mesh_for, tiny_config
from tolerances import BF16_ELEMENT, BF16_NORM, BF16_U, F32_U, assert_close, assert_tree_close

from megajax.core.precision import logits_product, matmul
from megajax.tools.audit import audit
from megajax.training.step import make_trainer


def _bf16(a):
    """float64 copy of `a` rounded to bfloat16: the operands the mixed matmul multiplies."""
    return np.asarray(a, np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)


@pytest.mark.parametrize("stacked_residuals", [False, True], ids=["unrolled_vjp", "scanned_vjp"])
def test_mixed_matmul_and_its_gradients_match_a_float64_reference(stacked_residuals):
    """Both VJPs: x^T g for layers of their own, (g^T x)^T for a scanned stack's body."""
    kx, kw, kg = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (3, 40, 48))
    w = jax.random.normal(kw, (48, 56)) * 0.1
    g = jax.random.normal(kg, (3, 40, 56))

    y, vjp = jax.vjp(lambda x, w: matmul(x, w, jnp.bfloat16, stacked_residuals), x, w)
    dx, dw = vjp(g)
    assert y.dtype == dx.dtype == dw.dtype == jnp.float32

    x2, g2 = np.asarray(x).reshape(-1, 48), np.asarray(g).reshape(-1, 56)
    want_y = _bf16(x2) @ _bf16(w)
    want_dx = _bf16(g2) @ _bf16(w).T  # the incoming gradient is rounded too
    want_dw = _bf16(x2).T @ _bf16(g2)
    # The operands are exact in float32, so only float32 accumulation differs from float64:
    # within gamma_K = K u_f32 of the sum of the products' magnitudes (tests/tolerances.py).
    for (got, want), (a, b) in zip(
        ((y, want_y), (dx, want_dx), (dw, want_dw)), ((x2, w), (g2, np.asarray(w).T), (x2.T, g2))
    ):
        got = np.asarray(got).reshape(want.shape)
        k = np.shape(a)[-1]
        bound = k * F32_U * (np.abs(_bf16(a)) @ np.abs(_bf16(b)))
        assert (np.abs(got - want) <= bound).all()
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


def _lowered_bf16_dots(text: str) -> int:
    """Matmuls with two bfloat16 operands in the program handed to XLA (StableHLO)."""
    return len(re.findall(r"dot_general .*: \(tensor<[^>]*bf16>, tensor<[^>]*bf16>\)", text))


def _cpu_keeps_bf16_matmuls() -> bool:
    """Whether this CPU's XLA keeps a plain row-major bf16 x bf16 -> f32 matmul in bfloat16:
    it does where its matmul library takes bfloat16 (AVX512-BF16, AMX); elsewhere XLA runs
    every bfloat16 matmul in float32, and there is no fast path to lose."""
    a = jax.ShapeDtypeStruct((64, 64), jnp.bfloat16)
    f = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
    return _bf16_dots(f.lower(a, a).compile().as_text()) == 1


@pytest.mark.full
def test_every_linear_matmul_runs_in_bfloat16_forward_and_backward():
    """QKV, output projection, fc1 and fc2 of every layer, each 3 times (y = xW, dx = g W^T,
    dW = x^T g), as bf16 x bf16 matmuls: in the program megajax hands XLA, and, on a CPU whose
    XLA runs bfloat16 matmuls natively, still in the compiled step (XLA would otherwise
    quietly run the backward ones in float32)."""
    layers = 2
    cfg = tiny_config(num_layers=layers, compute_dtype="mixed", scan_layers=False)
    lowered = make_trainer(cfg, mesh_for("1x1")).lower_step()
    assert _lowered_bf16_dots(lowered.as_text()) == 4 * 3 * layers
    if _cpu_keeps_bf16_matmuls():
        assert _bf16_dots(lowered.compile().as_text()) == 4 * 3 * layers
    float32 = make_trainer(
        tiny_config(num_layers=layers, scan_layers=False), mesh_for("1x1")
    ).lower_step()
    assert (
        _lowered_bf16_dots(float32.as_text()) == 0 and _bf16_dots(float32.compile().as_text()) == 0
    )
    # The scanned stack (the paper configs') has one layer body, whose 12 matmuls stay bf16 too.
    scanned = make_trainer(
        tiny_config(num_layers=layers, compute_dtype="mixed"), mesh_for("1x1")
    ).lower_step()
    assert _lowered_bf16_dots(scanned.as_text()) == 4 * 3
    if _cpu_keeps_bf16_matmuls():
        assert _bf16_dots(scanned.compile().as_text()) == 4 * 3


def test_mixed_precision_is_mesh_invariant_with_megatron_collectives():
    cfg = tiny_config(compute_dtype="mixed", hidden_dropout=0.0, attention_dropout=0.0)
    tokens = np.asarray(
        jax.random.randint(jax.random.key(7), (8, cfg.model.seq_len + 1), 0, cfg.model.vocab_size)
    )
    # Sequence parallelism runs the linear layers inside shard_map, where the weight gradient
    # of the mixed matmul's own VJP must be summed over "data" as a plain dot's is.
    sp = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, sequence_parallel=True))
    results = {}
    for name, run_cfg, spec in (("1x1", cfg, "1x1"), ("2x4", cfg, "2x4"), ("2x4 SP", sp, "2x4")):
        trainer = make_trainer(run_cfg, mesh_for(spec))
        params, _ = trainer.init_state(seed=0)
        batch = jax.device_put(tokens, trainer.batch_sharding)
        results[name] = jax.device_get(
            jax.jit(jax.value_and_grad(trainer.loss_fn))(params, batch, None)
        )
    loss1, g1 = results["1x1"]
    for name in ("2x4", "2x4 SP"):
        # The mesh changes float32 partial sums, which can flip bfloat16 roundings downstream:
        # agreement to bfloat16's precision, not float32's (tests/tolerances.py).
        loss8, g8 = results[name]
        assert_close(loss8, loss1, BF16_NORM, what=f"loss on {name}")
        assert_tree_close(g1, g8, BF16_ELEMENT, f"gradient on {name}", norm_tol=BF16_NORM)
    # The float32 model's loss differs by the bf16 rounding (within a few bf16 units of
    # roundoff): mixed is really in effect.
    f32 = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, compute_dtype="float32"))
    trainer = make_trainer(f32, mesh_for("1x1"))
    params, _ = trainer.init_state(seed=0)
    loss32 = float(
        jax.jit(trainer.loss_fn)(params, jax.device_put(tokens, trainer.batch_sharding), None)
    )
    assert loss32 != loss1 and loss32 == pytest.approx(float(loss1), rel=4 * BF16_U)

    counts = audit(cfg, mesh_for("2x4")).model_axis_layer_counts()
    assert all(
        c
        == {
            ("attention", "forward"): 1,
            ("mlp", "forward"): 1,
            ("attention", "backward"): 1,
            ("mlp", "backward"): 1,
        }
        for c in counts.values()
    )


def _widened_slice_writes(hlo: str) -> list[str]:
    """dynamic-update-slices whose buffer operand is a convert: XLA widened a 16-bit buffer to
    write one slice into it, which rewrites the whole buffer, not the slice, each time."""
    converts = set(re.findall(r"%([\w.\-]+) = \S+ convert\(", hlo))
    return [
        m.group(0)
        for m in re.finditer(r"dynamic-update-slice\(%([\w.\-]+)", hlo)
        if m.group(1) in converts
    ]


def test_scanned_stack_writes_its_saved_bfloat16_activations_in_place():
    """A scanned stack's forward pass writes what each layer saves for the backward pass into
    one (layers, ...) buffer. XLA:CPU widens a bfloat16 dynamic-update-slice to float32, which
    turns that one-slice write into a rewrite of the whole buffer at every layer (time
    quadratic in depth: 1.52x the unrolled step at 24 layers, against 1.11x written in place).
    The mixed matmul saves its bfloat16 operand as uint16 bits instead."""
    lowered = make_trainer(
        tiny_config(num_layers=3, compute_dtype="mixed"), mesh_for("1x1")
    ).lower_step()
    hlo = lowered.compile().as_text()
    assert "dynamic-update-slice" in hlo and _widened_slice_writes(hlo) == []
    assert re.search(r"u16\[3,\d+,\d+\]\S* \S*dynamic-update-slice", hlo)  # the saves, as bits


def test_a_scanned_bfloat16_stack_keeps_no_16_bit_copy_of_its_weights():
    """bfloat16 matmuls of float32 weights: autodiff would keep each layer's bf16 weight for the
    backward pass, and the scan would stack them (2 bytes a parameter, zero-filled, written and
    read back every step). The backward pass casts the float32 weight, the scan's own input,
    again instead. Checked on the compiled step's loops; the float32 weights are there (rows of
    8 x 16 = 128 tokens: no activation has a weight's shape)."""
    cfg = tiny_config(num_layers=3, compute_dtype="bfloat16", scan_layers=True, remat="none")
    hlo = make_trainer(cfg, mesh_for("1x1")).lower_step().compile().as_text()
    loops = " ".join(re.findall(r"= \(.*\) while\(", hlo))
    shapes = ("3,64,192", "3,64,64", "3,64,256", "3,256,64")
    assert all(f"f32[{s}]" in loops for s in shapes)
    assert not [s for s in shapes if f"bf16[{s}]" in loops]


@pytest.mark.parametrize("x_dtype", [jnp.float32, jnp.bfloat16])
def test_logits_product_and_its_gradients_match_a_float64_reference(x_dtype):
    """The tied output layer's x E^T: bf16 operands, float32 logits; its backward pass rounds
    the logits' gradient to bf16 (Megatron's half-precision logits) and accumulates in float32."""
    kx, kt, kg = jax.random.split(jax.random.key(1), 3)
    x = jax.random.normal(kx, (2, 20, 48)).astype(x_dtype)
    table = jax.random.normal(kt, (64, 48)) * 0.1
    g = jax.random.normal(kg, (2, 20, 64))
    y, vjp = jax.vjp(lambda x, t: logits_product(x, t, jnp.bfloat16), x, table)
    dx, dtable = vjp(g)
    assert (y.dtype, dx.dtype, dtable.dtype) == (jnp.float32, x_dtype, jnp.float32)

    x2, g2, t = (
        np.asarray(x, np.float32).reshape(-1, 48),
        np.asarray(g).reshape(-1, 64),
        np.asarray(table),
    )
    cases = [(y, _bf16(x2) @ _bf16(t).T, (x2, t.T)), (dtable, _bf16(g2).T @ _bf16(x2), (g2.T, x2))]
    if x_dtype == jnp.float32:  # a bf16 dx is rounded once more, to its own dtype
        cases.append((dx, _bf16(g2) @ _bf16(t), (g2, t)))
    else:
        assert_close(np.asarray(dx, np.float32).reshape(-1, 48), _bf16(g2) @ _bf16(t), tol=BF16_U)
    for got, want, (a, b) in cases:
        bound = a.shape[-1] * F32_U * (np.abs(_bf16(a)) @ np.abs(_bf16(b)))
        assert (np.abs(np.asarray(got).reshape(want.shape) - want) <= bound).all()


def test_a_bfloat16_model_runs_every_matmul_in_bfloat16_forward_and_backward():
    """The layers', the attention core's (q k^T and p v, with their backward passes) and the
    output layer's (x E^T, dx = g E, dE = g^T x): all bf16 x bf16. Autodiff took the float32
    gradients of the scores and of the logits into float32 matmuls (tf32 on a GPU)."""
    cfg = tiny_config(num_layers=1, compute_dtype="bfloat16", vocab_size=384)  # 384: no other dim
    text = make_trainer(cfg, mesh_for("1x1")).lower_step().as_text()
    dots = re.findall(r"dot_general .*: \((tensor<[^>]*>), (tensor<[^>]*>)\)", text)
    assert len(dots) == 4 * 3 + 2 * 3 + 3  # linear layers, attention core, output layer
    assert all(a.endswith("bf16>") and b.endswith("bf16>") for a, b in dots), dots
    assert len([d for d in dots if any(re.search(r"[<x]384x", t) for t in d)]) == 3
