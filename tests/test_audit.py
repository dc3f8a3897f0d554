"""The compiled train step has exactly Megatron's collectives (read from the HLO)."""

import jax
import numpy as np
import pytest
from conftest import mesh_for, tiny_config
from helpers import exact_model_axis_elements, tiered

from megajax.mesh_shape import MeshShape
from megajax.tools.audit import audit
from megajax.tools.hlo import groups_axis, parse_replica_groups


@pytest.mark.parametrize(
    "layers,spec,scan",
    tiered(
        [(2, "2x4", True), (3, "2x4", True), (2, "1x8", True), (3, "1x8", True), (3, "2x4", False)],
        (3, "2x4", True),
        (3, "2x4", False),
    ),
)
def test_megatron_collectives(layers, spec, scan):
    cfg = tiny_config(num_layers=layers, scan_layers=scan)
    mesh = mesh_for(spec)
    r = audit(cfg, mesh)
    dp = mesh.shape["data"]
    b, s, h = cfg.train.batch_size // dp, cfg.model.seq_len, cfg.model.hidden

    per_layer = r.model_axis_layer_counts()
    assert sorted(per_layer) == [str(i) for i in range(layers)]
    for i, counts in per_layer.items():
        assert counts == {
            ("attention", "forward"): 1,
            ("mlp", "forward"): 1,
            ("attention", "backward"): 1,
            ("mlp", "backward"): 1,
        }, i
    model_ars = r.select(kind="all-reduce", axis="model")
    for c in model_ars:
        if c.origin in ("attention", "mlp"):
            assert c.elements == b * s * h  # (b, s, h), or (b*s, h) around the 2-D matmuls
    extras = sorted(
        (c.origin, c.direction, c.elements, c.count)
        for c in model_ars
        if c.origin not in ("attention", "mlp", "optimizer")
    )
    assert extras == sorted(
        [("embedding", "forward", b * s * h, 1), ("logits", "backward", b * s * h, 1)]
        + [("loss", "forward", b * s, 1)] * 3
    )
    # The optimizer's only model-axis traffic: scalar partial sums of the global grad norm.
    assert all(c.shape == () for c in model_ars if c.origin == "optimizer")
    # Nothing but all-reduces anywhere: no weight all-gathers, no resharding.
    assert {c.kind for c in r.collectives} == {"all-reduce"}
    # Across the data axis: the gradient reduction and the scalar loss mean, nothing else.
    for c in r.select(axis="data"):
        assert c.origin == "gradients" or (c.origin == "loss" and c.shape == ()), c
    if dp > 1:
        grads = r.select(axis="data", origin="gradients")
        n_grad = sum(np.prod(c.shape) * c.count for c in grads)
        # Every device reduces its own shard of every gradient once; the tied embedding's two
        # contributions (lookup and output layer) are reduced separately, so its shard twice.
        from megajax.training.step import make_trainer

        shardings = make_trainer(cfg, mesh).param_shardings
        shapes = make_trainer(cfg, mesh).modeldef.abstract_params()
        local = {
            k: np.prod(sh.shard_shape(x.shape))
            for k, sh, x in zip(range(10**6), jax.tree.leaves(shardings), jax.tree.leaves(shapes))
        }
        table = np.prod(shardings["embed"]["table"].shard_shape(shapes["embed"]["table"].shape))
        assert n_grad == sum(local.values()) + table
        assert (
            r.gradient_shard_elements == sum(local.values())
            and r.data_axis_gradient_elements == n_grad
        )
        assert (
            f"= {n_grad / sum(local.values()):.3f} x the minimum {sum(local.values()):,}"
            in r.table()
        )
    assert not [c for c in r.collectives if "+" in c.axis]
    assert r.ratio == pytest.approx(1.0, abs=0.005)
    assert "forward [2], backward [2]" in r.table()


