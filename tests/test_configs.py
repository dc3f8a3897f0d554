"""Every shipped config parses; the paper's models have the paper's sizes, computed abstractly."""

import re
from pathlib import Path

import jax
import pytest
from conftest import ROOT, mesh_for
from flax import nnx

from megajax.cli.convert import convert_parser
from megajax.cli.eval import eval_parser
from megajax.cli.prepare import prepare_parser
from megajax.cli.train import train_parser
from megajax.config import CONFIG_DIR, ConfigError, available_configs, load_config
from megajax.core.mesh import check_fits, padded_batches
from megajax.mesh_shape import MeshShape
from megajax.models.registry import abstract_model, init_model
from megajax.shapes import MODEL_TASKS
from megajax.tasks import TASKS, param_count, task_for
from megajax.training.loop import train
from megajax.training.step import make_trainer

PAPER = {
    "gpt2_355m": 355e6,
    "gpt2_1.2b": 1.2e9,
    "gpt2_2.5b": 2.5e9,
    "gpt2_4.2b": 4.2e9,
    "gpt2_8.3b": 8.3e9,
    "gpt2_8.3b_24h": 8.3e9,
}

PAPER_BERT = {"bert_336m": 336e6, "bert_1.3b": 1.3e9, "bert_3.9b": 3.9e9}


@pytest.mark.parametrize("name", available_configs())
def test_config_parses_and_builds_abstractly(name):
    cfg = load_config(name)
    model = abstract_model(cfg.model)  # shapes only: nothing allocated, even for 8.3B
    n = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert n == param_count(cfg)
    assert param_count(cfg.model) == n  # the ModelConfig alone too (what init_model takes)
    if name in PAPER:
        # Within 1% of the paper's name, except 1.2B: its exact count for the stated shape
        # (40 x 1536, vocab 51,200) is 1,213.5M, 1.1% above the two-digit label it rounds to.
        name_digits = f"{PAPER[name]:.2g}"
        assert abs(n - PAPER[name]) / PAPER[name] < 0.01 or f"{n:.2g}" == name_digits, (
            f"{name}: {n:,}"
        )
        assert cfg.model.seq_len == 1024 and cfg.model.padded_vocab == 51200
    if name in PAPER_BERT:
        assert abs(n - PAPER_BERT[name]) / PAPER_BERT[name] < 0.02, f"{name}: {n:,}"
        m = cfg.model
        assert (m.kind, m.task, m.ln_placement, m.seq_len, m.padded_vocab) == (
            "bert",
            "pretrain",
            "pre",
            512,
            30720,
        )


def test_paper_shapes():
    assert (
        load_config("gpt2_8.3b").model.num_heads,
        load_config("gpt2_8.3b_24h").model.num_heads,
    ) == (32, 24)
    shapes = {
        n: (c.num_layers, c.hidden, c.num_heads) for n in PAPER for c in [load_config(n).model]
    }
    assert shapes["gpt2_355m"] == (24, 1024, 16) and shapes["gpt2_1.2b"] == (40, 1536, 16)
    assert shapes["gpt2_2.5b"] == (54, 1920, 20) and shapes["gpt2_4.2b"] == (64, 2304, 24)
    assert shapes["gpt2_8.3b"] == (72, 3072, 32)
    bert = {
        n: (c.num_layers, c.hidden, c.num_heads) for n in PAPER_BERT for c in [load_config(n).model]
    }
    assert bert == {
        "bert_336m": (24, 1024, 16),
        "bert_1.3b": (24, 2048, 32),
        "bert_3.9b": (48, 2560, 40),
    }


# The paper's tables, (layers, hidden, heads): Table 1 is the scaling study, Table 2 the
# GPT-2 models of the WikiText-103 / LAMBADA runs, Table 4 the BERT models.
PAPER_TABLES = {
    1: {(40, 1536, 16), (54, 1920, 20), (64, 2304, 24), (72, 3072, 32)},
    2: {(24, 1024, 16), (54, 1920, 20), (72, 3072, 24)},
    4: {(24, 1024, 16), (24, 2048, 32), (48, 2560, 40)},
}


