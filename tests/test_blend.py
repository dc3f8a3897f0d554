"""Weighted blends of token corpora (megajax/data/blend.py): Megatron's blending rule checked by
hand and by its property (every prefix within one sample of the weights), batches that are a
function of (weights, sources, seed, step) on every mesh and across a resume, each component's
samples and validation loss in the record, epochs instead of running out, and the mistakes a
user can make, one line each."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import mesh_for
from helpers import losses, run

from megajax.config import load_config
from megajax.data.blend import BlendIndex, parse_blend
from megajax.errors import UserError
from megajax.specs import is_blend

SHAKESPEARE, WIKITEXT = "text:data/tinyshakespeare.txt", "text:data/wikitext-2/valid.txt"


def test_the_rule_by_hand():
    """0.3 / 0.7 (d = 1/2): sample n to the earliest deadline (c + 1/2) / w among the components
    at least 1/2 behind their share (ties to the first), worked out on paper for ten."""
    index = BlendIndex([0.3, 0.7])
    index.upto(10)
    assert index.component[:10].tolist() == [1, 0, 1, 1, 0, 1, 1, 1, 0, 1]
    assert index.sample[:10].tolist() == [0, 0, 1, 2, 1, 3, 4, 5, 2, 6]


@pytest.mark.parametrize("k,seed", [(2, 0), (3, 1), (4, 2), (7, 3)])
def test_every_prefix_is_within_one_sample_of_the_weights(k, seed):
    """Tijdeman's bound, 1 - 1/(2k - 2), over every prefix of 20,000 samples of random weights
    (uneven ones: a Dirichlet of 0.5); each component's samples taken in order, each once."""
    weights = np.random.default_rng(seed).dirichlet(np.full(k, 0.5))
    index = BlendIndex(weights)
    n = 20_000
    index.upto(n)
    counts = np.cumsum(np.eye(k, dtype=np.int64)[index.component[:n]], axis=0)
    expected = np.arange(1, n + 1)[:, None] * weights[None, :]
    assert np.abs(counts - expected).max() <= 1 - 1 / (2 * k - 2) + 1e-9
    for i in range(k):
        assert index.sample[:n][index.component[:n] == i].tolist() == list(range(counts[-1, i]))


def test_parsing_normalises_and_names_the_components():
    blend = parse_blend(f"3 {SHAKESPEARE} 1 {WIKITEXT} 1 text:data/wikitext-2/valid.txt")
    assert [c.weight for c in blend] == [0.6, 0.2, 0.2]
    assert [c.name for c in blend] == ["tinyshakespeare", "valid", "valid_2"]
    assert is_blend("0.5 builtin 0.5 text:x") and not is_blend("text:a b.txt")


@pytest.fixture(scope="module")
def blended_run(tmp_path_factory):
    """Six steps on a blend of Tiny Shakespeare and WikiText-2's validation split (a tiny
    component: about 3,000 windows of 17 tokens... many epochs of it)."""
    wd = tmp_path_factory.mktemp("blend") / "run"
    args = [
        *("--config", "tiny", "--mesh", "2x4", "--host-devices", "8", "--sample-tokens", "0"),
        *("--data", f"0.25 {SHAKESPEARE} 0.75 {WIKITEXT}", "--steps", "6", "--log-every", "1"),
        *("--save-every", "3", "--eval-every", "3", "--workdir", str(wd)),
        *("--set", "model.seq_len=16"),
    ]
    p = run(*args)
    return wd, args, p


