"""model.attention = "fused": the attention core through jax.nn.dot_product_attention (cuDNN's
flash attention on NVIDIA GPUs, XLA here) computes what megajax's own core computes, with the
same collectives; "auto" picks it only on GPUs without attention dropout. (megajax's own core on
the CPU without attention dropout: tests/test_blocked_attention.py.)"""

from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import mesh_for, tiny_config
from helpers import tiered
from tolerances import BF16_ELEMENT, assert_close, assert_tree_close

from megajax.config import ConfigError
from megajax.core.attention import fused_attention
from megajax.core.fused_attention import fused_attention_core, implementation
from megajax.core.sharding import Layout
from megajax.tools.audit import audit
from megajax.training.step import make_trainer


def config(attention: str, **model):
    # hidden dropout stays on
    return tiny_config(attention_dropout=0.0, attention=attention, **model)


def loss_and_grads(cfg, spec):
    trainer = make_trainer(cfg, mesh_for(spec))
    params, _ = trainer.init_state(seed=0)
    batch = jax.device_put(
        trainer.task.synthetic_batch(cfg, cfg.train.batch_size, np.random.default_rng(0)),
        trainer.batch_sharding,
    )
    metrics, grads = jax.jit(trainer.gradients)(params, batch, jax.random.key(1))
    return jax.device_get((metrics["loss"], grads))


@pytest.mark.parametrize(
    "kind,spec", tiered([("gpt", "1x1"), ("gpt", "2x4"), ("bert", "2x4")], ("bert", "2x4"))
)
def test_fused_attention_matches_megajax_core(kind, spec):
    """Causal (GPT) and padding (BERT) masks; float32, so within F32 of each scale
    (tests/tolerances.py)."""
    model = {} if kind == "gpt" else {"kind": "bert"}
    want_loss, want = loss_and_grads(config("megajax", **model), spec)
    got_loss, got = loss_and_grads(config("fused", **model), spec)
    assert_close(got_loss, want_loss, what="loss")
    assert_tree_close(want, got, what="gradient")


def test_fused_attention_slides_the_window_as_megajax_core():
    """model.sliding_window through jax's local_window_size, against megajax's own mask."""
    want_loss, want = loss_and_grads(config("megajax", sliding_window=5), "2x4")
    got_loss, got = loss_and_grads(config("fused", sliding_window=5), "2x4")
    full_loss, _ = loss_and_grads(config("megajax"), "2x4")
    assert_close(got_loss, want_loss, what="loss")
    assert_tree_close(want, got, what="gradient")
    assert abs(float(full_loss) - float(want_loss)) > 1e-4  # the window changes the numbers


def test_fused_attention_adds_no_collective():
    def collectives(attention):
        r = audit(config(attention), mesh_for("2x4"))
        return r, Counter(
            (c.kind, c.axis, c.origin, c.direction, c.shape, c.count) for c in r.collectives
        )

    (fused, got), (_, want) = collectives("fused"), collectives("megajax")
    assert got == want
    assert fused.ratio == pytest.approx(1.0, abs=0.005)


def test_auto_picks_fused_only_on_gpus_without_attention_dropout():
    cpu = Layout(mesh_for("2x4"))
    assert not fused_attention(config("auto").model, cpu)  # CPU devices
    assert fused_attention(config("fused").model, cpu)
    assert not fused_attention(tiny_config(attention="megajax").model, cpu)
    with pytest.raises(ConfigError, match="attention_dropout=0"):
        # attention dropout 0.1
        tiny_config(attention="fused")


# The fused core's own choices: cuDNN's kernel asked for by name on GPUs (jax would give XLA's),
# its masks translated into its flag and bias, and XLA's attention where cuDNN refuses.


def reference_attention(q, k, v, key_mask, causal):
    """softmax(q k^T / sqrt(d) + masks) v by hand, float32, (b, heads, s, d)."""
    scores = np.einsum("bhqd,bhkd->bhqk", q, k) / np.sqrt(q.shape[-1])
    keep = np.ones(scores.shape, bool)
    if causal:
        keep &= np.tril(np.ones(scores.shape[-2:], bool))
    if key_mask is not None:
        keep &= key_mask[:, None, None, :]
    scores = np.where(keep, scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    return np.einsum("bhqk,bhkd->bhqd", p / p.sum(-1, keepdims=True), v)


def attention_inputs(seed=0, b=2, h=3, s=12, d=8):
    rng = np.random.default_rng(seed)
    q, k, v = (jnp.asarray(rng.standard_normal((b, h, s, d)), jnp.bfloat16) for _ in range(3))
    key_mask = np.ones((b, s), bool)
    key_mask[1, 7:] = False  # the second sequence padded after 7 tokens
    return q, k, v, key_mask


def test_fused_core_asks_gpus_for_cudnn_in_bf16_and_fp16_only():
    assert implementation(jnp.bfloat16, "gpu") == "cudnn"
    assert implementation(jnp.float16, "gpu") == "cudnn"
    assert implementation(jnp.float32, "gpu") == "xla"  # cuDNN's flash kernel takes no float32
    assert implementation(jnp.bfloat16, "cpu") == "xla"


@pytest.mark.parametrize("causal,padded", [(True, False), (False, True), (True, True)])
def test_cudnn_call_carries_the_masks(monkeypatch, causal, padded):
    """What cuDNN is handed (the causal flag, padding as a (b, 1, q, k) mask) computes the masked
    attention: here XLA's attention evaluates that very call, in float32, against a hand
    reference."""
    real, calls = jax.nn.dot_product_attention, []

    def as_cudnn_would(q, k, v, *, mask=None, is_causal=False, scale=None, implementation=None):
        calls.append((implementation, is_causal, None if mask is None else mask.shape))
        f32 = lambda t: t.astype(jnp.float32)  # noqa: E731
        return real(
            f32(q),
            f32(k),
            f32(v),
            mask=mask,
            is_causal=is_causal,
            scale=scale,
            implementation="xla",
        )

    monkeypatch.setattr(jax.nn, "dot_product_attention", as_cudnn_would)
    q, k, v, key_mask = attention_inputs()
    key_mask = key_mask if padded else None
    got = fused_attention_core(
        q, k, v, key_mask, causal=causal, scale=1 / np.sqrt(8), platform="gpu"
    )
    b, _, s, _ = q.shape
    assert calls == [("cudnn", causal, (b, 1, s, s) if padded else None)]
    f64 = lambda t: np.asarray(t, np.float64)  # noqa: E731
    assert_close(got, reference_attention(f64(q), f64(k), f64(v), key_mask, causal))


def test_where_cudnn_refuses_xla_attention_runs_with_a_warning():
    """Here (no cuDNN) the GPU path's call is refused while tracing: XLA's attention gives the
    same result, within bf16 rounding of its output (4 u of its scale)."""
    q, k, v, key_mask = attention_inputs(seed=1)
    with pytest.warns(UserWarning, match="XLA's attention runs instead"):
        got = fused_attention_core(
            q, k, v, key_mask, causal=True, scale=1 / np.sqrt(8), platform="gpu"
        )
    f64 = lambda t: np.asarray(t, np.float64)  # noqa: E731
    assert_close(got, reference_attention(f64(q), f64(k), f64(v), key_mask, True), tol=BF16_ELEMENT)