@pytest.mark.parametrize("name", [*PAPER, *PAPER_BERT])
def test_paper_configs_cite_the_table_that_lists_them(name):
    first_line = (CONFIG_DIR / f"{name}.toml").read_text().splitlines()[0]
    cited = {int(n) for n in re.findall(r"Tables? (\d)(?: and (\d))?", first_line)[0] if n}
    m = load_config(name).model
    assert cited and all((m.num_layers, m.hidden, m.num_heads) in PAPER_TABLES[t] for t in cited), (
        first_line
    )


@pytest.mark.parametrize("name", [*PAPER, *PAPER_BERT])
def test_paper_configs_use_megatrons_tanh_gelu(name):
    assert load_config(name).model.gelu == "tanh"


def test_vocab_padding_is_a_property_of_the_config():
    m = load_config("gpt2_355m").model
    assert m.padded_vocab == 51200
    for tp in (1, 2, 4, 8):
        # independent of tp, unlike Megatron's 128 x tp
        check_fits(load_config("gpt2_355m"), mesh_for(f"1x{tp}"), batch=False)


def test_overrides_are_typed_and_suggest_keys():
    cfg = load_config("tiny", ["model.num_layers=3", "train.lr=3e-4", "model.remat=true"])
    # true: the old boolean
    assert (cfg.model.num_layers, cfg.train.lr, cfg.model.remat) == (3, 3e-4, "full")
    # one override as a string
    assert load_config("tiny", "model.num_layers=3").model.num_layers == 3
    with pytest.raises(ConfigError, match="did you mean 'model.num_layers'"):
        load_config("tiny", ["model.num_layer=3"])
    with pytest.raises(ConfigError, match="expects int"):
        load_config("tiny", ["model.hidden=big"])
    with pytest.raises(ConfigError, match="expects true or false"):
        load_config("tiny", ["model.scan_layers=maybe"])
    with pytest.raises(ConfigError, match="model.remat must be none, selective or full"):
        load_config("tiny", ["model.remat=maybe"])
    with pytest.raises(ConfigError, match="no config named 'tinyy'; did you mean 'tiny'"):
        load_config("tinyy")


def test_a_config_changed_in_python_is_checked_as_a_file_is(tmp_path):
    """A notebook sets fields directly (cfg.train.lr = ...): the entry points validate again,
    so a value out of range or of the wrong type is the ConfigError a file's would be (it was
    trained on, or failed deep inside: a dropout of 2.0 overflowed the mask's uint32), a string
    is typed as --set types it, and a misspelt field is an AttributeError, not silently unused."""
    cfg = load_config("tiny")
    cfg.train.lr, cfg.model.remat = "3e-4", True
    assert (cfg.validate().train.lr, cfg.model.remat) == (3e-4, "full")
    with pytest.raises(
        AttributeError, match="'TrainConfig' object has no attribute 'learning_rate'"
    ):
        cfg.train.learning_rate = 1e-3
    mesh = mesh_for("1x1")
    for field, value, message in [
        ("train.steps", 0, "train.steps must be positive, got 0"),
        ("model.hidden_dropout", 2.0, r"model.hidden_dropout must be in \[0, 1\), got 2.0"),
        ("model.num_heads", [4], r"model.num_heads expects int, got \[4\]"),
        ("model.num_heads", 3, "model.hidden=64 is not divisible by model.num_heads=3"),
    ]:
        bad = load_config("tiny")
        section, name = field.split(".")
        setattr(getattr(bad, section), name, value)
        calls = [lambda: make_trainer(bad, mesh), lambda: train(bad, mesh, tmp_path / "w")]
        calls += [lambda: init_model(bad.model, mesh)] if section == "model" else []
        for call in calls:
            with pytest.raises(ConfigError, match=message):
                call()
    # not once trained
    with pytest.raises(ValueError, match="sample_tokens must be an integer >= 0"):
        train(load_config("tiny"), mesh, tmp_path / "w", sample_tokens=-1)
    assert not (tmp_path / "w").exists()


def test_a_config_path_that_is_not_a_config_file_says_so(tmp_path):
    """Before: "no config named '/etc/passwd'; available: ..." for a path, and a directory
    named x.toml was read as a file."""
    (tmp_path / "notes.txt").write_text("x")
    (tmp_path / "dir.toml").mkdir()
    for path, what in (
        (tmp_path / "notes.txt", "is not a .toml or .json file"),
        (tmp_path / "dir.toml", "is not a file"),
        (tmp_path / "gone.toml", "not found"),
        (tmp_path / "sub" / "tiny", "not found"),
    ):
        with pytest.raises(
            ConfigError, match=re.escape(f"config {path} {what} (give a name in configs/")
        ):
            load_config(str(path))


