"""Pipeline parallelism: the schedules' tables (every dependency kept, the paper's bubble, the
activation memory of each), and pipelined steps that compute what one device computes, with
dropout on, on every factorisation of the 8 devices that has stages."""

import json
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_config
from helpers import tiered
from tolerances import F32, adam_tolerance, assert_close, assert_tree_close

from megajax import schedules
from megajax.config import ConfigError
from megajax.core.mesh import make_mesh, single_device_mesh
from megajax.mesh_shape import MeshShape
from megajax.models.registry import path_keys
from megajax.plan.memory import _slots
from megajax.tools.audit import audit_hlo
from megajax.training.loop import train
from megajax.training.step import make_trainer

MICRO = 4
TOKENS = np.asarray(jax.random.randint(jax.random.key(7), (8, 17), 0, 100))


def config(schedule: str = "1f1b", chunks: int = 1, layers: int = 8, micro: int = MICRO, **model):
    cfg = tiny_config(num_layers=layers, **model)
    cfg.train.microbatches, cfg.train.pipeline_schedule = micro, schedule
    cfg.train.pipeline_chunks = chunks
    return cfg.validate()


# -- the tables ---------------------------------------------------------------------------
SIZES = [(2, 4), (4, 8), (8, 8), (4, 16), (3, 6), (2, 1)]


def replay(t: schedules.Table):
    """Check a table independently of how it was built: each (virtual stage, microbatch) runs
    forward once and backward once, each after what it needs, and every input it reads is the
    one that arrived in its slot (and was not overwritten since)."""
    p, last = t.stages, t.stages * t.chunks - 1
    ran, acts, grads = {}, [{} for _ in range(p)], [{} for _ in range(p)]
    for tick, row in enumerate(t.ticks):
        for s, (kind, chunk, micro, act, grad) in enumerate(row):
            if kind == schedules.IDLE:
                continue
            vs = chunk * p + s
            key = (kind, vs, micro)
            assert key not in ran
            ran[key] = tick
            if vs > 0:
                assert acts[s].get(act) == (vs, micro), (tick, s)
            if kind == schedules.FORWARD:
                assert vs == 0 or ran[(schedules.FORWARD, vs - 1, micro)] < tick
            else:
                assert ran[(schedules.FORWARD, vs, micro)] < tick
                if vs < last:
                    assert ran[(schedules.BACKWARD, vs + 1, micro)] < tick
                    assert grads[s].get(grad) == (vs, micro)
        for s, (kind, chunk, micro, _, _) in enumerate(row):
            vs = chunk * p + s
            if kind == schedules.FORWARD and vs < last:
                acts[(s + 1) % p][t.arrive_act[tick][(s + 1) % p]] = (vs + 1, micro)
            if kind == schedules.BACKWARD and vs > 0:
                grads[(s - 1) % p][t.arrive_grad[tick][(s - 1) % p]] = (vs - 1, micro)
    assert len(ran) == 2 * (last + 1) * t.micro


@pytest.mark.parametrize(
    "schedule,chunks", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 4)]
)
def test_schedule_tables_keep_every_dependency_and_the_papers_bubble(schedule, chunks):
    for p, m in SIZES:
        if schedule == "interleaved" and m % p:
            with pytest.raises(ValueError, match="multiple of the pipeline stages"):
                schedules.build(schedule, p, m, chunks)
            continue
        t = schedules.build(schedule, p, m, chunks)
        replay(t)
        # Narayanan et al. 2021: (p - 1) / m, interleaved (p - 1) / (v m), in ticks.
        assert t.bubble == pytest.approx(
            schedules.bubble_formula(schedule, p, m, chunks), abs=1e-12
        )
        assert t.num_ticks == 2 * chunks * m + 2 * (p - 1)
        # each microbatch crosses each of the p v - 1 boundaries once each way
        for kind in (schedules.FORWARD, schedules.BACKWARD):
            index, patterns = t.sends(kind)
            assert len(index) == t.num_ticks and patterns[0] == ()
            assert sum(len(patterns[i]) for i in index) == m * (p * chunks - 1)
        # GPipe keeps every microbatch's input; 1F1B at most p on the first stage.
        held = t.first_stage_inputs()
        assert held == {"gpipe": m, "1f1b": min(p, m)}.get(schedule, held)
        if schedule != "interleaved":  # the planner's closed form of a stage's buffers
            assert t.act_slots + t.grad_slots == _slots(schedule, MeshShape(pipe=p), m, chunks)


