"""The mixture-of-experts layer (megajax/core/moe.py) against an oracle written the other way
round: every expert run on every token, masked by a top-k taken with a stable sort and by
capacity slots counted in a Python loop. Outputs and every gradient (the router's included)
within the float32 bound on each mesh; the router losses by hand; training equal to one
device's on the model's meshes."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import mesh_for, tiny_config
from flax import nnx
from helpers import tiered
from tolerances import assert_close, assert_tree_close

from megajax.config import ConfigError, load_config
from megajax.core import sharding as S
from megajax.core.mesh import make_mesh
from megajax.core.moe import MoEBlock, route, router_losses, slots
from megajax.core.precision import Precision
from megajax.mesh_shape import MeshShape
from megajax.moe_config import capacity

MOE = dict(
    norm="rmsnorm",
    positions="rope",
    mlp="swiglu",
    bias="none",
    num_kv_heads=2,
    ffn_hidden=128,
    tie_embeddings=False,
    num_experts=8,
    experts_per_token=2,
    moe_ffn_hidden=64,
    moe_norm_topk=True,
    moe_aux_loss=0.01,
    moe_z_loss=0.001,
    init_std=0.1,  # the router's scores spread wide: no top-k choice within roundoff of a tie
)
# GPT-2's GeLU experts with their biases, a sigmoid router, a gated shared expert and a
# capacity that drops assignments
GELU_SHARED = dict(
    num_experts=4,
    experts_per_token=2,
    moe_ffn_hidden=64,
    moe_router="sigmoid",
    moe_shared_experts=1,
    moe_shared_gate=True,
    moe_capacity_factor=1.0,
    init_std=0.1,
)


def test_routing_by_hand():
    """Scores, the chosen experts (ties to the lower index) and their weights."""
    logits = jnp.log(jnp.array([[0.1, 0.4, 0.4, 0.1], [0.7, 0.1, 0.1, 0.1]]))
    scores, experts, weights = route(logits, 2, "softmax", norm_topk=False)
    np.testing.assert_allclose(scores, [[0.1, 0.4, 0.4, 0.1], [0.7, 0.1, 0.1, 0.1]], rtol=1e-6)
    assert experts.tolist() == [[1, 2], [0, 1]]
    np.testing.assert_allclose(weights, [[0.4, 0.4], [0.7, 0.1]], rtol=1e-6)
    _, _, normed = route(logits, 2, "softmax", norm_topk=True)
    np.testing.assert_allclose(normed, [[0.5, 0.5], [0.875, 0.125]], rtol=1e-6)
    sig, _, _ = route(jnp.zeros((1, 3)), 1, "sigmoid", norm_topk=False)
    np.testing.assert_allclose(sig, [[0.5, 0.5, 0.5]])


def test_slots_rank_first_choices_first():
    """One row of 3 tokens, k = 2, over 3 experts: every first choice takes a slot before any
    second choice; the capacity rule's figures."""
    experts = jnp.array([[[0, 1], [1, 0], [0, 2]]])
    # first choices: t0->0 (slot 0), t1->1 (0), t2->0 (1); then t0->1 (1), t1->0 (2), t2->2 (0)
    assert slots(experts, 3).tolist() == [[[0, 1], [0, 2], [1, 0]]]
    assert capacity(16, 0.0, 2, 8) == 16  # dropless: the row's length
    assert capacity(16, 1.0, 2, 8) == 4 and capacity(16, 1.25, 2, 8) == 5
    assert capacity(4, 100.0, 2, 8) == 4


