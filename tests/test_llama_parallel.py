"""The Llama family's shape (RMSNorm, rotary positions with llama3 scaling, SwiGLU, 8 query and
2 key/value heads, no biases, untied) on every mesh and parallel scheme megajax has, against one
device and against Megatron's collectives read back from the compiled program; tests/test_llama.py
checks the same architecture against transformers and megatron-core."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import mesh_for, tiny_config
from helpers import exact_model_axis_elements, tiered
from tolerances import BF16_ELEMENT, BF16_NORM, BF16_U, F16_U, F32, assert_close, assert_tree_close

from megajax.core.attention import kv_copies
from megajax.mesh_shape import MeshShape
from megajax.tools.audit import audit
from megajax.training.step import make_trainer

LLAMA = dict(
    norm="rmsnorm",
    positions="rope",
    mlp="swiglu",
    bias="none",
    num_kv_heads=2,
    ffn_hidden=128,
    tie_embeddings=False,
    rope_scaling="llama3",
    rope_factor=8.0,
    rope_original_context=8,
)


@pytest.mark.parametrize(
    "spec,extra,train",
    tiered(
        [
            ("1x8", {}, {}),  # key/value heads in 4 copies
            ("2x4", dict(sequence_parallel=True), dict(shard_params=True)),  # 2 copies, FSDP, SP
            (
                "2x4",
                dict(num_kv_heads=4, scan_layers=False),
                dict(shard_optimizer=True),
            ),  # split, ZeRO-1
        ],
        ("2x4", dict(num_kv_heads=4, scan_layers=False), dict(shard_optimizer=True)),
    ),
)
def test_three_adamw_steps_match_one_device(spec, extra, train):
    """A Llama-shaped model (dropout on) computes on every mesh and data-parallel scheme what it
    computes on one device: weights, logits, loss, gradients and three optimizer steps."""
    from test_equivalence import assert_matches_reference, run

    model = {**LLAMA, **extra}
    # one device: nothing to split
    base = {k: v for k, v in model.items() if k != "sequence_parallel"}
    key = tuple(sorted(base.items()))
    if key not in _REFERENCES:
        _REFERENCES[key] = run(mesh_for("1x1"), tiny_config(**base))
    cfg = tiny_config(**model)
    cfg.train.shard_optimizer, cfg.train.shard_params = (
        train.get("shard_optimizer", False),
        train.get("shard_params", False),
    )
    assert_matches_reference(_REFERENCES[key], run(mesh_for(spec), cfg.validate()))


_REFERENCES = {}  # one device's run of each model, shared by the meshes compared with it


@pytest.mark.parametrize(
    "spec,sp", tiered([("2x4", False), ("1x8", False), ("2x4", True)], ("2x4", False))
)
def test_audit_finds_megatrons_collectives_and_the_copied_kv_gradients(spec, sp):
    """Two all-reduces forward and two backward per layer (with sequence parallelism their
    all-gathers and reduce-scatters), nothing else in the blocks; the key/value weight's copies
    have their gradients summed (an all-reduce of one head's, an all-gather of all heads'),
    which the analytic minimum counts: ratio 1.000 to it."""
    cfg = tiny_config(**LLAMA, sequence_parallel=sp)
    mesh = mesh_for(spec)
    r = audit(cfg, mesh)
    kind = "all-gather" if sp else "all-reduce"
    per_layer = r.model_axis_layer_counts(kind)
    assert sorted(per_layer) == ["0", "1"]
    for counts in per_layer.values():
        assert {k: v for k, v in counts.items() if k[1] != "recompute"} == {
            ("attention", "forward"): 1,
            ("mlp", "forward"): 1,
            ("attention", "backward"): 1,
            ("mlp", "backward"): 1,
        }
    m, t = cfg.model, mesh.shape["model"]
    kv = [c for c in r.select(axis="model", origin="gradients")]
    one_head = m.hidden * 2 * m.head_dim
    assert sorted((c.kind, c.elements, c.count) for c in kv) == [
        ("all-gather", one_head * m.kv_heads, m.num_layers),
        ("all-reduce", one_head, m.num_layers),
    ]
    assert kv_copies(m, MeshShape(model=t)) == t // m.kv_heads
    recompute = r.regathered_elements if sp else 0
    assert exact_model_axis_elements(r) == r.analytic_min_elements + recompute
    assert r.data_axis_ratio == pytest.approx(1.0) if mesh.shape["data"] > 1 else True


@pytest.mark.full
@pytest.mark.parametrize("remat,scan,sp", [("selective", True, False), ("full", False, True)])
def test_remat_recomputes_the_same_numbers(remat, scan, sp):
    """None, selective and full recomputation, scanned and unrolled, with and without sequence
    parallelism: the loss and every gradient of no recomputation, dropout on, on 2x4."""
    from test_equivalence import KEY, TOKENS

    def loss_and_grads(mode):
        trainer = make_trainer(
            tiny_config(**LLAMA, remat=mode, scan_layers=scan, sequence_parallel=sp),
            mesh_for("2x4"),
        )
        params, _ = trainer.init_state(seed=0)
        return jax.device_get(
            jax.jit(jax.value_and_grad(trainer.loss_fn))(
                params, jax.device_put(TOKENS, trainer.batch_sharding), KEY
            )
        )

    (want_loss, want), (loss, got) = loss_and_grads("none"), loss_and_grads(remat)
    assert_close(loss, want_loss, what="loss")
    assert_tree_close(want, got, what=f"gradient with {remat} remat")


@pytest.mark.full
def test_layer_programs_give_the_single_program_step():
    from test_layer_programs import _programs, _two_steps

    cfg = tiny_config(**LLAMA, num_layers=3)
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, microbatches=2)).validate()
    want = _two_steps(cfg, mesh_for("2x4"), lambda tr: tr.jit_step(donate=False))
    got = _two_steps(_programs(cfg), mesh_for("2x4"), lambda tr: tr.compiled_step())
    assert_tree_close(want[0], got[0], F32, what="params")
    assert_close([m["loss"] for m in got[2]], [m["loss"] for m in want[2]], what="losses")


def test_mixed_precision_stays_within_bfloat16_of_one_device():
    cfg = tiny_config(**LLAMA, compute_dtype="mixed", hidden_dropout=0.0, attention_dropout=0.0)
    from test_equivalence import TOKENS

    results = {}
    for spec in ("1x1", "2x4"):
        trainer = make_trainer(cfg, mesh_for(spec))
        params, _ = trainer.init_state(seed=0)
        results[spec] = jax.device_get(
            jax.jit(jax.value_and_grad(trainer.loss_fn))(
                params, jax.device_put(TOKENS, trainer.batch_sharding), None
            )
        )
    assert_close(results["2x4"][0], results["1x1"][0], BF16_NORM, what="loss")
    assert_tree_close(
        results["1x1"][1], results["2x4"][1], BF16_ELEMENT, "gradient", norm_tol=BF16_NORM
    )


@pytest.mark.parametrize(
    "dtype,u", tiered([("float16", F16_U), ("bfloat16", BF16_U)], ("bfloat16", BF16_U))
)
def test_16_bit_activations_give_float32s_gradients_within_their_roundoff(dtype, u):
    """float16 (with its loss scale, 2^16) and bfloat16 activations: each weight's gradient
    norm against float32's, within the bounds tests/test_loss_scale.py states for the GPT, in
    units u of the dtype: every weight within 32 u, the median within 4 u."""

    def gradients(compute, scale):
        cfg = tiny_config(
            **LLAMA, compute_dtype=compute, seq_len=128, hidden_dropout=0.0, attention_dropout=0.0
        )
        tr = make_trainer(cfg, mesh_for("1x1"))
        params, _ = tr.init_state(seed=0)
        batch = jax.device_put(
            tr.task.synthetic_batch(cfg, 16, np.random.default_rng(0)), tr.batch_sharding
        )
        g = jax.jit(lambda p, b: tr.gradients(p, b, jax.random.key(0), scale)[1])(params, batch)
        return jax.device_get(g if scale is None else jax.tree.map(lambda x: x / scale, g))

    want = gradients("float32", None)
    got = gradients(dtype, jnp.float32(2.0**16) if dtype == "float16" else None)
    errors = [
        np.linalg.norm(np.asarray(g, np.float64) - w) / np.linalg.norm(w)
        for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got))
    ]
    assert max(errors) <= 32 * u and np.median(errors) <= 4 * u, errors
