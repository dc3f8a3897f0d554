"""float16 activations with dynamic loss scaling (megajax/training/loss_scale.py): the scale's
rules against optax's own AdamW, why float16 needs it, and a train.py run that overflows,
skips, recovers and resumes bitwise."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import mesh_for, tiny_config
from helpers import RUN_ARGS, run
from tolerances import F16_U, F32, assert_tree_close

from megajax.config import ConfigError, load_config
from megajax.errors import UserError
from megajax.runs.checkpoint import Checkpoints
from megajax.training.logger import fatal_non_finite
from megajax.training.loss_scale import MAX_SCALE, LossScaleState, loss_scaled, uses_loss_scaling
from megajax.training.step import make_trainer


def _inner():
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2, weight_decay=0.01))


def _params():
    return {"w": jnp.arange(6.0).reshape(2, 3) / 7, "b": jnp.ones(3)}


def test_finite_gradients_update_as_adamw_and_the_scale_grows_after_its_window():
    params, tx, ref = (
        _params(),
        loss_scaled(_inner(), dynamic=True, initial=2.0**10, window=2),
        _inner(),
    )
    state, ref_state = tx.init(params), ref.init(params)
    assert float(state.scale) == 2.0**10
    for n in range(2):
        grads = jax.tree.map(lambda p: jnp.sin(p + n), params)
        updates, state = tx.update(grads, state, params)
        want, ref_state = ref.update(grads, ref_state, params)
        jax.tree.map(np.testing.assert_array_equal, updates, want)
        jax.tree.map(np.testing.assert_array_equal, state.inner, ref_state)
    assert float(state.scale) == 2.0**11 and int(state.good_steps) == 0 and int(state.skipped) == 0


def test_an_overflowed_step_changes_nothing_but_halves_the_scale():
    params, tx = _params(), loss_scaled(_inner(), dynamic=True, initial=2.0**10, window=100)
    state = tx.init(params)
    # one good step: Adam's count is 1
    _, state = tx.update(jax.tree.map(jnp.cos, params), state, params)
    for bad in (jnp.inf, jnp.nan):
        grads = {"w": jnp.zeros((2, 3)).at[1, 2].set(bad), "b": jnp.ones(3)}
        before = state
        updates, state = tx.update(grads, state, params)
        jax.tree.map(lambda u: np.testing.assert_array_equal(u, 0.0), updates)
        jax.tree.map(np.testing.assert_array_equal, state.inner, before.inner)
        assert float(state.scale) == float(before.scale) / 2 and int(state.good_steps) == 0
    assert int(state.skipped) == 2


def test_megatrons_hysteresis_tolerates_overflows_until_the_scale_grows():
    """Megatron-LM's DynamicGradScaler with hysteresis 2: the first overflow keeps the scale,
    a later one halves it even after good steps (only growth restores the tolerance), every
    one after that halves it too, and `window` good steps in a row double it."""
    params, tx = (
        _params(),
        loss_scaled(_inner(), dynamic=True, initial=2.0**10, window=3, hysteresis=2),
    )
    state, good, bad = (
        tx.init(params),
        jax.tree.map(jnp.cos, params),
        {"w": jnp.full((2, 3), jnp.inf), "b": jnp.ones(3)},
    )
    scales = []
    for grads in (bad, good, bad, bad, good, good, good, bad):
        _, state = tx.update(grads, state, params)
        scales.append(float(state.scale))
    assert scales == [2.0**10, 2.0**10, 2.0**9, 2.0**8, 2.0**8, 2.0**8, 2.0**9, 2.0**9]
    assert int(state.skipped) == 4 and int(state.tolerance) == 1


def test_the_scale_stops_growing_at_its_cap_and_waits_unused_without_float16():
    params = _params()
    tx = loss_scaled(_inner(), dynamic=True, initial=MAX_SCALE, window=1)
    _, state = tx.update(jax.tree.map(jnp.cos, params), tx.init(params), params)
    assert float(state.scale) == MAX_SCALE
    plain = loss_scaled(_inner(), dynamic=False, initial=2.0**16, window=1)
    state = plain.init(params)
    assert isinstance(state, LossScaleState) and float(state.scale) == 2.0**16  # kept, unused
    # passed on: the run's NaN check stops it
    grads = {"w": jnp.full((2, 3), jnp.nan), "b": jnp.ones(3)}
    updates, state = plain.update(grads, state, params)
    assert np.isnan(np.asarray(updates["w"])).all() and int(state.skipped) == 0


def test_an_overflow_stops_the_run_only_at_a_scale_of_one_or_a_non_finite_loss():
    inf, nan = float("inf"), float("nan")
    assert fatal_non_finite({"loss": 2.0, "grad_norm": inf, "loss_scale": 8.0}) == []  # skipped
    # diverged
    assert fatal_non_finite({"loss": 2.0, "grad_norm": nan, "loss_scale": 1.0}) != []
    # the forward pass
    assert fatal_non_finite({"loss": inf, "grad_norm": inf, "loss_scale": 8.0}) != []
    # no loss scaling
    assert fatal_non_finite({"loss": 2.0, "grad_norm": inf}) != []
    assert fatal_non_finite({"loss": 2.0, "grad_norm": 3.0, "loss_scale": 1.0}) == []


def test_only_float16_activations_scale_the_loss():
    assert uses_loss_scaling(tiny_config(compute_dtype="float16"))
    for dtype in ("float32", "bfloat16", "mixed", "auto"):  # auto is float32 on the CPU
        assert not uses_loss_scaling(tiny_config(compute_dtype=dtype))
    for bad in ("train.loss_scale=0", "train.loss_scale_window=0", "train.loss_scale=inf"):
        with pytest.raises(ConfigError, match="loss_scale"):
            load_config("tiny", [bad])


def _gradients(dtype, scales):
    """The unscaled gradients of a dropout-free tiny GPT on one device, 64 x 128 tokens, for
    each loss scale (None: not scaled), from one compiled program per kind."""
    cfg = tiny_config(compute_dtype=dtype, seq_len=128, hidden_dropout=0.0, attention_dropout=0.0)
    tr = make_trainer(cfg, mesh_for("1x1"))
    params, _ = tr.init_state(seed=0)
    batch = jax.device_put(
        tr.task.synthetic_batch(cfg, 64, np.random.default_rng(0)), tr.batch_sharding
    )
    grads = jax.jit(lambda p, b, s: tr.gradients(p, b, jax.random.key(0), s)[1])
    out = []
    for scale in scales:
        g = grads(params, batch, None if scale is None else jnp.float32(scale))
        out.append(jax.device_get(g if scale is None else jax.tree.map(lambda x: x / scale, g)))
    return out


def _relative_errors(got, want) -> dict:
    return {
        jax.tree_util.keystr(path): np.linalg.norm(np.asarray(g, np.float64) - w)
        / np.linalg.norm(w)
        for (path, w), g in zip(jax.tree_util.tree_flatten_with_path(want)[0], jax.tree.leaves(got))
    }


def test_float16_gradients_need_the_loss_scale():
    """The logits' gradient is ~p/tokens: with 8,192 tokens and 128 classes ~1e-6, far below
    float16's smallest normal number (2^-14 = 6.1e-5), where it keeps only the few bits above
    2^-24. Scaled by 2^16 every such number is normal again. Bounds in float16 units u = 2^-11,
    of each weight's gradient norm against float32's: scaled, every one within 32 u (a few dozen
    roundings of u in random directions, some gradients sums that cancel) and the median within
    4 u; unscaled, the median is at least 8 u off (about 35 u on the machine this was written
    on)."""
    (want,) = _gradients("float32", [None])
    scaled, unscaled = (_relative_errors(g, want) for g in _gradients("float16", [2.0**16, 1.0]))
    assert max(scaled.values()) <= 32 * F16_U, scaled
    assert np.median(list(scaled.values())) <= 4 * F16_U, scaled
    assert np.median(list(unscaled.values())) >= 8 * F16_U, unscaled


@pytest.mark.parametrize("scheme", ["shard_optimizer", "shard_params"])
def test_the_data_parallel_schemes_scale_the_loss_too(scheme):
    """ZeRO-1 and FSDP compute their gradients in their own data-manual region: there too the
    loss is multiplied by the scale (float32, where 2^10 times the loss is 2^10 times every
    gradient up to the order of the sums)."""
    cfg = tiny_config(hidden_dropout=0.0, attention_dropout=0.0)
    cfg = dataclasses.replace(
        cfg, train=dataclasses.replace(cfg.train, **{scheme: True})
    ).validate()
    tr = make_trainer(cfg, mesh_for("2x2"))
    params, _ = tr.init_state(seed=0)
    batch = jax.device_put(
        tr.task.synthetic_batch(cfg, 8, np.random.default_rng(0)), tr.batch_sharding
    )
    grads = jax.jit(lambda p, b, s: tr.gradients(p, b, jax.random.key(0), s)[1])
    plain, scaled = (grads(params, batch, jnp.float32(s)) for s in (1.0, 2.0**10))
    assert_tree_close(
        jax.device_get(plain), jax.device_get(jax.tree.map(lambda g: g / 2.0**10, scaled)), F32
    )


def test_a_checkpoint_from_before_the_loss_scale_resumes_and_another_optimizer_is_refused(tmp_path):
    """megajax saved AdamW's state alone before float16: such a checkpoint restores with a
    fresh scale in front (the loop passes `legacy_opt_state`), bitwise. An optimizer state of
    any other form is the user's mistake: one UserError, not a damaged checkpoint set aside."""
    trainer = make_trainer(tiny_config(), mesh_for("2x2"))
    params, opt = trainer.init_state(seed=0)
    ckpts = Checkpoints(tmp_path / "old", async_save=False)
    assert ckpts.save(3, params, opt.inner, {"step": 3}) is None
    restored = ckpts.restore_newest_intact(
        lambda s: ckpts.restore(s, *trainer.abstract_state(), trainer.legacy_opt_state()),
        warn=print,
    )
    step, (_, got, _) = restored
    assert (
        step == 3
        and isinstance(got, LossScaleState)
        and float(got.scale) == 2.0**16
        and int(got.skipped) == 0
    )
    for want, have in zip(
        jax.tree.leaves(jax.device_get(opt.inner)), jax.tree.leaves(jax.device_get(got.inner))
    ):
        np.testing.assert_array_equal(have, want)
    ckpts.close()
    other = Checkpoints(tmp_path / "other", async_save=False)
    assert other.save(3, params, {"mu": params}, {"step": 3}) is None
    with pytest.raises(UserError, match="another optimizer's state"):
        other.restore_newest_intact(
            lambda s: other.restore(s, *trainer.abstract_state(), trainer.legacy_opt_state()),
            warn=print,
        )
    assert other.all_steps() == [3] and not (tmp_path / "other" / "damaged").exists()
    other.close()


