"""Megatron-LM's own GPT checkpoints imported (`megajax-convert import --megatron`), against
megatron-core itself: tests/fixtures/megatron/gpt_tp{1,2} (and llama_tp{1,2}, its Llama-style
GPT) were saved as Megatron-LM saves a run,
with tensor parallelism 1 and 2, and hold the logits megatron-core's forward pass gave for
fixed tokens (tests/make_megatron_fixtures.py, run by hand with PyTorch). Without PyTorch here,
the .pt files are read by megajax/convert/torch_pickle.py."""

import argparse
import io
import pickle
import zipfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ROOT, mesh_for
from tolerances import F32, assert_close

from megajax.cli.convert import convert_main
from megajax.convert import import_megatron, megatron_ckpt, torch_pickle
from megajax.errors import UserError
from megajax.runs.workdir import load_workdir

FIXTURES = ROOT / "tests/fixtures/megatron"
# 220 ids; the checkpoints have 256 rows
VOCAB = f"wordpiece:{ROOT / 'tests/fixtures/hf/bert/vocab.txt'}"


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    root = tmp_path_factory.mktemp("megatron")
    return {
        tp: import_megatron(
            FIXTURES / f"gpt_tp{tp}", root / f"tp{tp}", VOCAB, ["model.vocab_multiple=128"]
        )
        and root / f"tp{tp}"
        for tp in (1, 2, "2_pp2")
    }


@pytest.mark.parametrize("tp,mesh_spec", [(1, "1x1"), (2, "2x4"), (1, "1x4"), ("2_pp2", "1x2")])
def test_logits_equal_megatron_cores(imported, tp, mesh_spec):
    """A checkpoint saved with either tensor parallelism, or with two pipeline stages too, on
    any mesh: Megatron's logits (the pipeline-parallel one holds gpt_tp1's weights)."""
    ref = np.load(FIXTURES / f"gpt_tp{1 if tp == '2_pp2' else tp}" / "reference.npz")
    loaded = load_workdir(imported[tp], mesh_for(mesh_spec))
    cfg = loaded.cfg.model
    assert (
        cfg.num_layers,
        cfg.hidden,
        cfg.num_heads,
        cfg.ffn,
        cfg.seq_len,
        cfg.vocab_size,
        cfg.gelu,
        cfg.ln_eps,
    ) == (2, 32, 4, 128, 16, 220, "exact", 1e-5) and loaded.step == 0
    logits = np.asarray(jax.jit(lambda m, t: m(t))(loaded.model, jnp.asarray(ref["tokens"])))
    assert_close(
        logits[..., :220],
        ref["logits"],
        F32,
        what=f"logits of the TP={tp} checkpoint on {mesh_spec}",
    )


def test_the_earlier_names_and_qkv_orders_give_the_same_weights():
    """Checkpoints from before megatron-core name tensors `language_model.encoder.layers.N...`
    (the oldest `transformer` and `attention`), and versions 0 and 1 order each rank's fused QKV
    rows (q|k|v, head, head_dim) and (head, head_dim, q|k|v). This fixture's TP=2 shards, renamed
    and reordered so by the format's description, must give the same weights; so must the names
    megatron-core gives LayerNorms fused into Transformer Engine's linear layers."""
    files, _ = megatron_ckpt.rank_files(FIXTURES / "gpt_tp2")
    args, version, shards = megatron_ckpt.read_ranks(files)
    cfg = megatron_ckpt.model_config(args, 220, megatron_ckpt.ModelConfig(vocab_multiple=128))
    want = megatron_ckpt.to_params(shards, version, cfg)
    renames = [
        ("decoder.layers.", "language_model.transformer.layers."),
        ("self_attention.linear_qkv", "attention.query_key_value"),
        ("self_attention.linear_proj", "attention.dense"),
        ("pre_mlp_layernorm", "post_attention_layernorm"),
        ("mlp.linear_fc1", "mlp.dense_h_to_4h"),
        ("mlp.linear_fc2", "mlp.dense_4h_to_h"),
        ("decoder.final_layernorm", "language_model.transformer.final_layernorm"),
        ("embedding.", "language_model.embedding."),
    ]
    local_heads = cfg.num_heads // 2
    for old_version, order in [
        (0, lambda x: np.moveaxis(x, 1, 0)),
        (1, lambda x: np.moveaxis(x, 1, 2)),
    ]:
        old = []
        for shard in shards:
            renamed = {}
            for name, tensor in shard.items():
                x = tensor.numpy()
                if "linear_qkv" in name:  # (head, q|k|v, head_dim) rows, this rank's heads
                    x = order(x.reshape(local_heads, 3, -1, *x.shape[1:])).reshape(x.shape)
                renamed[_renamed(name, renames)] = _Array(x)
            old.append(renamed)
        got = megatron_ckpt.to_params(old, old_version, cfg)
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_array_equal(g, w)
    # megatron-core with Transformer Engine: each LayerNorm stored with the linear layer after it
    te_names = [
        ("input_layernorm.", "self_attention.linear_qkv.layer_norm_"),
        ("pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_"),
    ]
    te = [{_renamed(name, te_names): tensor for name, tensor in shard.items()} for shard in shards]
    assert any("layer_norm_weight" in name for name in te[0])
    for g, w in zip(
        jax.tree.leaves(megatron_ckpt.to_params(te, version, cfg)), jax.tree.leaves(want)
    ):
        np.testing.assert_array_equal(g, w)