def test_pipeline_sizes_are_checked():
    mesh = make_mesh("pipe=2,model=4")
    with pytest.raises(ConfigError, match="num_layers=3 is not divisible by the pipeline's 2"):
        make_trainer(tiny_config(num_layers=3), mesh)
    cfg = config()
    cfg.model.scan_layers = False
    with pytest.raises(ConfigError, match="does not run with model.scan_layers = false"):
        make_trainer(cfg.validate(), mesh)
    with pytest.raises(ValueError, match="axes are 'data', 'pipe', 'expert' and 'model'"):
        make_mesh("stage=2")


# -- the step -----------------------------------------------------------------------------
def run(cfg, mesh):
    """(the first step's loss and gradients, losses of three AdamW steps, final weights): the
    train step's own computation, compiled once with its gradients as an output."""
    trainer = make_trainer(cfg, mesh)
    params, opt = trainer.init_state(seed=0)
    tokens = jax.device_put(TOKENS, trainer.batch_sharding)

    @jax.jit
    def step(params, opt, batch, i):
        metrics, grads = trainer.gradients(params, batch, trainer.step_key(i))
        return *trainer.apply_gradients(params, opt, grads, metrics, i), grads

    losses, grads = [], None
    for i in range(3):
        params, opt, m, g = step(params, opt, tokens, jnp.int32(i))
        losses.append(float(m["loss"]))
        # (an interleaved pipeline keeps its layers stage-major: compared in their own order)
        grads = jax.device_get(trainer.natural(g)[0]) if i == 0 else grads
    return dict(
        loss=losses[0], grads=grads, losses=losses, final=jax.device_get(trainer.natural(params)[0])
    )


_REFERENCES = {}


def single_device(layers: int = 8, micro: int = MICRO):
    """One device's run of the same model and microbatches (computed once per shape)."""
    if (layers, micro) not in _REFERENCES:
        _REFERENCES[layers, micro] = run(config(layers=layers, micro=micro), single_device_mesh())
    return _REFERENCES[layers, micro]


@pytest.fixture(scope="module")
def reference():
    return single_device()


MESHES = ["data=1,pipe=2,model=4", "pipe=4,model=2", "pipe=8", "data=2,pipe=2,model=2"]
# Every schedule on every mesh. Interleaved needs the layers to divide by p x v and the
# microbatches by p: on 8 stages, 16 layers and 8 microbatches of one row.
CASES = [(spec, schedule, 1) for schedule in ("1f1b", "gpipe") for spec in MESHES] + [
    ("data=1,pipe=2,model=4", "interleaved", 4),
    ("pipe=4,model=2", "interleaved", 2),
    ("pipe=8", "interleaved", 2),
    ("data=2,pipe=2,model=2", "interleaved", 2),
]


@pytest.mark.parametrize(
    "spec,schedule,chunks", tiered(CASES, ("data=2,pipe=2,model=2", "1f1b", 1))
)
def test_pipelined_step_matches_single_device(spec, schedule, chunks):
    shape = dict(layers=16, micro=8) if spec == "pipe=8" and schedule == "interleaved" else {}
    reference = single_device(**shape)
    got = run(config(schedule, chunks, **shape), make_mesh(spec))
    assert_close(got["loss"], reference["loss"], what="loss")
    assert_tree_close(reference["grads"], got["grads"], what="gradient")
    assert_close(got["losses"], reference["losses"], what="losses of 3 steps")
    lr = config().train.lr
    flat_grads = dict(jax.tree_util.tree_flatten_with_path(reference["grads"])[0])
    for (path, want), have in zip(
        jax.tree_util.tree_flatten_with_path(reference["final"])[0], jax.tree.leaves(got["final"])
    ):
        g = flat_grads[path]
        bound = adam_tolerance(g, np.abs(g).max(), lr, steps=3) + F32 * np.abs(want).max()
        assert (np.abs(have - want) <= bound).all(), jax.tree_util.keystr(path)


LLAMA = dict(
    norm="rmsnorm",
    positions="rope",
    mlp="swiglu",
    bias="none",
    num_kv_heads=2,
    ffn_hidden=128,
    tie_embeddings=False,
)