def _records(workdir):
    return [
        r
        for r in map(json.loads, (workdir / "metrics.jsonl").read_text().splitlines())
        if "loss" in r
    ]


@pytest.mark.full
def test_a_float16_run_skips_overflowing_steps_recovers_and_resumes_bitwise(tmp_path):
    """Started at 2^19, the tiny model's float16 gradients overflow: those steps are skipped
    (grad_norm null, weights unchanged) and the scale halves (from the second overflow on:
    Megatron's hysteresis) until they fit; after 3 good steps it doubles again. Stopped at step 6
    and resumed, the run logs bitwise what a straight run does."""
    args = [
        *RUN_ARGS,
        "--mesh",
        "2x4",
        "--log-every",
        "1",
        "--eval-every",
        "100",
        "--save-every",
        "6",
        "--set",
        "model.compute_dtype=float16",
        "--set",
        "train.loss_scale=524288",
        "--set",
        "train.loss_scale_window=3",
        "--set",
        "train.decay_steps=12",
    ]
    run(*args, "--host-devices", "8", "--workdir", str(tmp_path / "straight"), "--steps", "12")
    run(*args, "--host-devices", "8", "--workdir", str(tmp_path / "cut"), "--steps", "6")
    run(*args, "--host-devices", "8", "--workdir", str(tmp_path / "cut"), "--steps", "12")
    straight, cut = _records(tmp_path / "straight"), _records(tmp_path / "cut")
    assert [(r["step"], r["loss"], r["loss_scale"], r["skipped_steps"]) for r in straight] == [
        (r["step"], r["loss"], r["loss_scale"], r["skipped_steps"]) for r in cut
    ]
    skipped = [r for r in straight if r["grad_norm"] is None]
    assert skipped and skipped[0]["step"] == 1 and straight[0]["loss_scale"] == 524288
    for before, after in zip(straight, straight[1:]):
        overflowed = before["grad_norm"] is None
        assert after["skipped_steps"] == before["skipped_steps"] + (after["grad_norm"] is None)
        assert after["loss_scale"] / before["loss_scale"] in ((1, 0.5) if overflowed else (1, 2))
    ratios = [a["loss_scale"] / b["loss_scale"] for b, a in zip(straight, straight[1:])]
    assert 0.5 in ratios and 2 in ratios  # halved (from the second overflow on) and grew again
    assert straight[-1]["skipped_steps"] < 12 and straight[-1]["loss"] < straight[0]["loss"]