def oracle(w: dict, x, m, token_weights):
    """A sparse layer's output, the dense way: each expert on every token, its output weighted
    by the router where the token chose it and found a slot (counted in a loop)."""
    logits = x @ w["router"]
    scores = jax.nn.softmax(logits, -1) if m.moe_router == "softmax" else jax.nn.sigmoid(logits)
    order = jnp.argsort(-jax.lax.stop_gradient(scores), axis=-1, stable=True)
    chosen = order[..., : m.experts_per_token]
    weights = jnp.take_along_axis(scores, chosen, -1)
    if m.moe_norm_topk:
        weights = weights / weights.sum(-1, keepdims=True)
    b, s, k = chosen.shape
    cap = (
        s if not m.moe_capacity_factor else -(-int(m.moe_capacity_factor * s * k) // m.num_experts)
    )
    keep = np.zeros((b, s, k), np.float32)
    picks = np.asarray(chosen)
    for row in range(b):
        used = [0] * m.num_experts
        for j in range(k):
            for t in range(s):
                e = picks[row, t, j]
                if used[e] < cap:
                    keep[row, t, j], used[e] = 1.0, used[e] + 1
    act = jax.nn.silu if m.mlp == "swiglu" else lambda a: jax.nn.gelu(a, approximate=True)
    out = 0.0
    for e in range(m.num_experts):
        gate = (jnp.where(chosen == e, weights, 0.0) * keep).sum(-1)
        if m.mlp == "swiglu":
            hid = act(x @ w["gate_experts"][e]) * (x @ w["up_experts"][e])
        else:
            hid = act(x @ w["fc1_experts"][e] + w.get("fc1_bias", jnp.zeros(1))[e])
        y = hid @ w["fc2_experts"][e] + (w["fc2_bias"][e] if "fc2_bias" in w else 0.0)
        out = out + gate[..., None] * y
    if "shared" in w:
        sw = w["shared"]
        hid = act(x @ sw["gate"]) * (x @ sw["up"]) if m.mlp == "swiglu" else act(x @ sw["fc1"])
        shared = hid @ sw["fc2"]
        if "shared_gate" in w:
            shared = shared * jax.nn.sigmoid(x @ w["shared_gate"])
        out = out + shared
    return out, keep


def block_weights(block: MoEBlock) -> dict:
    """The block's weights as the oracle names them."""
    w = block.weights()
    if block.fc2_bias is not None:
        w["fc2_bias"] = block.fc2_bias[...]
    return jax.device_get(w)


@pytest.fixture(scope="module")
def blocks():
    """One block of each kind, its weights, an input, token weights and a cotangent."""
    made = {}
    for name, fields in (("swiglu", MOE), ("gelu_shared", GELU_SHARED)):
        m = tiny_config(**fields).model
        block = MoEBlock(
            m, layout=S.Layout.for_model(None, m), precision=Precision.of(m), rngs=nnx.Rngs(3)
        )
        rng = np.random.default_rng(0)
        x = rng.standard_normal((8, m.seq_len, m.hidden)).astype(np.float32)
        tw = (rng.random((8, m.seq_len)) > 0.2).astype(np.float32)
        cot = rng.standard_normal(x.shape).astype(np.float32)
        made[name] = (m, nnx.state(block, nnx.Param), x, tw, cot)
    return made


def grads_of(fn, w, x, cot):
    return jax.grad(lambda w, x: (fn(w, x) * cot).sum(), argnums=(0, 1))(w, x)


def moe_mesh(spec: str):
    """The mesh `spec` names, on as many of the 8 devices as it asks for."""
    return make_mesh(spec, devices=jax.devices()[: MeshShape.devices_asked(spec)])


EXPERT_MESHES = ("data=2,expert=4", "expert=2,model=2", "data=1,expert=4,model=2", "expert=8")


@pytest.mark.parametrize(
    "kind,spec",
    tiered(
        [(k, s) for k in ("swiglu", "gelu_shared") for s in ("1x1", "2x4", "1x8", "8x1")]
        + [("swiglu", s) for s in EXPERT_MESHES]
        + [("gelu_shared", s) for s in EXPERT_MESHES[:3]],  # 4 experts: not over 8
        ("swiglu", "2x4"),
        ("gelu_shared", "data=2,expert=4"),
    ),
)
def test_block_matches_the_dense_loop_with_every_gradient(blocks, kind, spec):
    """Dense meshes and expert meshes (experts split over "expert", tokens sent to them and
    back by all-to-all), with and without "model"."""
    m, state, x, tw, cot = blocks[kind]
    mesh = moe_mesh(spec)
    layout = S.Layout.for_model(mesh, m)
    block = MoEBlock(m, layout=layout, precision=Precision.of(m), rngs=nnx.Rngs(3))
    nnx.update(block, state)
    graphdef, params = nnx.split(block, nnx.Param)
    w = block_weights(block)
    want, keep = oracle(w, jnp.asarray(x), m, tw)
    if kind == "gelu_shared":  # the capacity drops some assignments, and not all
        assert 0 < (keep == 0).sum() < keep.size // 4
    xs = jax.device_put(x, layout.sharding(S.ACT_REPLICATED))

    @jax.jit
    def run(params, x):
        out, stats = nnx.merge(graphdef, params)(x, token_weights=jnp.asarray(tw))
        return out, stats

    got, stats = run(params, xs)
    assert_close(got, want, what="output")
    assert int(stats["dropped"].sum()) == int((keep == 0).sum())
    assert_close(stats["tokens"].sum(), tw.sum(), what="covered tokens")

    def through_block(params, x):
        return nnx.merge(graphdef, params)(x)[0]

    g_params, g_x = jax.jit(lambda p, x: grads_of(through_block, p, x, cot))(params, xs)
    w_grads, x_grad = grads_of(lambda w, x: oracle(w, x, m, tw)[0], w, jnp.asarray(x), cot)
    assert_close(g_x, x_grad, what="input gradient")
    got_grads = block_weights(_with(block, g_params))
    assert_tree_close(w_grads, {k: got_grads[k] for k in w_grads}, what="weight gradient")
    assert np.abs(np.asarray(got_grads["router"])).max() > 0  # the router learns


def _with(block, state):
    nnx.update(block, state)
    return block


def test_router_losses_by_hand():
    """Switch's balance E·Σ f·P and the z-loss over the covered tokens, summed over layers."""
    m = tiny_config(**MOE).model
    # one layer, one row of 2 covered tokens over 8 experts, k = 2
    assigned = np.zeros((1, 1, 8), np.float32)
    assigned[0, 0, :3] = [1, 2, 1]  # assignments: e0 once, e1 twice, e2 once
    probs = np.zeros((1, 1, 8), np.float32)
    probs[0, 0, :4] = [0.5, 1.0, 0.3, 0.2]  # summed over the 2 tokens
    stats = {
        "assigned": assigned,
        "probs": probs,
        "z": np.array([[3.0]], np.float32),
        "tokens": np.array([[2.0]], np.float32),
        "dropped": np.array([[1.0]], np.float32),
        "routed": np.array([[4.0]], np.float32),
    }
    got = router_losses(jax.tree.map(jnp.asarray, stats), m)
    f = np.array([1, 2, 1, 0, 0, 0, 0, 0]) / 4
    p = np.array([0.5, 1.0, 0.3, 0.2, 0, 0, 0, 0]) / 2
    assert_close(got["moe/aux_loss"], 8 * (f * p).sum(), what="balance loss")
    assert_close(got["moe/z_loss"], 1.5, what="z-loss")
    assert float(got["moe/dropped"]) == 0.25


def test_the_moe_fields_are_checked_one_line_each():
    bad = [
        ("model.experts_per_token=3", "model.experts_per_token"),  # dense model
        ("model.num_experts=4,model.experts_per_token=5", "1 to model.num_experts"),
        ("model.num_experts=4,model.moe_router=top", "moe_router"),
        ("model.num_experts=4,model.moe_layer_freq=2", "scan_layers"),
        ("model.num_experts=4,model.moe_layer_freq=3", "no sparse layer"),
        ("model.num_experts=4,model.moe_shared_gate=true", "moe_shared_experts"),
        ("model.num_experts=4,model.moe_capacity_factor=-1", "must not be negative"),
        ("model.num_experts=4,model.lora_rank=4", "lora_targets"),
        ("model.num_experts=4,train.layer_programs=true", "layer_programs"),
    ]
    for sets, words in bad:
        with pytest.raises(ConfigError, match=words) as e:
            load_config("tiny", sets.split(","))
        assert "\n" not in str(e.value)
    cfg = load_config("moe_tiny", ["model.moe_layer_freq=2", "model.scan_layers=false"])
    assert cfg.model.sparse_layers == (False, True)


_REFERENCES = {}


def steps(mesh, cfg, n=3) -> dict:
    """Loss, router losses, gradients and n AdamW steps' metrics of `cfg` on `mesh`."""
    from test_equivalence import KEY, TOKENS

    from megajax.training.step import make_trainer

    trainer = make_trainer(cfg, mesh)
    p, o = trainer.init_state(seed=0)
    tokens = jax.device_put(TOKENS, trainer.batch_sharding)
    metrics, grads = jax.device_get(jax.jit(trainer.gradients)(p, tokens, KEY))
    step, history = trainer.jit_step(), []
    for i in range(n):
        p, o, m = step(p, o, tokens, jnp.int32(i))
        history.append({k: float(v) for k, v in m.items() if k.startswith(("loss", "moe/"))})
    return dict(metrics=metrics, grads=grads, history=history, final=jax.device_get(p))


@pytest.mark.parametrize(
    "spec,extra,train",
    tiered(
        [
            ("8x1", {"moe_capacity_factor": 1.0}, {"shard_params": True}),
            ("2x4", {"scan_layers": False, "remat": "full"}, {"shard_optimizer": True}),
            ("data=2,expert=4", {"moe_capacity_factor": 1.0}, {}),
            ("data=1,expert=4,model=2", {"sequence_parallel": True}, {}),
            ("2x4", {"sequence_parallel": True, "remat": "selective"}, {"microbatches": 2}),
            ("expert=8", {"remat": "full"}, {"shard_params": True}),
            ("data=2,expert=4", {"lora_rank": 4, "lora_targets": "qkv,out"}, {}),
            ("data=2,expert=4", {}, {"shard_optimizer": True}),
            ("data=2,expert=2,model=2", {}, {"shard_optimizer": True, "microbatches": 2}),
            ("data=1,expert=4,model=2", {"sequence_parallel": True}, {"shard_params": True}),
            ("pipe=2,expert=2,model=2", {}, {"microbatches": 2}),
            ("pipe=2,data=2,expert=2", {}, {"shard_params": True, "microbatches": 2}),
        ],
        ("data=1,expert=4,model=2", {"sequence_parallel": True}, {}),
        ("pipe=2,data=2,expert=2", {}, {"shard_params": True, "microbatches": 2}),
    ),
)
def test_three_adamw_steps_match_one_device(spec, extra, train):
    """Dropout, the balance loss and the z-loss on: the loss, each router loss and every
    gradient, and three AdamW steps, as on one device, for every mesh, data-parallel scheme
    (ZeRO-1 and FSDP on expert meshes too), pipeline and microbatch count (the router losses
    are per microbatch, averaged like the loss; a pipeline's stages add their layers')."""
    base = {k: v for k, v in extra.items() if k not in ("remat", "sequence_parallel")}
    key = (tuple(sorted(base.items())), train.get("microbatches", 1))
    cfg = tiny_config(**MOE, **extra)
    for name, value in train.items():
        setattr(cfg.train, name, value)
    cfg.validate()
    if key not in _REFERENCES:
        ref = tiny_config(**MOE, **base)
        ref.train.microbatches = train.get("microbatches", 1)
        _REFERENCES[key] = steps(mesh_for("1x1"), ref.validate())
    want, got = _REFERENCES[key], steps(moe_mesh(spec), cfg)
    for name in ("loss", "moe/aux_loss", "moe/z_loss", "moe/dropped"):
        assert_close(got["metrics"][name], want["metrics"][name], what=name)
    assert_tree_close(want["grads"], got["grads"], what="gradient")
    for a, b in zip(want["history"], got["history"], strict=True):
        for name in a:
            assert_close(b[name], a[name], what=f"{name} of a step")
    assert want["history"][2]["loss"] < want["history"][0]["loss"]


def test_audit_finds_the_dense_layers_collectives_and_the_routing_gradient():
    """On "model", a sparse layer has the dense layer's collectives: one all-reduce of b·s·h
    after each block forward and one before each backward; besides them only the routing
    weights' gradient, b·s·k numbers (each device's experts hold a partial sum of the outputs
    the weights scale). Nothing crosses "data" in the layers."""
    from megajax.tools.audit import audit

    cfg = load_config("moe_tiny")
    r = audit(cfg, mesh_for("2x4"))
    per_layer = r.model_axis_layer_counts()
    assert sorted(per_layer) == ["0", "1"]
    for counts in per_layer.values():
        assert dict(counts) == {
            (block, direction): 1
            for block in ("attention", "mlp")
            for direction in ("forward", "backward")
        }
    rows = cfg.train.batch_size // 2
    small = [
        c
        for c in r.select(axis="model")
        if c.origin == "mlp" and c.elements < rows * cfg.model.seq_len * cfg.model.hidden
    ]
    assert [(c.kind, c.direction, c.elements) for c in small] == [
        ("all-reduce", "backward", rows * cfg.model.seq_len * cfg.model.experts_per_token)
    ]
    assert not [c for c in r.select(axis="data") if c.origin in ("attention", "mlp")]


def test_kv_cache_decoding_gives_the_full_forward_logits():
    """Token by token through the cache, a sparse model's logits are its whole-sequence ones
    (dropless: a token's experts do not depend on the others)."""
    from megajax.models.registry import init_model

    cfg = load_config("moe_tiny", ["model.hidden_dropout=0", "model.attention_dropout=0"])
    model = init_model(cfg.model, mesh_for("1x8"), seed=0)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 256, (2, 12)))
    whole = np.asarray(nnx.jit(lambda m, t: m(t))(model, tokens))[..., :256]
    cache = model.init_cache(2, 12)
    step = nnx.jit(lambda m, t, c, p: m.decode(t, c, p))
    got = []
    for i in range(12):
        logits, cache = step(model, tokens[:, i : i + 1], cache, jnp.int32(i))
        got.append(np.asarray(logits)[:, 0, :256])
    assert_close(np.stack(got, 1), whole, what="decoded logits")