def test_parse_explicit_iota_and_mesh_groups():
    mesh_shape = MeshShape(data=2, model=4)
    explicit = "replica_groups={{0,1,2,3},{4,5,6,7}}, use_global_device_ids=true"
    iota = "replica_groups=[2,4]<=[8], use_global_device_ids=true"
    iota_t = "replica_groups=[4,2]<=[2,4]T(1,0), use_global_device_ids=true"
    shardy = "replica_groups=mesh['axis_0'=2,'axis_1'=1,'axis_2'=1,'axis_3'=4] {'axis_0'}, use"
    shardy_ids = (
        "replica_groups=mesh['axis_0'=1,'axis_1'=4,'axis_2'=1,'axis_3'=2], "
        "device_ids=([2,4]T(1,0)) {'axis_1'}, use"
    )
    assert parse_replica_groups(explicit, 8) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert parse_replica_groups(iota, 8) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert parse_replica_groups(iota_t, 8) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert parse_replica_groups(shardy, 8) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert parse_replica_groups(shardy_ids, 8) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert parse_replica_groups("replica_groups={}, to_apply", 8) == [list(range(8))]
    # Sub-axes (jax 0.12's Shardy): 'model':(2)2 is the minor half of a model axis of 4, split 2 x
    # 2.
    sub = "replica_groups=mesh['data'=2,'model'=4] {'model':(2)2}, use"
    assert parse_replica_groups(sub, 8) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert parse_replica_groups(
        "replica_groups=mesh['data'=2,'model'=4] {'model':(1)2}, use", 8
    ) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert parse_replica_groups(
        "replica_groups=mesh['data'=1,'model'=8] {'model':(2)4}, use", 8
    ) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert groups_axis([[0, 1], [2, 3], [4, 5], [6, 7]], mesh_shape) == "model"
    assert groups_axis([[0, 1, 2, 3], [4, 5, 6, 7]], mesh_shape) == "model"
    assert groups_axis([[0, 4], [1, 5], [2, 6], [3, 7]], mesh_shape) == "data"
    assert groups_axis([list(range(8))], mesh_shape) == "data+model"


def test_remat_recomputes_only_the_attention_all_reduce():
    """With per-layer remat the backward pass recomputes each layer's forward up to what the
    gradients need: the attention block's all-reduce again, but not the MLP's."""
    cfg = tiny_config(num_layers=2, remat=True)
    r = audit(cfg, mesh_for("2x4"))
    for i, counts in r.model_axis_layer_counts().items():
        assert counts == {
            ("attention", "forward"): 1,
            ("mlp", "forward"): 1,
            ("attention", "recompute"): 1,
            ("attention", "backward"): 1,
            ("mlp", "backward"): 1,
        }, i
    assert "recomputed by remat [1]" in r.table()


@pytest.mark.full
def test_selective_remat_adds_no_collective_and_drops_the_attention_matrices():
    """Selective remat recomputes only the attention core, which has no collective: the audit
    is that of no remat. What it saves is the per-layer (b, heads/tp, s, s) scores,
    probabilities and dropout mask kept for the backward pass: the compiled step's temporary
    bytes fall by at least one f32 (b, heads/tp, s, s) array per layer."""
    from megajax.training.step import make_trainer

    mesh = mesh_for("2x4")
    none, selective = (
        tiny_config(num_layers=2, seq_len=128, remat=m) for m in ("none", "selective")
    )
    r = audit(selective, mesh)
    assert r.summary()["counts"] == audit(none, mesh).summary()["counts"]
    for counts in r.model_axis_layer_counts().values():
        assert counts == {
            ("attention", "forward"): 1,
            ("mlp", "forward"): 1,
            ("attention", "backward"): 1,
            ("mlp", "backward"): 1,
        }
    temp = {
        m: make_trainer(c, mesh).lower_step().compile().memory_analysis().temp_size_in_bytes
        for m, c in (("none", none), ("selective", selective))
    }
    b_local, heads_local, s = 8 // 2, 8 // 4, 128
    one_matrix = b_local * heads_local * s * s * 4
    assert temp["none"] - temp["selective"] >= 2 * one_matrix, temp  # 2 layers


