"""Hugging Face checkpoints in and out (megajax/convert/), against `transformers` itself.

The fixtures in tests/fixtures/hf/ were made by tests/make_hf_fixtures.py (run by hand with
PyTorch and transformers): tiny random GPT2LMHeadModel, BertForPreTraining and
MegatronBertForPreTraining directories, each with the outputs transformers computed for fixed
inputs. Here, without PyTorch, each is imported, loaded on several meshes and run, exported,
and imported again.
"""

import json
import shutil
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import HF_IMPORT_SETTINGS, ROOT, handles_signal, mesh_for
from helpers import HF_FIXTURES, cli, hf_reference
from safetensors.numpy import load_file
from tolerances import F32, assert_close

from megajax.config import load_config
from megajax.convert import export_hf, import_hf
from megajax.core.loss import vocab_parallel_cross_entropy
from megajax.models.generate import generate
from megajax.models.registry import ModelDef
from megajax.runs.checkpoint import Checkpoints
from megajax.runs.workdir import load_workdir
from megajax.training.loop import train

FIXTURES = HF_FIXTURES
NAMES = ("gpt2", "bert", "megatron_bert")
SAMPLE = "A single man, in want of a WATERY fortune: 42 foxes!"  # as in make_hf_fixtures.py
IMPORT_SETTINGS = HF_IMPORT_SETTINGS  # float32; the padded rows (300 -> 384) on every mesh


@pytest.fixture(scope="module")
def imported(hf_imported):
    return {name: hf_imported[name] for name in NAMES}


reference = hf_reference


def flat_params(workdir, mesh_spec="1x1"):
    loaded = load_workdir(workdir, mesh_for(mesh_spec))
    params = ModelDef(loaded.model).params(loaded.model)
    return {
        jax.tree_util.keystr(p): np.asarray(x)
        for p, x in jax.tree_util.tree_flatten_with_path(params)[0]
    }


def test_configs_come_from_the_hf_config(imported):
    gpt, bert, megatron = (imported[n][0].model for n in NAMES)
    assert (
        gpt.kind,
        gpt.ln_placement,
        gpt.gelu,
        gpt.num_layers,
        gpt.hidden,
        gpt.num_heads,
        gpt.ffn,
        gpt.seq_len,
        gpt.vocab_size,
        gpt.padded_vocab,
        gpt.ln_eps,
    ) == ("gpt", "pre", "tanh", 2, 32, 8, 128, 32, 300, 384, 1e-5)
    assert (bert.ln_placement, bert.gelu, bert.ffn, bert.ln_eps) == ("post", "exact", 72, 1e-12)
    # its padded rows
    assert megatron.ln_placement == "pre" and megatron.vocab_size == bert.vocab_size + 36


@pytest.mark.parametrize("mesh_spec", ["1x1", "2x4", "1x8"])
def test_gpt2_outputs_equal_transformers(imported, mesh_spec):
    cfg, workdir = imported["gpt2"]
    model, ref, v = (
        load_workdir(workdir, mesh_for(mesh_spec)).model,
        reference("gpt2"),
        cfg.model.vocab_size,
    )
    ids = jnp.asarray(ref["ids"])
    logits = np.asarray(jax.jit(lambda m, t: m(t))(model, ids))
    assert_close(logits[..., :v], ref["logits"], F32, what="logits")
    assert np.all(np.isneginf(logits[..., v:]) | (logits[..., v:] < -1e30)), (
        "padded vocabulary rows must be masked"
    )
    assert_close(
        jax.jit(lambda m, t: m.hidden_states(t))(model, ids),
        ref["hidden"],
        F32,
        what="hidden states",
    )
    # The fused vocab-parallel cross-entropy on the imported weights equals the loss of HF's logits.
    losses = jax.jit(
        lambda m, t: vocab_parallel_cross_entropy(
            m.embed.attend(m.hidden_states(t[:, :-1])), t[:, 1:], m.layout, v
        )
    )(model, ids)
    want = -np.take_along_axis(
        jax.nn.log_softmax(ref["logits"][:, :-1]), ref["ids"][:, 1:, None], -1
    )[..., 0]
    assert_close(losses, want, F32, what="token losses")


