"""The CPU's attention core without attention dropout (megajax/core/blocked_attention.py): a few
(batch, head) pairs at a time, keeping no probabilities. Equal to autodiff of the plain formula
for every way of cutting the pairs into blocks, with causal and padding masks and a query
that may attend to nothing; it keeps what it claims; and in the models it gives the numbers
and the collectives of the core that keeps the probabilities."""

import dataclasses
import math
import re
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import mesh_for, tiny_config
from helpers import tiered
from jax import ad_checkpoint
from tolerances import assert_close, assert_tree_close

from megajax.core import attention as attention_module
from megajax.core import blocked_attention as blocked_module
from megajax.core.blocked_attention import _blocks, blocked_attention, blocked_attention_pays
from megajax.tools.audit import audit
from megajax.training.step import make_trainer

RNG = np.random.default_rng(0)


def plain_attention(q, k, v, key_mask, causal, scale, window=0):
    keep = jnp.ones((1, 1, 1, 1), bool)
    if causal:
        keep = keep & (jnp.arange(q.shape[2])[:, None] >= jnp.arange(q.shape[2])[None, :])
    if window:
        keep = keep & (jnp.arange(q.shape[2])[:, None] - jnp.arange(q.shape[2])[None, :] < window)
    if key_mask is not None:
        keep = keep & key_mask[:, None, None, :]
    s = jnp.where(keep, jnp.einsum("bhqd,bhkd->bhqk", q, k) * scale, jnp.finfo(jnp.float32).min)
    return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, axis=-1), v)


def grads(f, q, k, v):
    """Gradients of a random projection of f's output (every output element weighs in), compiled
    as a train step compiles them (one program, not one per operation)."""
    w = jnp.asarray(np.random.default_rng(1).normal(size=q.shape), jnp.float32)
    return jax.jit(jax.grad(lambda *a: (f(*a) * w).sum(), argnums=(0, 1, 2)))(q, k, v)


@pytest.mark.parametrize(
    "shape,ways,block_bytes,blocks",
    [
        ((2, 3, 24, 16), (1, 1), 1 << 30, (1, 1)),  # one block
        ((2, 3, 24, 16), (1, 1), 1, (2, 3)),  # one pair per block: 3 heads do not pair
        (
            (4, 4, 16, 8),
            (2, 1),
            8 * 16 * 16 * 4,
            (1, 1),
        ),  # a device's 2 x 4 pairs, all in one block
        # 4 x 2 pairs a device, 4 a block: batch rows
        ((8, 4, 16, 8), (2, 2), 4 * 16 * 16 * 4, (2, 1)),
        ((2, 8, 16, 8), (1, 2), 2 * 16 * 16 * 4, (2, 2)),  # 2 x 4 a device, 2 a block: heads
    ],
)
@pytest.mark.parametrize("causal,padding", [(True, True), (False, True), (True, False)])
@pytest.mark.parametrize("query_tile", tiered([256, 10], 10), ids=["one_tile", "tiles_of_10"])
def test_blocked_attention_matches_autodiff_of_the_plain_formula(
    shape, ways, block_bytes, blocks, causal, padding, query_tile, monkeypatch
):
    """The blocks chosen (checked against the hand count) and the numbers, for every cut, with
    the queries in one tile or (causal, no key mask) in tiles of 10, the last one shorter; padding
    leaves sequence 1 no key at all, so its queries attend to every key uniformly."""
    monkeypatch.setattr(blocked_module, "BLOCK_BYTES", block_bytes)
    monkeypatch.setattr(blocked_module, "QUERY_TILE", query_tile)
    assert _blocks(shape, ways) == blocks
    q, k, v = (jnp.asarray(RNG.normal(size=shape), jnp.float32) for _ in range(3))
    key_mask = jnp.asarray(RNG.random(shape[::2]) > 0.3).at[1].set(False) if padding else None
    ours = lambda q, k, v: blocked_attention(
        q, k, v, key_mask, causal=causal, scale=0.25, ways=ways
    )  # noqa: E731
    plain = lambda q, k, v: plain_attention(q, k, v, key_mask, causal, 0.25)  # noqa: E731
    assert_close(jax.jit(ours)(q, k, v), jax.jit(plain)(q, k, v), what="forward")
    assert_tree_close(grads(plain, q, k, v), grads(ours, q, k, v), what="gradients")