def test_the_record_carries_each_components_samples_and_loss(blended_run):
    wd, _, p = blended_run
    cfg = load_config(str(wd / "config.json"))
    records = [json.loads(line) for line in (wd / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "loss" in r]
    b = cfg.train.batch_size
    for r in train:
        n = r["step"] * b
        got = (r["samples/tinyshakespeare"], r["samples/valid"])
        assert sum(got) == n and abs(got[0] - 0.25 * n) <= 1 and abs(got[1] - 0.75 * n) <= 1
    val = [r for r in records if "val_loss" in r]
    assert val and all(
        r["val_loss"]
        == pytest.approx(
            0.25 * r["val/tinyshakespeare/loss"] + 0.75 * r["val/valid/loss"], rel=1e-12
        )
        for r in val
    )
    assert "tinyshakespeare " in p.stdout and "samples" not in p.stderr


def test_batches_are_the_same_on_every_mesh(blended_run):
    """The rows of a step as one device builds them and as 2x4's shards do: bitwise."""
    import jax

    from megajax.tasks import task_for

    wd, _, _ = blended_run
    cfg = load_config(str(wd / "config.json"))
    data = task_for(cfg).load_data(cfg)
    got = {}
    for spec in ("1x1", "2x4"):
        mesh = mesh_for(spec)
        sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
        batches = data.batches("train", cfg, sharding)
        got[spec] = [np.asarray(batches(s)) for s in (0, 5, 1000)]
    for a, b in zip(got["1x1"], got["2x4"]):
        np.testing.assert_array_equal(a, b)


def test_a_small_component_starts_its_next_epoch(tmp_path):
    """A component of few windows is taken again in a new order, logged, never an IndexError."""
    small = tmp_path / "small.txt"
    small.write_text("a few words, " * 12)
    wd = tmp_path / "run"
    p = run(
        *("--config", "tiny", "--mesh", "1x1", "--sample-tokens", "0", "--steps", "3"),
        *("--data", f"0.5 {SHAKESPEARE} 0.5 text:{small}", "--set", "model.seq_len=16"),
        *("--workdir", str(wd), "--log-every", "1"),
    )
    assert "blend component small used all its" in p.stdout
    records = [json.loads(line) for line in (wd / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in records if "loss" in r][-1]
    assert last["epoch/small"] >= 1 and last["epoch/tinyshakespeare"] == 0


def test_resume_gives_the_straight_runs_losses_and_refuses_other_weights(blended_run, tmp_path):
    wd, args, _ = blended_run
    # the same six steps, stopped after three and resumed
    again = tmp_path / "again"
    first = [a if a != str(wd) else str(again) for a in args]
    run(*[a if a != "6" else "3" for a in first])
    run(*first)
    assert losses(again) == losses(wd)
    changed = [
        a if a != f"0.25 {SHAKESPEARE} 0.75 {WIKITEXT}" else f"0.5 {SHAKESPEARE} 0.5 {WIKITEXT}"
        for a in first
    ]
    changed = [a if a != "6" else "8" for a in changed]
    p = run(*changed, check=False)
    assert p.returncode == 2 and "was trained on data '0.25" in p.stderr
    assert p.stderr.count("\n") == 1


@pytest.mark.parametrize(
    "blend,words",
    [
        (f"0 {SHAKESPEARE} 1 {WIKITEXT}", "weights must be positive"),
        (f"-1 {SHAKESPEARE} 1 {WIKITEXT}", "weights must be positive"),
        (f"0.5 {SHAKESPEARE} 0.5", "a weight before each source"),
        (f"0.5 {SHAKESPEARE} x {WIKITEXT}", "is not a weight"),
        (f"0.5 {SHAKESPEARE} 0.5 text:missing.txt", "missing.txt"),
        (f"0.5 {SHAKESPEARE} 0.5 chat:data/chats.jsonl", "cannot be blended"),
    ],
)
def test_a_mistake_is_one_line(blend, words, tmp_path):
    p = run(
        *("--config", "tiny", "--mesh", "1x1", "--steps", "1", "--data", blend),
        *("--workdir", str(tmp_path / "run")),
        check=False,
    )
    assert p.returncode == 2 and words in p.stderr and p.stderr.count("\n") == 1, p.stderr
    assert not (tmp_path / "run").exists()


def test_parse_refuses_in_python_too():
    with pytest.raises(UserError, match="positive"):
        parse_blend(f"0 {SHAKESPEARE} 1 {WIKITEXT}")


@pytest.mark.full
def test_sigkill_and_resume_give_the_straight_runs_losses_bitwise(blended_run, tmp_path):
    """The blended run SIGKILLed after its step-3 checkpoint and resumed: its six losses are
    the uninterrupted run's, bitwise (the batches are a function of the step)."""
    from helpers import killed_after_checkpoint

    wd, args, _ = blended_run
    killed = tmp_path / "killed"
    again = [a if a != str(wd) else str(killed) for a in args]
    killed_after_checkpoint(again, killed, 3)
    assert "resuming from step" in run(*again).stdout
    assert losses(killed) == losses(wd)