def _renamed(name: str, pairs) -> str:
    for a, b in pairs:
        name = name.replace(a, b)
    return name


class _Array(torch_pickle.Tensor):
    def __init__(self, x):
        self.x = x

    def numpy(self):
        return self.x


@pytest.mark.parametrize("tp,mesh_spec", [(1, "1x1"), (1, "1x4"), (2, "2x2"), (2, "1x4")])
def test_llama_style_checkpoints_give_megatron_cores_logits(tmp_path, tp, mesh_spec):
    """megatron-core's Llama-style GPT (RMSNorm, rotary positions with llama3 scaling, SwiGLU,
    2 query groups of 2 heads, no biases, untied), saved with tensor parallelism 1 and 2: its
    logits on a mesh that splits the key/value heads (2x2) and one that copies them (1x4)."""
    ref = np.load(FIXTURES / f"llama_tp{tp}" / "reference.npz")
    cfg = import_megatron(
        FIXTURES / f"llama_tp{tp}", tmp_path / "w", VOCAB, ["model.vocab_multiple=128"]
    ).model
    assert (
        cfg.norm,
        cfg.positions,
        cfg.mlp,
        cfg.bias,
        cfg.tie_embeddings,
        cfg.kv_heads,
        cfg.ffn,
    ) == ("rmsnorm", "rope", "swiglu", "none", False, 2, 48)
    assert (cfg.rope_scaling, cfg.rope_factor, cfg.rope_original_context, cfg.rope_theta) == (
        "llama3",
        8.0,
        8192,
        1e4,
    )
    loaded = load_workdir(tmp_path / "w", mesh_for(mesh_spec))
    logits = np.asarray(jax.jit(lambda m, t: m(t))(loaded.model, jnp.asarray(ref["tokens"])))
    assert_close(
        logits[..., :220], ref["logits"], F32, what=f"logits of the TP={tp} Llama-style checkpoint"
    )


