import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_config
from flax import nnx
from jax.sharding import AxisType, Mesh

from megajax.config import ConfigError, load_config
from megajax.core.mesh import as_mesh, make_mesh
from megajax.core.sharding import AXES, Layout
from megajax.mesh_shape import MeshShape
from megajax.models.registry import abstract_model, init_model
from megajax.training.step import make_trainer


@pytest.mark.parametrize(
    "spec,expected",
    [
        ("data=2,model=4", (2, 4)),
        ("2x4", (2, 4)),
        ("model=8", (1, 8)),
        ("model=2", (4, 2)),
        ("data=8", (8, 1)),
        ("auto", (8, 1)),
        ("", (8, 1)),
        (" Data=4, Model=2 ", (4, 2)),
        ("1x8", (1, 8)),
    ],
)
def test_parse(spec, expected):
    shape = MeshShape.parse(spec, 8)
    assert shape.dims == expected and shape.axis_names == AXES
    assert MeshShape.parse(str(shape), 8) == shape  # printed back as it parses


def test_a_shape_prints_back_and_derives_its_figures():
    shape = MeshShape.parse("pipe=2,model=2", 8)
    assert shape == MeshShape(data=2, pipe=2, model=2) and str(shape) == "data=2,pipe=2,model=2"
    assert shape.axis_names == ("pipe", "data", "model") and shape.dims == (2, 2, 2)
    assert shape.pipelined and shape.devices == 8
    assert shape.sizes() == {"pipe": 2, "data": 2, "model": 2}
    assert shape.rows_per_microbatch(batch_size=32, microbatches=4) == 4
    assert MeshShape.of(make_mesh(shape)) == shape
    assert str(MeshShape(data=4, model=2)) == "data=4,model=2"
    assert MeshShape.devices_asked("data=3,model=4") == 12 and MeshShape.devices_asked("x") is None
    with pytest.raises(ValueError, match="positive integer"):
        MeshShape(model=0)


def test_make_mesh_axes(devices):
    mesh = make_mesh("2x4")
    assert mesh.axis_names == ("data", "model")
    assert dict(mesh.shape) == {"data": 2, "model": 4}
    assert sorted(d.id for d in mesh.devices.flat) == sorted(d.id for d in devices)


@pytest.mark.parametrize(
    "spec,message",
    [
        ("2x2", "needs 4 devices"),
        ("data=3", "does not divide"),
        ("model=0", "must be positive"),
        ("model=-2", "must be positive"),
        ("stage=2", "unknown axis 'stage'"),
        ("data=2,pipe=3", "pipe=3 x data=2 does not divide"),
        ("2x2x2", "DATAxMODEL"),
        ("model=two", "must be an integer"),
        ("data=2,data=4", "given twice"),
    ],
)
def test_bad_specs_name_the_devices(devices, spec, message):
    with pytest.raises(ValueError) as e:
        make_mesh(spec)
    assert message in str(e.value)
    assert "8 cpu devices available" in str(e.value) and str(e.value).count("available") == 1
    # simulated devices help a spec that needs more, not one that is wrong itself
    assert ("simulate" in str(e.value)) == ("devices" in message or "divide" in message), str(
        e.value
    )


def test_a_users_mesh_is_laid_out_as_megajax_lays_out_its_own(devices):
    """jax.make_mesh gives Explicit axes by default; a mesh may name only one axis or put
    "model" first. as_mesh keeps the devices where the user put them, as (data, model) with
    Auto axes, and returns megajax's own mesh unchanged."""
    ours = make_mesh("2x4")
    assert as_mesh(ours) is ours
    assert as_mesh("2x4").devices.tolist() == ours.devices.tolist()
    explicit = jax.make_mesh((2, 4), AXES)
    grid = np.asarray(devices)[::-1].reshape(4, 2)
    cases = [
        (explicit, explicit.devices),
        (Mesh(grid, ("model", "data")), grid.T),
        (Mesh(np.asarray(devices), ("model",)), np.asarray(devices)[None]),
        (Mesh(np.asarray(devices), ("data",)), np.asarray(devices)[:, None]),
    ]
    for given, expected in cases:
        mesh = as_mesh(given)
        assert mesh.axis_names == AXES and mesh.axis_types == (AxisType.Auto,) * 2
        assert mesh.devices.tolist() == expected.tolist()
    # an expert axis keeps its place between "data" and "model"
    mesh = as_mesh(Mesh(grid, ("expert", "data")))
    assert mesh.axis_names == ("data", "expert", "model")
    assert mesh.devices.tolist() == grid.T[..., None].tolist()
    with pytest.raises(ConfigError, match=r"'expert' for experts\), this mesh has \('dp', 'tp'\)"):
        as_mesh(Mesh(grid, ("dp", "tp")))
    with pytest.raises(TypeError, match="expected a jax.sharding.Mesh"):
        as_mesh(devices)