@pytest.mark.parametrize(
    "parser, argv",
    [
        (train_parser, ["--workdir", ""]),
        (train_parser, ["--config", " "]),
        (eval_parser, ["--workdir", ""]),
        (prepare_parser, ["", "--out", "x"]),
        (convert_parser, ["export", "--workdir", "w", "--out", ""]),
    ],
)
def test_an_empty_path_argument_is_refused(capsys, parser, argv):
    """An unset shell variable (`--workdir "$RUN"`): before, the default workdir, or the current
    directory, was used. Like every argument mistake, one `error:` line (argparse's usage block
    before it is gone: --help shows that)."""
    for args in (argv, ["--no-such-flag"]):
        with pytest.raises(SystemExit) as exit_:
            parser().parse_args(args)
        err = capsys.readouterr().err
        assert (
            exit_.value.code == 2
            and err.count("\n") == 1
            and err.startswith("error: ")
            and err.endswith(" --help)\n")
        )
        assert ("must not be empty (see " in err) == (args is argv), err


def test_a_tilde_the_shell_left_alone_is_the_home_directory(monkeypatch, tmp_path):
    """`--workdir=~/run` and quoted paths reach the program with the `~` in them: before, a
    folder named `~` was made in the current directory."""
    monkeypatch.setenv("HOME", str(tmp_path))
    args = train_parser().parse_args(
        [
            "--workdir=~/run",
            "--data",
            "text:~/a.txt,~/b.txt,c~.txt",
            "--tokenizer",
            "tiktoken:gpt2",
            "--config",
            "runs/~x.toml",
        ]
    )
    assert (args.workdir, args.data) == (
        f"{tmp_path}/run",
        f"text:{tmp_path}/a.txt,{tmp_path}/b.txt,c~.txt",
    )
    assert (args.tokenizer, args.config) == ("tiktoken:gpt2", "runs/~x.toml")
    args = prepare_parser().parse_args(
        ["~/docs/*.txt", "--out", "~", "--tokenizer", "hf:~/tok.json"]
    )
    assert (args.inputs, args.out, args.tokenizer) == (
        [f"{tmp_path}/docs/*.txt"],
        str(tmp_path),
        f"hf:{tmp_path}/tok.json",
    )


@pytest.mark.parametrize(
    "change,tp,message",
    [
        ({"num_heads": 6, "hidden": 96}, 4, "num_heads=6 is not divisible by the model axis (4)"),
        ({"hidden": 66, "num_heads": 2}, 4, "hidden=66"),
        ({"ffn_hidden": 250}, 4, "ffn_hidden=250"),
        (
            {"seq_len": 18, "sequence_parallel": "true"},
            4,
            "model.seq_len=18 is not divisible by the model axis (4)",
        ),
    ],
)
def test_indivisible_sizes(change, tp, message):
    cfg = load_config("tiny", [f"model.{k}={v}" for k, v in change.items()])
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_fits(cfg, mesh_for(f"1x{tp}"), batch=False)