@pytest.mark.parametrize("name", ["bert", "megatron_bert"])
@pytest.mark.parametrize("mesh_spec", ["1x1", "2x4", "1x8"])
def test_bert_outputs_equal_transformers(imported, name, mesh_spec):
    cfg, workdir = imported[name]
    model, ref, v = (
        load_workdir(workdir, mesh_for(mesh_spec)).model,
        reference(name),
        cfg.model.vocab_size,
    )

    @jax.jit
    def outputs(m, ids, types, mask):
        h = m.hidden_states(ids, types, mask)
        return (
            h,
            m.mlm_logits(h, jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)),
            m.sop(m.pooled(h)),
        )

    h, mlm, sentence = outputs(model, *(jnp.asarray(ref[k]) for k in ("ids", "types", "mask")))
    assert_close(h, ref["hidden"], F32, what="hidden states")
    assert_close(np.asarray(mlm)[..., :v], ref["mlm_logits"], F32, what="MLM logits")
    assert_close(
        sentence, ref["sentence_logits"], F32, what="next-sentence logits on the sentence head"
    )


def test_greedy_generation_equals_transformers(imported):
    model, ref = load_workdir(imported["gpt2"][1], mesh_for("2x4")).model, reference("gpt2")
    got = generate(model, ref["prompt"], ref["greedy"].shape[1], temperature=0.0)
    np.testing.assert_array_equal(got, ref["greedy"])


@pytest.mark.parametrize(
    "name,kind", [("gpt2", "hf"), ("bert", "wordpiece"), ("megatron_bert", "hf")]
)
def test_tokenizers_encode_as_transformers(imported, name, kind):
    """vocab.json + merges.txt (rebuilt as a fast byte-level BPE), vocab.txt with its lower-casing,
    tokenizer.json (cased): the same ids as HF's own tokenizer for the same text."""
    tokenizer = load_workdir(imported[name][1], mesh_for("1x1")).tokenizer
    assert tokenizer.kind == kind
    assert tokenizer.encode(SAMPLE) == reference(name)["sample_ids"].tolist()


def resaved_on(mesh_spec: str, workdir, dest):
    """The imported workdir's weights loaded split over `mesh_spec` and saved from there, as a
    training run on that mesh would have: the checkpoint's arrays are sharded."""
    shutil.copytree(workdir, dest, ignore=shutil.ignore_patterns("checkpoints"))
    loaded = load_workdir(workdir, mesh_for(mesh_spec))
    params = ModelDef(loaded.model).params(loaded.model)
    assert len(jax.tree.leaves(params)[0].sharding.device_set) == 8
    ckpts = Checkpoints(dest, async_save=False)
    assert ckpts.save(7, params, {"mu": params}, {"step": 7}) is None
    ckpts.close()
    return dest


@pytest.mark.parametrize("name", NAMES)
def test_export_is_the_original_bitwise_and_reimports(imported, name, tmp_path):
    cfg, workdir = imported[name]
    source = resaved_on("2x4", workdir, tmp_path / "trained")
    notes = export_hf(source, tmp_path / "out")
    assert "step 7" in notes[0] and len(notes) == 1
    original, exported = (
        load_file(FIXTURES / name / "model.safetensors"),
        load_file(tmp_path / "out" / "model.safetensors"),
    )
    assert sorted(exported) == sorted(original)
    for key, x in original.items():
        assert exported[key].dtype == x.dtype and np.array_equal(exported[key], x), key
    hf_in, hf_out = (
        json.loads((d / "config.json").read_text()) for d in (FIXTURES / name, tmp_path / "out")
    )
    assert hf_out["architectures"] == hf_in["architectures"]
    assert {k: hf_out[k] for k in hf_out if k in hf_in and k != "transformers_version"} == {
        k: hf_in[k] for k in hf_out if k in hf_in and k != "transformers_version"
    }
    import_hf(tmp_path / "out", tmp_path / "again", IMPORT_SETTINGS)
    first, second = flat_params(workdir), flat_params(tmp_path / "again")
    assert first.keys() == second.keys()
    assert all(np.array_equal(first[k], second[k]) for k in first)
    assert load_config(str(tmp_path / "again" / "config.json")).model == cfg.model