def test_the_python_api_takes_a_users_mesh_and_refuses_what_would_fail_deep_inside(devices):
    """Bitwise the same loss on jax.make_mesh's Explicit mesh and a model-only mesh as on
    megajax's meshes of the same devices; inputs and contexts jax would fail on deep inside
    (or, for a sequence longer than the position table, fill with NaN) are one ValueError."""
    cfg = tiny_config(seq_len=8, hidden_dropout=0.0, attention_dropout=0.0)
    tokens = jax.random.randint(jax.random.key(0), (8, 9), 0, cfg.model.vocab_size)

    def loss(mesh):
        return float(
            nnx.jit(lambda m: m.loss(tokens[:, :-1], tokens[:, 1:]))(
                init_model(cfg.model, mesh, seed=1)
            )
        )

    assert loss(jax.make_mesh((2, 4), AXES)) == loss(make_mesh("2x4"))
    assert loss(Mesh(np.asarray(devices), ("model",))) == loss(make_mesh("1x8"))
    model = init_model(cfg.model, make_mesh("2x4"), seed=1)
    for ids, message in [
        (tokens[:, :9].astype(jnp.float32), "integer array, got float32"),
        (tokens[0], r"\(batch, seq\) integer array, got int32 \(9,\)"),
        (tokens[:3, :8], "batch of 3 rows does not split over the data axis \\(2\\)"),
        (tokens, "9 tokens is longer than the model's 8 positions"),
        (
            tokens[:, :8].at[1, 2].set(cfg.model.vocab_size),
            rf"token ids must be in \[0, {cfg.model.vocab_size}\)",
        ),
        (tokens[:, :8].at[1, 2].set(-1), "got values from -1 to"),
    ]:
        with pytest.raises(ValueError, match=message):
            model(ids)
    bert = abstract_model(
        load_config("bert_tiny", ["model.seq_len=8"]).model, Layout(make_mesh("2x4"))
    )
    # a type past the table: NaN rows, before
    ids, ones = tokens[:, :8], jnp.ones_like(tokens[:, :8])
    for args, message in [
        (
            (tokens, jnp.zeros_like(tokens), jnp.ones_like(tokens)),
            "9 tokens is longer than the model's 8 positions",
        ),
        ((ids, 2 * ones, ones), r"token types must be in \[0, 2\), got values from 2 to 2"),
        (
            (ids, ones[:, 0], ones),
            r"token types must have the token ids' shape \(8, 8\), got \(8,\)",
        ),
        (
            (ids, ones, ones[:, :4]),
            r"padding mask must have the token ids' shape \(8, 8\), got \(8, 4\)",
        ),
    ]:
        with pytest.raises(ValueError, match=message):
            bert.hidden_states(*args)
    with pytest.raises(ConfigError, match=r"num_heads=2 is not divisible by the model axis \(8\)"):
        init_model(tiny_config(num_heads=2).model, make_mesh("1x8"))
    with jax.set_mesh(jax.make_mesh((2, 4), AXES)):
        for call in (lambda: model(tokens[:, :8]), lambda: make_trainer(cfg, make_mesh("2x4"))):
            with pytest.raises(
                ValueError,
                match="cannot run inside jax.set_mesh\\(mesh\\) of a mesh with Explicit axes",
            ):
                call()
    with jax.set_mesh(make_mesh("2x4")):  # an Auto context mesh is fine
        assert float(nnx.jit(lambda m: m.loss(tokens[:, :-1], tokens[:, 1:]))(model)) == loss(
            make_mesh("2x4")
        )