@pytest.mark.parametrize(
    "override,message",
    [
        ("train.keep_checkpoints=0", "train.keep_checkpoints must be positive"),
        ("train.save_every=0", "train.save_every must be positive"),
        ("train.log_every=0", "train.log_every must be positive"),
        ("train.eval_every=0", "train.eval_every must be positive"),
        ("train.eval_batches=0", "train.eval_batches must be positive"),
        ("train.warmup_steps=-1", "train.warmup_steps must be 0 or more"),
        ("train.lr=inf", "train.lr must be a finite number"),
        ("train.lr=nan", "train.lr must be a finite number"),
        ("train.lr=0", "train.lr must be positive"),
        ("train.min_lr=1", "train.min_lr (1) must not exceed train.lr (0.003)"),
        ("train.grad_clip=-1", "train.grad_clip must be positive"),
        ("train.beta2=1.0", "train.beta2 must be in [0, 1)"),
        ("train.weight_decay=-0.1", "train.weight_decay must be 0 or more"),
        ("data.val_fraction=0", "data.val_fraction must be in (0, 1)"),
        ("data.val_fraction=1.5", "data.val_fraction must be in (0, 1)"),
        ("data.bin_dtype=int8", "data.bin_dtype must be uint16 or uint32"),
        ("model.ln_eps=0", "model.ln_eps must be positive"),
        # 0 in float32
        ("model.ln_eps=1e-60", "model.ln_eps must be a finite number in float32's range"),
        # inf in float32
        ("train.loss_scale=1e40", "train.loss_scale must be a finite number in float32's range"),
        ("train.loss_scale=8589934592", "train.loss_scale must be at most 2^32"),
        ("train.steps=2147483648", "train.steps must be below 2^31 (the run counts in int32)"),
        ("model.num_layers=1e11", "model.num_layers must be below 2^31"),
        (
            "model.compute_dtype=float8",
            "model.compute_dtype must be auto, float32, bfloat16, float16 or mixed, got 'float8'",
        ),
        ("model.num_layers=2.5e0", "model.num_layers expects int, got '2.5e0'"),
        ("model.hidden_dropout=1.0", "model.hidden_dropout must be in [0, 1)"),
        ("model.recompute_norm_gelu=sometimes", "model.recompute_norm_gelu expects true or false"),
    ],
)
def test_every_value_is_range_checked(override, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config("tiny", [override])


def test_integers_written_as_floats_are_accepted_when_integral():
    assert load_config("tiny", ["train.steps=1e3", "model.num_layers=3.0e0"]).train.steps == 1000


@pytest.mark.parametrize(
    "name,content,message",
    [
        ("num.toml", "model = 3\n", "[model] must be a table of keys, got 3"),
        ("loop.toml", 'base = "LOOP"\n', "base chain loops"),
        ("latin.toml", "# caf\xe9\n".encode("latin-1"), "not UTF-8 (byte 5)"),
        ("list.json", "[1, 2]", "expected a table of sections at the top, got list"),
        ("basenum.toml", "base = 3\n", "base must be a config name, got 3"),
    ],
)
def test_malformed_config_files(tmp_path, name, content, message):
    path = tmp_path / name
    if isinstance(content, str):
        content = content.replace("LOOP", str(path)).encode()
    path.write_bytes(content)
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(str(path))


def test_eval_batches_are_no_larger_than_the_rows_need():
    """A huge --batch-size over a few rows is one batch of those rows (rounded up to the data
    axis), not an allocation of the batch size."""
    batches = list(padded_batches(5, 10**12, MeshShape(data=2)))
    assert (
        len(batches) == 1
        and batches[0][0].tolist() == [0, 1, 2, 3, 4, 4]
        and batches[0][1].tolist() == [1] * 5 + [0]
    )
    assert [idx.tolist() for idx, _ in padded_batches(5, 3, MeshShape(data=2))] == [
        [0, 1],
        [2, 3],
        [4, 4],
    ]


def test_batch_not_divisible_by_data_axis():
    with pytest.raises(
        ConfigError, match=r"global batch 8 is not divisible by the data axis \(3\)"
    ):
        check_fits(load_config("tiny"), mesh_for("3x1"))


def test_every_model_head_has_exactly_one_task():
    """The (model.kind, model.task) pairs a config may name are the tasks the registry has."""
    assert sorted((t.kind, t.model_task) for t in TASKS.values()) == sorted(
        (kind, task) for kind, tasks in MODEL_TASKS.items() for task in tasks
    )
    for name in available_configs():
        cfg = load_config(name)
        assert (task_for(cfg).kind, task_for(cfg).model_task) == (cfg.model.kind, cfg.model.task)


def test_a_shipped_configs_data_is_found_from_any_directory(tmp_path, monkeypatch):
    """configs/shakespeare_char.toml names data/tinyshakespeare.txt, the repository's: from
    another working directory it is still that file, not one beside the caller."""
    from megajax.specs import DataSpec

    monkeypatch.chdir(tmp_path)
    spec = DataSpec.of(load_config("shakespeare_char").data.source)
    assert spec.kind == "text" and Path(spec.arg) == ROOT / "data" / "tinyshakespeare.txt"
    (tmp_path / "mine.toml").write_text('[data]\nsource = "text:data/x.txt"\n')
    assert load_config(str(tmp_path / "mine.toml")).data.source == "text:data/x.txt"  # a user's