def test_bias_balancing_moves_by_the_sign_of_each_experts_deficit():
    """DeepSeek-V3's rule by hand: +rate for an expert below the mean load, -rate above it,
    nothing at it."""
    from megajax.core.moe import balanced

    load = jnp.array([[4.0, 0.0, 2.0, 2.0]])  # mean 2
    got = balanced(jnp.zeros((1, 4)), load, 0.5)
    np.testing.assert_array_equal(got, [[-0.5, 0.5, 0.0, 0.0]])


def test_bias_balancing_is_the_same_on_every_mesh_and_microbatch_count():
    """The routers' biases after each of three steps, bitwise: one device, data=2,expert=4 and
    2x4 in two microbatches (dropout off, so that the microbatches route as the whole batch
    does); never in the optimizer's state or its gradients. (The router's scores are spread
    wide by a larger initialisation: top-k is discontinuous, and a near-tie within roundoff,
    which another summation order resolves the other way, would move one token.)"""
    from flax import traverse_util
    from test_equivalence import TOKENS

    from megajax.training.step import make_trainer

    def biases(spec, microbatches, *extra):
        cfg = load_config(
            "moe_tiny",
            [
                "model.moe_bias_update_rate=0.01",
                "model.hidden_dropout=0",
                "model.attention_dropout=0",
                f"train.microbatches={microbatches}",
                "model.vocab_size=100",
                "model.init_std=0.2",
                "model.num_layers=4",
                *extra,
            ],
        )
        trainer = make_trainer(cfg, moe_mesh(spec))
        p, o = trainer.init_state(seed=0)
        assert not any(
            "router_bias" in str(path) for path, _ in jax.tree_util.tree_flatten_with_path(o)[0]
        )
        tokens = jax.device_put(TOKENS[:, : cfg.model.seq_len + 1], trainer.batch_sharding)
        step, out = trainer.jit_step(), []
        for i in range(3):
            p, o, m = step(p, o, tokens, jnp.int32(i))
            assert "moe/load" not in m
            in_order = trainer.strategy.reorder(jax.device_get(p), inverse=True)
            flat = traverse_util.flatten_dict(in_order)
            out.append(next(v for k, v in flat.items() if k[-1] == "router_bias"))
        return np.stack(out)

    want = biases("1x1", 1)
    assert np.abs(want[-1]).max() > 0 and set(np.round(np.abs(want[0]) / 0.01, 6).ravel()) <= {0, 1}
    interleaved = ("train.pipeline_schedule=interleaved", "train.pipeline_chunks=2")
    for spec, microbatches, *extra in (
        ("data=2,expert=4", 1),
        ("2x4", 2),
        ("data=2,expert=4", 1, "train.shard_optimizer=true"),
        ("pipe=2,expert=2", 2, *interleaved),
    ):
        np.testing.assert_array_equal(biases(spec, microbatches, *extra), want, err_msg=spec)


