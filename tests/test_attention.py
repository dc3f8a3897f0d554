"""model.attention = "fused": the attention core through jax.nn.dot_product_attention (cuDNN's
flash attention on NVIDIA GPUs, XLA here) computes what megajax's own core computes, with the
same collectives; "auto" picks it only on GPUs without attention dropout. (megajax's own core on
the CPU without attention dropout: tests/test_blocked_attention.py.)"""
from collections import Counter

import jax
import numpy as np
import pytest
from conftest import mesh_for, tiny_config
from tolerances import assert_close, assert_tree_close

from megajax.config import ConfigError
from megajax.core.layers import fused_attention
from megajax.core.sharding import Layout
from megajax.tools.audit import audit
from megajax.training.step import make_trainer


def config(attention: str, **model):
    return tiny_config(attention_dropout=0.0, attention=attention, **model)   # hidden dropout stays on


def loss_and_grads(cfg, spec):
    trainer = make_trainer(cfg, mesh_for(spec))
    params, _ = trainer.init_state(seed=0)
    batch = jax.device_put(trainer.task.synthetic_batch(cfg, cfg.train.batch_size, np.random.default_rng(0)),
                           trainer.batch_sharding)
    metrics, grads = jax.jit(trainer.gradients)(params, batch, jax.random.key(1))
    return jax.device_get((metrics["loss"], grads))


@pytest.mark.parametrize("kind,spec", [("gpt", "1x1"), ("gpt", "2x4"), ("bert", "2x4")])
def test_fused_attention_matches_megajax_core(kind, spec):
    """Causal (GPT) and padding (BERT) masks; float32, so within F32 of each scale (tests/tolerances.py)."""
    model = {} if kind == "gpt" else {"kind": "bert"}
    want_loss, want = loss_and_grads(config("megajax", **model), spec)
    got_loss, got = loss_and_grads(config("fused", **model), spec)
    assert_close(got_loss, want_loss, what="loss")
    assert_tree_close(want, got, what="gradient")


def test_fused_attention_adds_no_collective():
    def collectives(attention):
        r = audit(config(attention), mesh_for("2x4"))
        return r, Counter((c.kind, c.axis, c.origin, c.direction, c.shape, c.count) for c in r.collectives)
    (fused, got), (_, want) = collectives("fused"), collectives("megajax")
    assert got == want
    assert fused.ratio == pytest.approx(1.0, abs=0.005)


def test_auto_picks_fused_only_on_gpus_without_attention_dropout():
    cpu = Layout(mesh_for("2x4"))
    assert not fused_attention(config("auto").model, cpu)                      # CPU devices
    assert fused_attention(config("fused").model, cpu)
    assert not fused_attention(tiny_config(attention="megajax").model, cpu)
    with pytest.raises(ConfigError, match="attention_dropout=0"):
        tiny_config(attention="fused")                                          # attention dropout 0.1