def test_scanned_and_unrolled_imports_hold_the_same_weights(imported, tmp_path):
    import_hf(
        FIXTURES / "gpt2", tmp_path / "unrolled", [*IMPORT_SETTINGS, "model.scan_layers=false"]
    )
    scanned, unrolled = flat_params(imported["gpt2"][1]), flat_params(tmp_path / "unrolled")
    for key, x in unrolled.items():
        if "['layers']['layers']" in key:
            i = int(key.split("['layers']['layers']['")[1].split("']")[0])
            stacked = key.replace(f"['layers']['layers']['{i}']", "['layers']['stacked']")
            assert np.array_equal(scanned[stacked][i], x), key
        else:
            assert np.array_equal(scanned[key], x), key


@pytest.mark.full
def test_training_starts_from_an_imported_gpt2(imported, tmp_path):
    """--init-from an imported model: every tensor is taken, on a mesh of its own."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(SAMPLE * 200)
    cfg = load_config(
        "tiny",
        [
            f"train.init_from={imported['gpt2'][1]}",
            f"data.source=text:{corpus}",
            "data.tokenizer=bytes",
            "train.steps=2",
            "train.eval_every=2",
            "train.save_every=2",
            "train.log_every=1",
            "train.eval_batches=1",
        ],
    )
    lines = []
    result = train(cfg, mesh_for("2x2"), tmp_path / "run", out=lines.append, sample_tokens=0)
    assert any("new: nothing" in str(line) for line in lines), lines
    assert result.final_step == 2
    assert load_config(str(tmp_path / "run" / "config.json")).model.hidden == 32
    # the imported model's
    assert load_workdir(tmp_path / "run", mesh_for("1x1")).tokenizer.kind == "hf"


def test_exporting_a_bytes_tokenizer_run_warns_a_python_caller(tmp_path):
    """A bytes tokenizer has no Hugging Face file: export_hf says so (a warning, which
    megajax-convert prints as a note), it does not silently leave it out."""
    from megajax.convert.hf import ExportNote

    cfg = load_config("tiny", ["train.steps=1", "model.num_layers=1"])
    train(cfg, mesh_for("1x1"), tmp_path / "run", out=None, sample_tokens=0)
    with pytest.warns(ExportNote, match="'bytes' tokenizer has no Hugging Face file"):
        notes = export_hf(tmp_path / "run", tmp_path / "out")
    assert any("no Hugging Face file" in n for n in notes)
    assert sorted(f.name for f in (tmp_path / "out").iterdir()) == [
        "config.json",
        "model.safetensors",
    ]


def convert(*argv) -> tuple[int, str]:
    p = cli("convert", *argv)
    return p.returncode, p.stderr


def copy_fixture(name, dest, drop=(), config=None):
    shutil.copytree(FIXTURES / name, dest)
    for f in drop:
        (dest / f).unlink()
    if config:
        hf = json.loads((dest / "config.json").read_text())
        (dest / "config.json").write_text(json.dumps({**hf, **config}))
    return dest


def test_user_errors_are_one_line_and_write_nothing(capsys, tmp_path, imported):
    cases = {
        "unsupported architecture GPT2ForSequenceClassification": copy_fixture(
            "gpt2", tmp_path / "a", config={"architectures": ["GPT2ForSequenceClassification"]}
        ),
        "no model.safetensors": copy_fixture("bert", tmp_path / "b", drop=["model.safetensors"]),
        "not a Hugging Face model directory (no config.json)": copy_fixture(
            "bert", tmp_path / "c", drop=["config.json"]
        ),
        "no tokenizer": copy_fixture(
            "megatron_bert", tmp_path / "d", drop=["tokenizer.json", "vocab.txt"]
        ),
        "rows but config.json's vocab_size is 299": copy_fixture(
            "gpt2", tmp_path / "e", config={"vocab_size": 299}
        ),
        "relative positions": copy_fixture(
            "bert", tmp_path / "f", config={"position_embedding_type": "relative_key"}
        ),
        "values that are not numbers: num_layers = 'two'": copy_fixture(
            "gpt2", tmp_path / "i", config={"n_layer": "two"}
        ),
    }
    # import of an import
    cases["not a Hugging Face model's (it is a megajax workdir's)"] = imported["gpt2"][1]
    listed = copy_fixture("gpt2", tmp_path / "j")
    (listed / "config.json").write_text("[1, 2]")
    cases["config.json is not a JSON object"] = listed
    truncated = copy_fixture("gpt2", tmp_path / "k")
    (truncated / "model.safetensors").write_bytes(
        (FIXTURES / "gpt2" / "model.safetensors").read_bytes()[:5000]
    )
    cases["model.safetensors cannot be read"] = truncated
    torch_only = copy_fixture("gpt2", tmp_path / "g", drop=["model.safetensors"])
    (torch_only / "pytorch_model.bin").write_bytes(b"\0")
    cases["save_pretrained(DIR, safe_serialization=True)"] = torch_only
    # a tokenizer with more tokens than the embedding has rows
    bigger = copy_fixture("gpt2", tmp_path / "h")
    vocab = json.loads((bigger / "vocab.json").read_text())
    (bigger / "vocab.json").write_text(
        json.dumps({**vocab, **{f"extra{i}": 300 + i for i in range(5)}})
    )
    cases["the tokenizer has 305 tokens but the model's embedding only 300 rows"] = bigger
    for message, hf_dir in cases.items():
        code, err = convert("import", "--hf", str(hf_dir), "--workdir", str(tmp_path / "w"))
        assert (
            code == 2 and message in err and err.count("\n") == 1 and err.startswith("error: ")
        ), (message, err)
        assert not (tmp_path / "w").exists() and not list(tmp_path.glob(".w.*"))
    code, err = convert(
        "import",
        "--hf",
        str(FIXTURES / "gpt2"),
        "--workdir",
        str(tmp_path / "x"),
        "--set",
        "model.hidden=64",
    )
    assert code == 2 and "model.hidden comes from" in err
    existing = imported["gpt2"][1]
    before = sorted(p.name for p in existing.rglob("*"))
    code, err = convert("import", "--hf", str(FIXTURES / "gpt2"), "--workdir", str(existing))
    assert code == 2 and "already exists and is not empty" in err
    assert sorted(p.name for p in existing.rglob("*")) == before
    code, err = convert("export", "--workdir", str(tmp_path / "nope"), "--out", str(tmp_path / "o"))
    assert code == 2 and "not a megajax workdir" in err and not (tmp_path / "o").exists()


def test_command_line_round_trip(tmp_path):
    def run(*a):
        return cli("convert", *a)

    p = run("import", "--hf", str(FIXTURES / "megatron_bert"), "--workdir", str(tmp_path / "w"))
    assert p.returncode == 0, p.stderr
    assert (
        "bert (pre-LayerNorm), 2 layers, hidden 32, 8 heads, vocabulary 256 (padded to 1024)"
        in p.stdout
    )
    p = run("export", "--workdir", str(tmp_path / "w"), "--out", str(tmp_path / "o"))
    assert p.returncode == 0, p.stderr
    assert "as MegatronBertForPreTraining" in p.stdout
    # tokenizer.json with the tokenizer_config.json kept beside it since the import
    assert sorted(f.name for f in (tmp_path / "o").iterdir()) == [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]


def test_a_column_shard_of_the_fused_qkv_holds_whole_heads(imported):
    """megajax's QKV columns are (head, q|k|v, head_dim): split over model=2, each device holds
    the q, k and v of its 4 heads, which in GPT-2's c_attn are 3 separate column ranges."""
    # (in, [q|k|v])
    original = load_file(FIXTURES / "gpt2" / "model.safetensors")[
        "transformer.h.1.attn.c_attn.weight"
    ]
    ours = flat_params(imported["gpt2"][1])["['layers']['stacked']['attention']['qkv']['kernel']"][
        1
    ]
    h, d = 32, 4
    first_device = ours[:, : 3 * h // 2]
    for head in range(4):
        for j in range(3):  # q, k, v
            np.testing.assert_array_equal(
                first_device[:, (3 * head + j) * d : (3 * head + j + 1) * d],
                original[:, j * h + head * d : j * h + (head + 1) * d],
            )


def test_an_untied_output_layer_is_refused(tmp_path, capsys):
    hf = copy_fixture("gpt2", tmp_path / "untied")
    tensors = load_file(hf / "model.safetensors")
    from safetensors.numpy import save_file

    save_file(
        {**tensors, "lm_head.weight": tensors["transformer.wte.weight"] + 1},
        str(hf / "model.safetensors"),
    )
    code, err = convert("import", "--hf", str(hf), "--workdir", str(tmp_path / "w"))
    assert code == 2 and "ties the output layer to the input embedding" in err
    save_file(
        {**tensors, "lm_head.weight": tensors["transformer.wte.weight"]},
        str(hf / "model.safetensors"),
    )
    # a tied copy is fine
    code, _ = convert("import", "--hf", str(hf), "--workdir", str(tmp_path / "w"))
    assert code == 0


def test_bert_fine_tuning_starts_from_an_imported_bert(imported):
    """--init-from an imported BertForPreTraining: the fine-tuning model takes its shape, and its
    encoder and pooler bitwise, on another mesh; only the classifier is new."""
    from megajax.runs.workdir import init_from_pretrained, with_pretrained_shape
    from megajax.training.step import make_trainer

    cfg, _ = with_pretrained_shape(
        load_config("finetune_qqp", [f"train.init_from={imported['bert'][1]}"])
    )
    assert (cfg.model.ln_placement, cfg.model.hidden, cfg.model.seq_len) == ("post", 32, 32)
    trainer = make_trainer(cfg, mesh_for("2x2"))
    fresh, _ = trainer.init_state()
    params = init_from_pretrained(trainer, fresh, imported["bert"][1], out=lambda *a: None)
    pre = flat_params(imported["bert"][1])
    got = {
        jax.tree_util.keystr(p): np.asarray(x)
        for p, x in jax.tree_util.tree_flatten_with_path(params)[0]
    }
    assert {k.split("'")[1] for k in got if k not in pre} == {"classifier"}
    assert all(np.array_equal(got[k], pre[k]) for k in got if k in pre)


STOPPED = (
    "stopped by SIGTERM: nothing was written (the output appears in one rename, or not at all)\n"
)


@pytest.mark.full
def test_sigterm_while_jax_starts_stops_the_import_in_one_line(tmp_path):
    """megajax-convert imports JAX before it handles signals: a handler that raised there could
    be swallowed or crash the interpreter (as seen for eval.py); it prints one line and leaves."""
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "megajax.convert",
            "import",
            "--hf",
            str(FIXTURES / "gpt2"),
            "--workdir",
            str(tmp_path / "w"),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    while p.poll() is None and not handles_signal(p.pid, signal.SIGTERM):
        time.sleep(0.01)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 128 + signal.SIGTERM and err == STOPPED, err
    assert list(tmp_path.iterdir()) == []


# A signal in the middle of writing the output: the real handler, with the import's work
# replaced by a staged directory that is half written when SIGTERM arrives.
HALF_WRITTEN = """
import os, signal, sys, time
from pathlib import Path
from megajax.cli.convert import convert_main
import megajax.convert
from megajax.files import staged_directory

def half_import(hf, workdir, overrides):
    with staged_directory(Path(workdir), "--workdir") as tmp:
        (tmp / "config.json").write_text("{}")
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(60)

megajax.convert.import_hf = half_import
sys.exit(convert_main(sys.argv[1:]))
"""


@pytest.mark.full
def test_sigterm_while_writing_removes_the_staged_output(tmp_path):
    p = subprocess.run(
        [
            sys.executable,
            "-c",
            HALF_WRITTEN,
            "import",
            "--hf",
            "unused",
            "--workdir",
            str(tmp_path / "w"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 128 + signal.SIGTERM and p.stderr == STOPPED, p.stderr
    assert list(tmp_path.iterdir()) == []  # neither the workdir nor its staged .w.*.partial


@pytest.mark.parametrize(
    "name, tensor",
    [
        ("llama", "model.layers.1.mlp.up_proj.weight"),
        ("gpt2", "transformer.h.1.attn.c_proj.weight"),
    ],
)
def test_one_layers_tensor_of_another_shape_is_named_with_both_shapes(tmp_path, name, tensor):
    from safetensors.numpy import save_file

    hf = copy_fixture(name, tmp_path / "hf")
    tensors = load_file(hf / "model.safetensors")
    good = tensors[tensor].shape
    save_file({**tensors, tensor: tensors[tensor][:-8]}, str(hf / "model.safetensors"))
    code, err = convert("import", "--hf", str(hf), "--workdir", str(tmp_path / "w"))
    other = tensor.replace(".1.", ".0.")
    assert code == 2 and err == (
        f"error: '{tensor}' has shape {(good[0] - 8, *good[1:])}, where '{other}' has {good}: the "
        "layers of a checkpoint have the same shapes\n"
    ), err
    assert not (tmp_path / "w").exists()