@pytest.mark.parametrize(
    "spec,capacity_factor,scheme",
    tiered(
        [
            ("data=2,expert=2,model=2", 0.0, "plain"),
            ("expert=8", 1.0, "plain"),
            ("data=2,expert=2,model=2", 0.0, "shard_optimizer"),
            ("data=2,expert=4", 1.0, "shard_params"),
        ],
        ("data=2,expert=2,model=2", 0.0, "plain"),
        ("data=2,expert=2,model=2", 0.0, "shard_optimizer"),
    ),
)
def test_expert_axis_carries_two_all_to_alls_each_way(spec, capacity_factor, scheme):
    """Per sparse layer, 2 all-to-alls forward (tokens to their experts' devices, results back)
    and 2 backward over "expert", each of a row shard's buffers, rows x E x capacity x h (the
    analytic form: dropless, E/k times the k·h numbers of each token; with a capacity factor c,
    c times them); nothing else on "expert" alone. The model axis keeps the dense layer's
    all-reduces (1.000 of the analytic minimum), and the data axes carry each gradient once,
    1.000 of the scheme's minimum: plain, ZeRO-1 and FSDP (the experts' state split over
    "data", the rest over "data" and "expert")."""
    from megajax.analytic import expert_axis_minimum
    from megajax.moe_config import capacity
    from megajax.tools.audit import audit

    opts = [f"model.moe_capacity_factor={capacity_factor}"]
    cfg = load_config("moe_tiny", opts + ([f"train.{scheme}=true"] if scheme != "plain" else []))
    mesh = moe_mesh(spec)
    shape, m = MeshShape.of(mesh), cfg.model
    r = audit(cfg, mesh)
    rows = cfg.train.batch_size // shape.batch_shards
    cap = capacity(m.seq_len, capacity_factor, m.experts_per_token, m.num_experts)
    # besides them, "expert" carries the non-expert weights' gradient reductions (it is a
    # data axis for them) and the router statistics' batch sums: nothing in a layer's forward
    on_axis = [c for c in r.collectives if "expert" in c.axis.split("+")]
    assert not [
        c
        for c in on_axis
        if c.kind != "all-to-all" and c.direction == "forward" and c.origin in ("attention", "mlp")
    ]
    on_expert = [c for c in on_axis if c.kind == "all-to-all"]
    assert sorted((c.axis, c.direction, c.layer, c.count) for c in on_expert) == [
        ("expert", d, "all", m.num_layers) for d in ("backward",) * 2 + ("forward",) * 2
    ]
    assert {c.elements for c in on_expert} == {rows * m.num_experts * cap * m.hidden}
    assert r.expert_axis_elements == expert_axis_minimum(r.shape)  # the analytic form's
    # each gradient reduced once: the experts' over "data", the others' over "data" and "expert"
    assert ("expert_gradients" in r.data_axis_minimum) == (scheme == "plain")
    assert r.data_axis_ratio == pytest.approx(1.0, abs=5e-4)
    assert r.ratio == pytest.approx(1.0, abs=1e-3) or shape.model == 1
    if capacity_factor == 1.0:  # exactly the tokens' k copies
        assert rows * m.num_experts * cap == rows * m.seq_len * m.experts_per_token
    if shape.model > 1:
        for counts in r.model_axis_layer_counts().values():
            assert set(counts.values()) == {1} and len(counts) == 4