@pytest.mark.full
def test_pipelined_llama_gradients_match_single_device():
    """The Llama family's layers (RMSNorm, rotary positions, SwiGLU, grouped-query attention
    with its key/value heads copied over model=4) and its untied output layer on the last
    stage."""
    cfg = config(**LLAMA)
    params = make_trainer(cfg, single_device_mesh()).init_state(seed=0)[0]
    results = []
    for mesh in (single_device_mesh(), make_mesh("pipe=2,model=4")):
        trainer = make_trainer(cfg, mesh)
        results.append(
            jax.device_get(
                jax.jit(trainer.gradients)(
                    jax.device_put(params, trainer.param_shardings),
                    jax.device_put(TOKENS, trainer.batch_sharding),
                    jax.random.key(3),
                )
            )
        )
    (want_metrics, want), (got_metrics, got) = results
    assert_close(got_metrics["loss"], want_metrics["loss"], what="loss")
    assert_tree_close(want, got, what="gradient")


@pytest.mark.full
@pytest.mark.parametrize("scheme", ["shard_optimizer", "shard_params"])
def test_sharded_data_parallelism_on_stages_matches_single_device(reference, scheme):
    """ZeRO-1 and FSDP on data=2,pipe=2,model=2: each device holds half its stage's Adam
    moments (FSDP: and weights), split over "data" on a dimension the model axis leaves whole;
    the three steps are one device's; and the compiled step moves over "data" exactly its
    scheme's minimum: ZeRO-1 one reduce-scatter of the gradients summed over the step's
    microbatches and one all-gather of the updated weights, FSDP each layer's gathers and
    gradient reduce-scatters per microbatch."""
    cfg = config()
    setattr(cfg.train, scheme, True)
    mesh = make_mesh("data=2,pipe=2,model=2")
    got = run(cfg.validate(), mesh)
    assert_close(got["losses"], reference["losses"], what="losses of 3 steps")
    assert_tree_close(reference["grads"], got["grads"], what="gradient")
    trainer = make_trainer(cfg.validate(), mesh)
    params, opt = trainer.init_state()
    kernel = ("layers", "stacked", "mlp", "fc1", "kernel")  # (8, 64, 256)
    held = [
        x
        for path, x in jax.tree_util.tree_flatten_with_path((params, opt))[0]
        if path_keys(path)[-5:] == kernel
    ]
    assert len(held) == 3  # the weight, Adam's mu and nu
    for i, x in enumerate(held):  # 4 layers a stage, 64 rows over "data", 256 columns / "model"
        split = i > 0 or scheme == "shard_params"
        assert {s.data.shape for s in x.addressable_shards} == {(4, 32 if split else 64, 128)}
    audit = audit_hlo(
        trainer.lower_step().compile().as_text(),
        cfg,
        MeshShape(data=2, pipe=2, model=2),
        trainer=trainer,
    )
    assert audit.data_scheme == {"shard_optimizer": "zero", "shard_params": "fsdp"}[scheme]
    assert audit.data_axis_ratio == pytest.approx(1.0, abs=1e-9)
    if scheme == "shard_optimizer":
        reduced = audit.select(axis="data", origin="gradients", kind="reduce-scatter")
        assert reduced and all(c.count == 1 for c in reduced)