@pytest.mark.parametrize(
    "layers,scan,spec,remat",
    tiered(
        [
            (2, False, "2x4", "none"),
            (3, True, "1x8", "none"),
            (3, False, "1x8", "selective"),
            (2, True, "2x4", "full"),
        ],
        (2, False, "2x4", "none"),
    ),
)
def test_sequence_parallel_collectives(layers, scan, spec, remat):
    """Sequence parallelism: around each block an all-gather of the sequence (b, s, h) before
    the column-parallel matmul and a reduce-scatter (b, s/t, h) after the row-parallel one,
    forward and backward; no all-reduce of activations anywhere on the model axis. Outside
    the layers: the embedding reduce-scatters straight into sequence shards, the logits gather
    once, the loss's three (b, s) all-reduces; the rest are gradient reductions of replicated
    h-sized vectors (LayerNorm, row-parallel biases) and of the (s, h) position table. Each
    block's input is all-gathered again in the backward pass. The total is the
    sequence-parallel analytic minimum to the element. Selective remat adds no collective;
    full remat recomputes the attention reduce-scatter (its all-gathers are the re-gathers)."""
    mesh = mesh_for(spec)
    cfg = tiny_config(num_layers=layers, scan_layers=scan, sequence_parallel=True, remat=remat)
    r = audit(cfg, mesh)
    t = mesh.shape["model"]
    b, s, h = cfg.train.batch_size // mesh.shape["data"], cfg.model.seq_len, cfg.model.hidden
    block = {
        ("attention", "forward"): 1,
        ("mlp", "forward"): 1,
        ("attention", "backward"): 1,
        ("mlp", "backward"): 1,
    }
    # In a scanned stack each block's input is all-gathered again for the backward pass
    # (Megatron keeps only the shard; unrolled, XLA may merge the two gathers); full remat
    # recomputes the attention block's reduce-scatter as well.
    regather = {("attention", "recompute"): 1, ("mlp", "recompute"): 1}
    recomputed = {
        "all-gather": regather if scan or remat == "full" else None,
        "reduce-scatter": {("attention", "recompute"): 1} if remat == "full" else {},
    }
    for kind in ("all-gather", "reduce-scatter"):
        per = r.model_axis_layer_counts(kind)
        wants = [
            {**block, **r}
            for r in ([recomputed[kind]] if recomputed[kind] is not None else [{}, regather])
        ]
        assert sorted(per) == [str(i) for i in range(layers)] and all(
            c in wants for c in per.values()
        ), kind
    assert r.model_axis_layer_counts("all-reduce") == {}
    model = [c for c in r.collectives if c.axis == "model" and c.direction != "optimizer"]
    for c in model:
        if c.kind == "all-gather":
            assert c.shape == (b, s, h), c
        elif c.kind == "reduce-scatter":
            assert c.shape == (b, s // t, h), c
        elif c.origin == "loss":
            assert c.shape == (b, s) and c.direction == "forward", c
        else:  # gradient reductions of replicated parameters
            assert c.kind == "all-reduce" and c.direction == "backward" and c.elements <= s * h, c
    outside = sorted(
        (c.kind, c.origin, c.direction) for c in model if c.kind != "all-reduce" and c.layer == ""
    )
    assert outside == [
        ("all-gather", "embedding", "backward"),
        ("all-gather", "logits", "forward"),
        ("reduce-scatter", "embedding", "forward"),
        ("reduce-scatter", "logits", "backward"),
    ]
    pair = b * s * h + b * s * h // t  # one all-gather + one reduce-scatter
    # LNs and row biases, final LN, positions
    replicated_grads = layers * 6 * h + 2 * h + s * h
    minimum = (4 * layers + 2) * pair + 3 * b * s + replicated_grads
    assert r.analytic_min_elements == minimum
    regathered = sum(
        n
        for c in r.model_axis_layer_counts("all-gather").values()
        for (_, d), n in c.items()
        if d == "recompute"
    )
    assert regathered == (2 * layers if scan or remat == "full" else regathered), regathered
    # unrolled: XLA may merge the re-gathers with the forward's
    assert regathered in (0, 2 * layers)
    recompute = regathered * b * s * h + (layers * b * s * h // t if remat == "full" else 0)
    assert exact_model_axis_elements(r) == minimum + recompute
    # the grad norm's scalars
    assert r.ratio == pytest.approx((minimum + recompute) / minimum, abs=1e-3)
    if recompute:
        assert f"the minimum is {minimum + recompute:,}: ratio 1.000" in r.table()
    assert "all-gathers per layer: forward [2], backward [2]" in r.table()
    assert "sequence-parallel analytic minimum" in r.table()


def test_plain_data_parallelism_reduces_gradients_once_per_microbatch():
    """The audit's data-axis line: GSPMD reduces each gradient shard over "data" where it is
    computed, so with gradient accumulation once per microbatch (train.shard_optimizer defers
    it to once per step: tests/test_data_parallel.py). Twice the microbatches, twice the
    traffic; the minimum does not move."""
    one, two = (audit(_with_microbatches(m), mesh_for("2x4")) for m in (1, 2))
    assert one.gradient_shard_elements == two.gradient_shard_elements > 0
    assert two.data_axis_gradient_elements == 2 * one.data_axis_gradient_elements
    assert "here 2" in two.table()


def _with_microbatches(m: int):
    cfg = tiny_config()
    cfg.train.microbatches = m
    return cfg.validate()
