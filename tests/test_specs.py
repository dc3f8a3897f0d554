"""Each weight carries Megatron's PartitionSpec and each device holds 1/model of split weights."""

import jax
import pytest
from conftest import mesh_for, tiny_config
from flax import nnx
from jax.sharding import PartitionSpec as P

from megajax.models.registry import init_model, param_specs

EXPECTED = {
    ("attention", "qkv", "kernel"): P(None, "model"),
    ("attention", "qkv", "bias"): P("model"),
    ("attention", "out", "kernel"): P("model", None),
    ("attention", "out", "bias"): P(None),
    ("mlp", "fc1", "kernel"): P(None, "model"),
    ("mlp", "fc1", "bias"): P("model"),
    ("mlp", "fc2", "kernel"): P("model", None),
    ("mlp", "fc2", "bias"): P(None),
    ("ln1", "scale"): P(None),
    ("ln1", "bias"): P(None),
    ("ln2", "scale"): P(None),
    ("ln2", "bias"): P(None),
}


def _flat(tree):
    return {
        tuple(str(getattr(k, "key", k)) for k in path): v
        for path, v in jax.tree_util.tree_flatten_with_path(
            nnx.to_pure_dict(tree), is_leaf=lambda x: isinstance(x, P)
        )[0]
    }


@pytest.mark.parametrize("scan", [True, False])
def test_megatron_partition_specs(scan):
    mesh = mesh_for("2x4")
    model = init_model(tiny_config(scan_layers=scan).model, mesh)
    specs = _flat(param_specs(model))
    assert specs[("embed", "table")] == P("model", None)
    assert specs[("pos",)] == P(None, None)
    assert specs[("ln_f", "scale")] == P(None) and specs[("ln_f", "bias")] == P(None)
    checked = 0
    for path, spec in specs.items():
        if path[0] != "layers":
            continue
        suffix = path[-3:] if path[-3] in ("attention", "mlp") else path[-2:]
        want = EXPECTED[suffix]
        if scan:  # stacked layers gain a leading, unsharded layer axis
            want = P(None, *want)
        assert spec == want, path
        checked += 1
    assert checked == len(EXPECTED) * (1 if scan else 2)


def test_each_device_holds_its_slice():
    mesh = mesh_for("2x4")
    model = init_model(tiny_config(scan_layers=False).model, mesh)
    layer = model.layers.layers[0]
    for var, split_dim in (
        (layer.attention.qkv.kernel, 1),
        (layer.mlp.fc1.kernel, 1),
        (layer.attention.out.kernel, 0),
        (layer.mlp.fc2.kernel, 0),
        (model.embed.table, 0),
    ):
        arr = var[...]
        for shard in arr.addressable_shards:
            expected = list(arr.shape)
            expected[split_dim] //= 4
            assert list(shard.data.shape) == expected
    for shard in layer.ln1.scale[...].addressable_shards:
        assert shard.data.shape == layer.ln1.scale[...].shape
    assert len(model.embed.table[...].addressable_shards) == 8