def test_train_py_logs_the_router_losses_and_refuses_what_it_cannot_run(tmp_path):
    """A mixture of experts through train.py: the router losses and the dropped share in
    metrics.jsonl and the step line; four steps on data=2,expert=4 resumed for two more on
    expert=2,model=4 log the losses of six straight steps on 2x4. Layer programs, an indivisible
    expert width, experts that the expert axis does not divide and an expert axis under a dense
    model are one line, exit 2, nothing written."""
    import json

    from helpers import losses, run

    common = ["--config", "moe_tiny", "--host-devices", "8", "--sample-tokens", "0"]
    balancing = ["--set", "model.moe_bias_update_rate=0.001"]  # in the checkpoint, resumed
    straight = run(
        *common,
        *balancing,
        "--workdir",
        tmp_path / "straight",
        "--steps",
        "6",
        "--mesh",
        "2x4",
        "--log-every",
        "1",
    )
    wd = tmp_path / "moved"
    run(
        *common,
        *balancing,
        "--workdir",
        wd,
        "--steps",
        "4",
        "--save-every",
        "4",
        "--mesh",
        "data=2,expert=4",
        "--log-every",
        "1",
        "--set",
        "train.decay_steps=6",
    )
    run(
        *common,
        *balancing,
        "--workdir",
        wd,
        "--steps",
        "6",
        "--mesh",
        "expert=2,model=4",
        "--log-every",
        "1",
        "--set",
        "train.decay_steps=6",
    )
    want, got = losses(tmp_path / "straight"), losses(wd)
    assert sorted(got) == list(range(1, 7))
    assert_close([got[i] for i in range(1, 7)], [want[i] for i in range(1, 7)], what="losses")
    records = [json.loads(line) for line in (wd / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "loss" in r]
    assert all(
        r["moe/aux_loss"] > 0 and r["moe/z_loss"] > 0 and r["moe/dropped"] == 0 for r in train
    )
    assert "  aux " in straight.stdout and "dropped 0.00%" in straight.stdout
    from helpers import cli

    # fine-tuned from: the workdir decides the experts, whatever the run's config says
    tuned = tmp_path / "tuned"
    run(
        "--config",
        "tiny",
        "--init-from",
        wd,
        "--workdir",
        tuned,
        "--steps",
        "1",
        "--mesh",
        "2x4",
        "--host-devices",
        "8",
        "--sample-tokens",
        "0",
    )
    assert "moe/aux_loss" in (tuned / "metrics.jsonl").read_text()
    q = cli("convert", "export", "--workdir", wd, "--out", tmp_path / "hf")
    # the balancing bias moves the router's choices, which Mixtral's file cannot hold
    assert q.returncode == 2 and "model.moe_bias_update_rate (0)" in q.stderr
    assert not (tmp_path / "hf").exists()
    for args, words in (
        (["--mesh", "2x4", "--set", "train.layer_programs=true"], "layer_programs"),
        (["--mesh", "1x8", "--set", "model.moe_ffn_hidden=36"], "moe_ffn_hidden=36"),
        (["--mesh", "expert=8", "--set", "model.num_experts=12"], "not divisible by the expert"),
        (["--mesh", "expert=8", "--config", "tiny"], "this model is dense"),
    ):
        q = run(*common, "--workdir", tmp_path / "refused", "--steps", "2", *args, check=False)
        assert q.returncode == 2 and words in q.stderr and q.stderr.count("\n") == 1, q.stderr
        assert not (tmp_path / "refused").exists()


@pytest.mark.full
def test_sigkill_and_resume_keep_the_losses_and_the_balancing_bias_bitwise(tmp_path):
    """A run on data=2,expert=4 with bias balancing SIGKILLed after its step-2 checkpoint and
    resumed: every loss and each layer's router bias equal the uninterrupted run's, bitwise."""
    from helpers import killed_after_checkpoint, losses, run

    from megajax.models.registry import ModelDef, path_keys
    from megajax.runs.workdir import load_workdir

    def args(wd):
        return [
            *("--config", "moe_tiny", "--host-devices", "8", "--sample-tokens", "0"),
            *("--set", "model.moe_bias_update_rate=0.001", "--mesh", "data=2,expert=4"),
            *("--steps", "6", "--save-every", "2", "--log-every", "1", "--workdir", str(wd)),
        ]

    straight, killed = tmp_path / "straight", tmp_path / "killed"
    run(*args(straight))
    killed_after_checkpoint(args(killed), killed, 2)
    assert "resuming from step" in run(*args(killed)).stdout
    assert losses(killed) == losses(straight) and sorted(losses(killed)) == list(range(1, 7))

    def biases(wd):
        model = load_workdir(wd, mesh_for("1x1")).model
        flat = jax.tree_util.tree_flatten_with_path(ModelDef(model).params(model))[0]
        return [np.asarray(x) for p, x in flat if path_keys(p)[-1] == "router_bias"]

    (want,), (got,) = biases(straight), biases(killed)
    assert np.abs(want).max() > 0  # it moved
    np.testing.assert_array_equal(got, want)


def test_mixtral_has_its_published_parameter_count():
    """Mixtral 8x7B: 46,702,792,704 parameters (the Hugging Face checkpoint's tensors), of which
    a token goes through its attention, the router, two of the eight experts and both
    embedding tables."""
    from megajax.tasks import param_count

    cfg = load_config("mixtral_8x7b")
    m = cfg.model
    assert param_count(cfg) == 46_702_792_704
    assert m.active_layer_params + 2 * m.padded_vocab * m.hidden + m.hidden == 12_879_925_248


def test_qwen3_moe_has_its_published_parameter_count():
    """Qwen3-30B-A3B: 30,532,122,624 parameters (QK-norm's scales among them: without them the
    count is 48 x 256 short), 128 experts of which a token goes through 8."""
    from megajax.tasks import param_count

    cfg = load_config("qwen3_30b_a3b")
    m = cfg.model
    assert param_count(cfg) == 30_532_122_624
    assert param_count(load_config("qwen3_30b_a3b", ["model.qk_norm=false"])) == (
        30_532_122_624 - 48 * 2 * 128
    )
    assert m.active_layer_params + 2 * m.padded_vocab * m.hidden + m.hidden == 3_353_032_704


@pytest.mark.full
def test_the_rest_of_megajax_runs_a_mixture_of_experts(tmp_path):
    """A sparse model through the rest of megajax: float16 with its loss scale and bfloat16 on
    an expert mesh (the first step's loss float32's within the 16-bit formats' roundoff over the
    reductions: 4 units of each), --dry-run with its expert-axis audit, --mesh auto, and eval.py's
    perplexity and sampling on another mesh than the one it trained on."""
    from helpers import cli, run
    from tolerances import BF16_U, F16_U

    common = ("--config", "moe_tiny", "--host-devices", "8", "--sample-tokens", "0")
    first = {}
    for dtype in ("float32", "float16", "bfloat16"):
        wd = tmp_path / dtype
        p = run(
            *common,
            "--mesh",
            "data=2,expert=4",
            "--steps",
            "3",
            "--log-every",
            "1",
            "--set",
            f"model.compute_dtype={dtype}",
            "--workdir",
            wd,
        )
        records = [json.loads(line) for line in (wd / "metrics.jsonl").read_text().splitlines()]
        train = [r for r in records if "loss" in r]
        assert all(np.isfinite(r["loss"]) for r in train)
        assert ("loss_scale" in train[0]) == (dtype == "float16"), p.stdout
        first[dtype] = train[0]["loss"]
    for dtype, u in (("float16", F16_U), ("bfloat16", BF16_U)):
        assert_close(first[dtype], first["float32"], tol=4 * u, what=dtype)
    p = run(*common, "--mesh", "data=2,expert=4", "--dry-run", "--workdir", tmp_path / "dry")
    assert "expert-axis all-to-all elements" in p.stdout and "1.000 x" in p.stdout
    p = run(*common, "--mesh", "auto", "--steps", "1", "--workdir", tmp_path / "auto")
    assert "mesh data=8" in p.stdout
    wd = tmp_path / "float32"
    for task, extra in (
        ("ppl", ("--data", "text:data/README.md")),
        ("sample", ("--prompt", "def ", "--max-new-tokens", "8")),
    ):
        q = cli(
            "eval",
            *("--workdir", str(wd), "--task", task, "--mesh", "expert=2,model=2"),
            *("--host-devices", "4", *extra, "--out", str(tmp_path / f"{task}.json")),
        )
        assert q.returncode == 0, q.stderr
    assert np.isfinite(json.loads((tmp_path / "ppl.json").read_text())["loss"])