def test_stacked_weights_live_on_their_stage():
    trainer = make_trainer(config(), make_mesh("pipe=4,model=2"))
    params, _ = trainer.init_state()
    kernel = params["layers"]["stacked"]["mlp"]["fc1"]["kernel"]
    # 8 layers over 4 stages: each device holds 2 layers, and half the columns (model=2).
    assert {s.data.shape for s in kernel.addressable_shards} == {(2, 64, 128)}
    stages = {int(np.asarray(s.index[0].start or 0)) // 2 for s in kernel.addressable_shards}
    assert stages == {0, 1, 2, 3}


@pytest.mark.full
def test_bubble_and_activation_memory_read_from_the_compiled_step():
    """On 4 stages and 8 microbatches: each layer's two all-reduces over "model" forward and two
    backward, wherever its stage runs it; the compiled program's tick loop runs 2 (m + p - 1)
    ticks, so each stage idles (p - 1) / m of its busy time (the audit reads the trip count from
    the HLO), and its point-to-point sends carry each microbatch's stage boundary once per
    boundary and way, the minimum, with no sends of the lockstep's idle ticks. GPipe keeps
    all m microbatches' stage inputs, 1F1B p: the compiled step's temporaries differ by exactly
    those m - p buffers."""
    temp = {}
    for schedule in ("gpipe", "1f1b"):
        cfg = tiny_config(num_layers=4, seq_len=64)
        cfg.train.microbatches, cfg.train.batch_size = 8, 16
        cfg.train.pipeline_schedule = schedule
        trainer = make_trainer(cfg.validate(), make_mesh("pipe=4,model=2"))
        compiled = trainer.lower_step().compile()
        audit = audit_hlo(compiled.as_text(), cfg, MeshShape(pipe=4, model=2), trainer=trainer)
        # Megatron's per layer: 2 all-reduces forward, 2 backward, counted over the stages
        # through the schedule's switch (the backward tick recomputes the forward's first)
        per_layer = audit.model_axis_layer_counts()
        assert sorted(per_layer) == ["0", "1", "2", "3"]
        for counts in per_layer.values():
            by_pass = Counter()
            for (_, direction), n in counts.items():
                by_pass[direction] += n
            assert by_pass["forward"] == by_pass["backward"] == 2, counts
        sends = audit.pipeline
        assert sends.ticks == 2 * (8 + 4 - 1)
        assert sends.bubble == pytest.approx((4 - 1) / 8, abs=1e-12)
        rows_per_micro = 16 // 8
        assert sends.boundary_elements == rows_per_micro * 64 * 64
        assert sends.forward_elements == sends.backward_elements == sends.boundary_elements
        # only what a stage passes on crosses the links: each microbatch once per boundary
        assert sends.minimum == 8 * (4 - 1) * sends.boundary_elements
        assert sends.forward_sent == sends.backward_sent == sends.minimum
        inputs = {"gpipe": 8, "1f1b": 4}[schedule]
        assert trainer.pipeline.table.act_slots == inputs
        temp[schedule] = compiled.memory_analysis().temp_size_in_bytes
        boundary_bytes = sends.boundary_elements * 4
    # (buffers are counted in whole bytes: the difference is those 4 inputs, give or take one
    # buffer XLA may place differently)
    assert (8 - 4) * boundary_bytes <= temp["gpipe"] - temp["1f1b"] <= (8 - 4 + 1) * boundary_bytes


@pytest.mark.full
def test_interleaved_run_checkpoints_in_the_layers_order(tmp_path):
    """An interleaved run keeps its layers stage-major, but saves, validates and samples them
    in their own order: two steps on pipe=2,model=4 (2 chunks a stage) resumed for two more on
    four stages of one layer (1F1B on pipe=4,model=2) log the losses of four straight steps on
    2x4, and validate as they do."""
    cfg = tiny_config(num_layers=4)
    t = cfg.train
    t.steps, t.microbatches, t.save_every, t.eval_every, t.decay_steps = 4, 2, 2, 2, 4
    t.pipeline_schedule, t.pipeline_chunks = "interleaved", 2
    straight = train(
        cfg.validate(), make_mesh("2x4"), tmp_path / "straight", sample_tokens=0, out=None
    )
    t.steps = 2
    piped = train(
        cfg.validate(), make_mesh("pipe=2,model=4"), tmp_path / "moved", sample_tokens=8, out=None
    )
    t.steps, t.pipeline_schedule, t.pipeline_chunks = 4, "1f1b", 1
    moved = train(
        cfg.validate(), make_mesh("pipe=4,model=2"), tmp_path / "moved", sample_tokens=0, out=None
    )
    losses = {**piped.losses, **moved.losses}
    assert sorted(losses) == [1, 2, 3, 4]
    assert_close(
        [losses[s] for s in range(1, 5)], [straight.losses[s] for s in range(1, 5)], what="losses"
    )
    assert_close(moved.val_loss, straight.val_loss, what="validation loss")
    # validated on the stages at step 2, with the weights back in order
    step2 = [
        json.loads(line)
        for line in (tmp_path / "straight" / "metrics.jsonl").open()
        if '"val_loss"' in line
    ][0]
    assert step2["step"] == 2
    assert_close(piped.val_loss, step2["val_loss"], what="validation loss on the stages")
    assert piped.sample
