"""The paper's optimiser recipe: what decays, the schedule, and the initialisation."""

import math

import jax
import numpy as np
import pytest
from conftest import mesh_for, tiny_config

from megajax.config import TrainConfig
from megajax.models.registry import ModelDef, init_model
from megajax.training.optimizer import lr_schedule, weight_decay_mask


@pytest.mark.parametrize("kind", ["gpt", "bert"])
def test_weight_decay_everywhere_but_biases_and_layernorm(kind):
    """Megatron-LM's rule: every weight matrix and embedding table decays (BERT's token-type
    table too); biases and LayerNorm scale/shift do not."""
    model = init_model(tiny_config(kind=kind, scan_layers=False).model, mesh_for("1x1"))
    mask = weight_decay_mask(ModelDef(model).params(model))
    flat = {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_flatten_with_path(mask)[0]}
    exempt = {name for name in flat if name.endswith(("['bias']", "['scale']", "['mlm_bias']"))}
    assert exempt and all("ln" in n or "bias" in n for n in exempt)
    for name, decays in flat.items():
        assert decays == (name not in exempt), name
    assert flat["['embed']['table']"] and flat["['pos']"]
    if kind == "bert":
        assert flat["['types']"] and not flat["['mlm_bias']"]
    assert not flat["['layers']['layers']['0']['ln1']['scale']"]
    assert not flat["['layers']['layers']['0']['mlp']['fc1']['bias']"]


def test_warmup_then_cosine_to_min_lr():
    t = TrainConfig(lr=1e-3, min_lr=1e-4, warmup_steps=100, steps=2000)
    sched = lr_schedule(t)
    assert float(sched(0)) == 0.0
    assert float(sched(50)) == pytest.approx(5e-4)
    assert float(sched(100)) == pytest.approx(1e-3)
    mid = 100 + (2000 - 100) // 2  # half way through the decay: (lr + min_lr) / 2
    assert float(sched(mid)) == pytest.approx((1e-3 + 1e-4) / 2, rel=1e-3)
    assert float(sched(2000)) == pytest.approx(1e-4)
    s = 1300
    frac = (s - 100) / 1900
    assert float(sched(s)) == pytest.approx(
        1e-4 + 0.5 * (1e-3 - 1e-4) * (1 + math.cos(math.pi * frac)), rel=1e-4
    )


def test_initialisation_follows_the_paper():
    cfg = tiny_config(num_layers=8, hidden=256, num_heads=8, scan_layers=False).model
    model = init_model(cfg, mesh_for("1x1"))
    layer = model.layers.layers[3]
    assert np.std(np.asarray(layer.mlp.fc1.kernel[...])) == pytest.approx(0.02, rel=0.02)
    assert np.std(np.asarray(layer.attention.qkv.kernel[...])) == pytest.approx(0.02, rel=0.02)
    scaled = 0.02 / math.sqrt(2 * cfg.num_layers)  # residual output projections
    assert np.std(np.asarray(layer.mlp.fc2.kernel[...])) == pytest.approx(scaled, rel=0.03)
    assert np.std(np.asarray(layer.attention.out.kernel[...])) == pytest.approx(scaled, rel=0.03)
    assert np.std(np.asarray(model.embed.table[...])) == pytest.approx(0.02, rel=0.02)
    assert np.all(np.asarray(layer.mlp.fc1.bias[...]) == 0) and np.all(
        np.asarray(layer.ln1.scale[...]) == 1
    )