@pytest.mark.parametrize("query_tile", [256, 10])
def test_a_sliding_window_in_blocks_and_tiles(query_tile, monkeypatch):
    """A window of 5 positions over 24 (Mistral's, in small), in one tile of queries or three:
    the plain formula's numbers and gradients."""
    monkeypatch.setattr(blocked_module, "QUERY_TILE", query_tile)
    q, k, v = (jnp.asarray(RNG.normal(size=(2, 4, 24, 8)), jnp.float32) for _ in range(3))
    ours = lambda q, k, v: blocked_attention(q, k, v, None, causal=True, scale=0.25, window=5)  # noqa: E731
    plain = lambda q, k, v: plain_attention(q, k, v, None, True, 0.25, window=5)  # noqa: E731
    assert_close(jax.jit(ours)(q, k, v), jax.jit(plain)(q, k, v), what="forward")
    assert_tree_close(grads(plain, q, k, v), grads(ours, q, k, v), what="gradients")


def test_blocks_follow_the_block_size_and_stay_whole_on_each_device():
    """Hand counts at 8 MiB: s 512 is 1 MiB a pair, so 8 pairs a block; s 1024 is 4 MiB, so 2; s
    4096 is 64 MiB, still 2 (one pair alone ran slower); a device with one pair has one block."""
    assert _blocks((8, 8, 512, 64), (1, 1)) == (8, 1)  # 8 blocks of one sequence's 8 heads
    assert _blocks((16, 16, 512, 64), (2, 4)) == (4, 1)  # 8 x 4 a device: 2 sequences a block
    assert _blocks((2, 16, 1024, 64), (1, 4)) == (2, 2)  # 2 x 4 a device: 2 heads a block
    assert _blocks((1, 8, 4096, 64), (1, 1)) == (1, 4)
    assert _blocks((2, 8, 512, 64), (2, 8)) == (1, 1)


def test_blocked_attention_keeps_q_k_v_its_output_and_two_numbers_a_query(capsys):
    q, k, v = (jnp.asarray(RNG.normal(size=(2, 3, 24, 16)), jnp.float32) for _ in range(3))
    key_mask = jnp.asarray(RNG.random((2, 24)) > 0.3)
    capsys.readouterr()
    ad_checkpoint.print_saved_residuals(
        lambda *a: blocked_attention(*a, key_mask, causal=True, scale=0.25).sum(), q, k, v
    )
    saved = sorted(
        line.split(" ")[0] for line in capsys.readouterr().out.splitlines() if "[" in line
    )
    # one block (1 x 3 pairs of 2.3 KiB): the row statistics as (blocks, pairs a block, q)
    assert saved == sorted(["f32[2,3,24,16]"] * 4 + ["bool[2,24]"] + ["f32[1,6,24]"] * 2), saved


def test_blocked_attention_is_the_cpus_float32_core_for_scores_larger_than_a_block(monkeypatch):
    q = jnp.zeros((2, 4, 64, 8))  # 2 x 4 x 64 x 64 float32 scores: 128 KiB
    monkeypatch.setattr(blocked_module, "BLOCK_BYTES", 64 << 10)
    assert blocked_attention_pays(q) == (jax.default_backend() == "cpu")
    assert not blocked_attention_pays(q, ways=(2, 1))  # 64 KiB on each device
    assert not blocked_attention_pays(q.astype(jnp.bfloat16))
    monkeypatch.setattr(blocked_module, "BLOCK_BYTES", 128 << 10)
    assert not blocked_attention_pays(q)


def loss_grads_and_residuals(cfg, spec, capsys):
    trainer = make_trainer(cfg, mesh_for(spec))
    params, _ = trainer.init_state(seed=0)
    batch = jax.device_put(
        trainer.task.synthetic_batch(cfg, cfg.train.batch_size, np.random.default_rng(0)),
        trainer.batch_sharding,
    )
    metrics, grads = jax.jit(trainer.gradients)(params, batch, jax.random.key(1))
    capsys.readouterr()
    ad_checkpoint.print_saved_residuals(
        lambda p: trainer.loss_fn(p, batch, jax.random.key(1)), params
    )
    saved = [line.split(" ")[0] for line in capsys.readouterr().out.splitlines() if "[" in line]
    return jax.device_get((metrics["loss"], grads)), saved