def test_what_megajax_cannot_import_is_one_line(tmp_path, capsys):
    good = FIXTURES / "gpt_tp2"
    (tmp_path / "empty").mkdir()
    for rank in ("mp_rank_00_000", "mp_rank_01_001"):  # two of a 2 x 2 checkpoint's four
        (tmp_path / "pipeline" / "iter_0000001" / rank).mkdir(parents=True)
        (tmp_path / "pipeline" / "iter_0000001" / rank / "model_optim_rng.pt").write_bytes(b"")
    (tmp_path / "pipeline" / "latest_checkpointed_iteration.txt").write_text("1\n")
    (tmp_path / "dist").mkdir()
    (tmp_path / "dist" / "__0_0.distcp").write_bytes(b"")
    # torch.save before PyTorch 1.6: its magic number pickled first, then the rest
    (tmp_path / "legacy.pt").write_bytes(
        pickle.dumps(0x1950A86A20F9469CFC6C, protocol=2) + pickle.dumps({"model": {}})
    )
    (tmp_path / "notes.pt").write_bytes(_zip_pickle([1, 2]))
    (tmp_path / "virtual.pt").write_bytes(
        _zip_pickle({"model0": {}, "model1": {}, "args": argparse.Namespace()})
    )
    (tmp_path / "experts" / "mp_rank_00_000_001").mkdir(parents=True)
    (tmp_path / "experts" / "mp_rank_00_000_001" / "model_optim_rng.pt").write_bytes(b"")
    args, version, shards = megatron_ckpt.read_ranks(megatron_ckpt.rank_files(good)[0])
    for directory, message in [
        (tmp_path / "empty", "no mp_rank_*/model_optim_rng.pt in"),
        (tmp_path / "pipeline", "lacks mp_rank_00_001, mp_rank_01_000: an incomplete checkpoint"),
        (tmp_path / "dist", "is a torch_dist (distributed) checkpoint"),
        (tmp_path / "legacy.pt", "is in torch.save's format before PyTorch 1.6 (a legacy file)"),
        (tmp_path / "notes.pt", "is not a Megatron-LM checkpoint (no 'model' state dict"),
        (tmp_path / "virtual.pt", "holds interleaved (virtual) pipeline stages"),
        (tmp_path / "experts", "is an expert-parallel rank (mp_rank_TT_PPP_EEE)"),
    ]:
        with pytest.raises(
            UserError, match=message.replace("(", r"\(").replace(")", r"\)").replace("*", r"\*")
        ):
            megatron_ckpt.read_ranks(megatron_ckpt.rank_files(directory)[0])
    for change, message in [
        ({"position_embedding_type": "yarn"}, "position_embedding_type = 'yarn'"),
        ({"normalization": "LayerNorm1P"}, "normalization = 'LayerNorm1P'"),
        ({"position_embedding_type": "rope", "rotary_percent": 0.5}, "rotary_percent = 0.5"),
        (
            {"position_embedding_type": "rope", "rotary_interleaved": True},
            "rotary_interleaved = True",
        ),
        ({"qk_layernorm": True}, "(LayerNorm of queries and keys)"),
        ({"hidden_size": None}, "the checkpoint's arguments lack hidden_size"),
    ]:
        with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
            megatron_ckpt.model_config({**args, **change}, 220, megatron_ckpt.ModelConfig())
    cfg = megatron_ckpt.model_config(args, 300, megatron_ckpt.ModelConfig())
    with pytest.raises(
        UserError, match="the tokenizer has 300 tokens but the checkpoint's embedding only 256 rows"
    ):
        megatron_ckpt.to_params(shards, version, cfg)
    cfg = megatron_ckpt.model_config(args, 220, megatron_ckpt.ModelConfig())
    changed = [dict(shards[0]), shards[1]]
    changed[0]["decoder.final_layernorm.weight"] = _Array(np.zeros(32, np.float32))
    with pytest.raises(
        UserError,
        match="'decoder.final_layernorm.weight' differs between the tensor-parallel ranks",
    ):
        megatron_ckpt.to_params(changed, version, cfg)
    changed = [
        {**s, "decoder.layers.0.self_attention.q_layernorm.weight": _Array(np.ones(8))}
        for s in shards
    ]
    with pytest.raises(
        UserError,
        match="tensors megajax's GPT does not: decoder.layers.0.self_attention.q_layernorm",
    ):
        megatron_ckpt.to_params(changed, version, cfg)
    out = tmp_path / "w"
    for argv, message in [
        (["--megatron", str(good)], "--megatron needs --tokenizer"),
        (
            ["--megatron", str(good), "--tokenizer", "chars"],
            "--tokenizer chars is built from a corpus",
        ),
        (
            ["--megatron", str(good), "--tokenizer", VOCAB, "--set", "model.num_layers=3"],
            "model.num_layers comes from the checkpoint's arguments",
        ),
    ]:
        assert convert_main(["import", *argv, "--workdir", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err and err.count("\n") == 1, err
        assert not out.exists()


def test_every_storage_type_and_view_reads_as_torch_wrote_it():
    """float32 (transposed), float16, bfloat16 (a strided slice), float64 (a row), int64, int32,
    uint8 and bool tensors of torch.save, against their values written beside them."""
    loaded = torch_pickle.load(FIXTURES / "tensors.pt")
    want = np.load(FIXTURES / "tensors.npz")
    assert sorted(loaded["model"]) == sorted(want.files)
    for name, tensor in loaded["model"].items():
        got = tensor.numpy()
        assert got.dtype.name == name.removesuffix("_t"), name
        np.testing.assert_array_equal(got.astype(want[name].dtype), want[name], err_msg=name)
    assert isinstance(loaded["args"].dtype, type) and issubclass(
        loaded["args"].dtype, torch_pickle.Opaque
    )


def test_a_pickle_that_would_run_code_runs_none(tmp_path):
    """pickle's hazard: a file that names a callable runs it on load. torch_pickle builds only
    dicts, Namespaces and tensors; anything else is inert."""
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (eval, (f"open({str(marker)!r}, 'w')",))

    (tmp_path / "evil.pt").write_bytes(_zip_pickle({"model": Payload(), "args": 1}))
    loaded = torch_pickle.load(tmp_path / "evil.pt")
    assert not marker.exists() and isinstance(loaded["model"], torch_pickle.Opaque)


def _zip_pickle(value) -> bytes:
    """`value` in torch.save's layout (ROOT/data.pkl in a zip), pickled by the standard library."""
    data = io.BytesIO()
    with zipfile.ZipFile(data, "w") as z:
        z.writestr("archive/data.pkl", pickle.dumps(value, protocol=2))
    return data.getvalue()
