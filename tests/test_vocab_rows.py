"""Any workdir on any mesh whose axes divide the heads: the vocabulary keeps model.padded_vocab
rows in a checkpoint, and a model axis that does not divide them (3, 6 here, with the default
vocab_multiple of 1024) holds a few zero rows more (megajax/models/vocab_rows.py). Against one
device: the same weights, logits and losses."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import mesh_for, tiny_config
from helpers import RUN_ARGS, SHAKESPEARE, cli, losses, run
from tolerances import F32, assert_close

from megajax.mesh_shape import MeshShape
from megajax.models.registry import ModelDef, init_model

# six heads: a model axis of 3 or 6 divides them, and hidden and ffn; not the 1024 vocabulary rows
SIX_HEADS = ["--set", "model.num_heads=6", "--set", "model.hidden=96"]


def test_the_rows_a_model_axis_holds():
    m = dataclasses.replace(tiny_config().model, vocab_size=1000, vocab_multiple=1024)
    assert m.padded_vocab == 1024
    assert [m.vocab_rows(MeshShape(model=tp)) for tp in (1, 2, 3, 4, 6, 7, 8)] == [
        1024,
        1024,
        1026,
        1024,
        1026,
        1029,
        1024,
    ]


@pytest.mark.parametrize("kind", ["gpt", "bert"])
def test_a_model_axis_of_six_holds_one_devices_weights_and_logits(kind):
    """The same seed's weights on 1x6 as on 1x1 (the rows past padded_vocab zeros), and the
    same logits over the vocabulary."""
    cfg = tiny_config(
        num_heads=6,
        hidden=96,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        kind=kind,
        **({"ln_placement": "pre"} if kind == "bert" else {}),
    ).model
    one, six = (init_model(cfg, mesh_for(mesh), seed=3) for mesh in ("1x1", "1x6"))
    a, b = (jax.device_get(ModelDef(m).params(m)) for m in (one, six))
    table, padded = b["embed"]["table"], cfg.padded_vocab
    assert (
        table.shape[0] == cfg.vocab_rows(MeshShape(model=6)) > padded
        and not np.asarray(table[padded:]).any()
    )
    np.testing.assert_array_equal(np.asarray(table[:padded]), np.asarray(a["embed"]["table"]))
    if kind == "gpt":
        tokens = jnp.asarray(
            np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 16)), jnp.int32
        )
        v = cfg.vocab_size
        logits = jax.jit(lambda m, x: m(x)[..., :v])
        assert_close(np.asarray(logits(six, tokens)), np.asarray(logits(one, tokens)), F32)


def test_a_workdir_trained_on_two_runs_on_three_and_six(tmp_path):
    """Trained on 1x2, evaluated on 1x6 (the perplexity of 1x1), resumed on 1x3 (the losses of a
    run that never moved), and what 1x3 saved holds the padded_vocab rows every checkpoint holds
    (1x3 held one row more)."""
    common = [*RUN_ARGS, *SIX_HEADS, "--save-every", "3", "--set", "train.decay_steps=6"]
    straight, moved = tmp_path / "straight", tmp_path / "moved"
    run(*common, "--mesh", "1x2", "--host-devices", 2, "--steps", "6", "--workdir", straight)
    run(*common, "--mesh", "1x2", "--host-devices", 2, "--steps", "3", "--workdir", moved)
    p = run(*common, "--mesh", "1x3", "--host-devices", 3, "--steps", "6", "--workdir", moved)
    assert "resuming from step 3" in p.stdout and "model=3" in p.stdout
    ref, got = losses(straight), losses(moved)
    assert sorted(got) == list(range(1, 7))
    for s in range(1, 7):  # two legs on two meshes, each within float32's mesh bound
        assert got[s] == pytest.approx(ref[s], rel=2 * F32), s
    text = tmp_path / "play.txt"
    text.write_text("ROMEO:\nBut soft, what light through yonder window breaks?\n" * 20)
    ppl = {}
    for mesh, devices in (("1x1", 1), ("1x6", 6)):
        e = cli(
            "eval",
            "--workdir",
            moved,
            "--task",
            "ppl",
            "--data",
            text,
            "--mesh",
            mesh,
            "--host-devices",
            devices,
            "--out",
            tmp_path / f"{mesh}.json",
        )
        assert e.returncode == 0, e.stderr
        ppl[mesh] = json.loads((tmp_path / f"{mesh}.json").read_text())
    assert ppl["1x6"]["ppl"] == pytest.approx(ppl["1x1"]["ppl"], rel=2 * F32)
    from megajax.runs.checkpoint import Checkpoints

    ckpts = Checkpoints(moved, writer=False)
    saved = ckpts.manager.item_metadata(6)["params"]
    ckpts.close()
    from megajax.config import load_config

    padded = load_config(str(moved / "config.json")).model.padded_vocab
    assert padded % 3 and saved["embed"]["table"].shape == (padded, 96)


@pytest.mark.full
def test_bert_on_a_model_axis_of_three_trains_as_on_one_device(tmp_path):
    """BERT's MLM bias has the vocabulary's rows too: three steps on 1x3 log the losses of 1x1."""
    common = [
        "--config",
        "bert_tiny",
        "--data",
        f"text:{SHAKESPEARE}",
        "--tokenizer",
        "wordpiece:200",
        "--sample-tokens",
        "0",
        "--log-every",
        "1",
        "--steps",
        "3",
        *SIX_HEADS,
    ]
    a = run(*common, "--mesh", "1x1", "--host-devices", 1, "--workdir", tmp_path / "one")
    b = run(*common, "--mesh", "1x3", "--host-devices", 3, "--workdir", tmp_path / "three")
    assert "model=3" in b.stdout and a.returncode == 0
    one, three = losses(tmp_path / "one"), losses(tmp_path / "three")
    for s in (1, 2, 3):
        assert three[s] == pytest.approx(one[s], rel=2 * F32), s