@pytest.mark.parametrize(
    "kind,spec,scan",
    tiered(
        [("gpt", "1x1", False), ("gpt", "1x1", True), ("bert", "2x4", True)], ("gpt", "1x1", True)
    ),
)
def test_models_get_the_same_numbers_and_keep_no_probabilities(
    kind, spec, scan, monkeypatch, capsys
):
    """GPT (causal, queries in tiles) unrolled and scanned, BERT (padding) scanned on 2x4: loss and
    gradients equal to those through the core that keeps the probabilities, and none of the (b,
    heads, s, s) arrays (stacked per layer when scanned) that that core keeps for the backward
    pass."""
    cfg = tiny_config(
        attention_dropout=0.0, scan_layers=scan, **({} if kind == "gpt" else {"kind": "bert"})
    )
    s = cfg.model.seq_len
    # GPT: 3 tiles of queries, the last short
    monkeypatch.setattr(blocked_module, "QUERY_TILE", s // 2 - 1)
    monkeypatch.setattr(blocked_module, "BLOCK_BYTES", 1)  # blocked, 2 pairs a block
    scores_size = cfg.train.batch_size * cfg.model.num_heads * s * s

    def probs(shape: str) -> bool:
        """A (b, heads, s, s) float32 array, or a stack of them (not, say, row statistics that
        happen to end in (pairs a block, s) with as many pairs as queries)."""
        m = re.fullmatch(r"f32\[([\d,]+)\]", shape)
        dims = [int(d) for d in m.group(1).split(",")] if m else []
        return dims[-2:] == [s, s] and math.prod(dims) >= scores_size

    (got_loss, got), saved = loss_grads_and_residuals(cfg, spec, capsys)
    monkeypatch.setattr(attention_module, "blocked_attention_pays", lambda q, ways: False)
    (want_loss, want), reference_saved = loss_grads_and_residuals(cfg, spec, capsys)
    assert any(map(probs, reference_saved)) and not any(map(probs, saved)), saved
    assert_close(got_loss, want_loss, what="loss")
    assert_tree_close(want, got, what="gradient")


def test_blocked_attention_adds_no_collective(monkeypatch):
    """On 2x4 the blocks span every device's own pairs: the same collectives as the core that
    keeps the probabilities."""
    cfg = tiny_config(attention_dropout=0.0)
    monkeypatch.setattr(blocked_module, "BLOCK_BYTES", 1)
    collectives = lambda: Counter(
        (
            c.kind,
            c.axis,
            c.origin,
            c.direction,
            c.shape,  # noqa: E731
            c.count,
        )
        for c in audit(cfg, mesh_for("2x4")).collectives
    )
    got = collectives()
    monkeypatch.setattr(attention_module, "blocked_attention_pays", lambda q, ways: False)
    assert got == collectives()


@pytest.mark.parametrize(
    "train,model",
    tiered(
        [({"shard_params": True}, {}), ({}, {"sequence_parallel": True})],
        ({}, {"sequence_parallel": True}),
    ),
    ids=["fsdp", "sequence_parallel"],
)
def test_blocked_attention_with_fsdp_and_sequence_parallelism(train, model, monkeypatch):
    """GPT on 2x4 with FSDP (inside its data-manual shard_map the batch is each device's own
    rows) and with sequence parallelism: the plain core's loss and gradients."""
    cfg = tiny_config(attention_dropout=0.0, **model)
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, **train)).validate()
    monkeypatch.setattr(blocked_module, "BLOCK_BYTES", 1)

    def loss_and_grads():
        trainer = make_trainer(cfg, mesh_for("2x4"))
        params, _ = trainer.init_state(seed=0)
        batch = jax.device_put(
            trainer.task.synthetic_batch(cfg, cfg.train.batch_size, np.random.default_rng(0)),
            trainer.batch_sharding,
        )
        metrics, grads = jax.jit(trainer.gradients)(params, batch, jax.random.key(1))
        return jax.device_get((metrics["loss"], grads))

    calls = []
    monkeypatch.setattr(
        attention_module,
        "blocked_attention",
        lambda *a, **k: calls.append(k["ways"]) or blocked_module.blocked_attention(*a, **k),
    )
    got_loss, got = loss_and_grads()
    assert set(calls) == {(1, 4) if train else (2, 4)}
    monkeypatch.setattr(attention_module, "blocked_attention_pays", lambda q, ways: False)
    want_loss, want = loss_and_grads()
    assert_close(got_loss, want_loss, what="loss")
    assert_tree_close(want, got, what="gradient")
