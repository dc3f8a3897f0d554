"""The Llama family (Llama, Mistral, Qwen2, Qwen3) against `transformers` itself.

The fixtures in tests/fixtures/hf/{llama,llama_tied,mistral,qwen2,qwen3} and the sliding-window
{mistral,qwen2}_window (windows of 8 positions, rows of 24) were made by
tests/make_llama_fixtures.py (run by hand with PyTorch and transformers): tiny random models
with what transformers computed for fixed inputs: logits, the gradient of the mean next-token
loss for every weight, and 32 greedy tokens. Here, without PyTorch, each is imported, run on
meshes that split its key/value heads (tp divides them) and that replicate them (tp a multiple
of them), exported, and imported again.
"""

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import HF_IMPORT_SETTINGS, mesh_for
from helpers import HF_FIXTURES, hf_reference, tiered
from tolerances import F32, assert_close

from megajax.config import ConfigError, load_config
from megajax.convert import export_hf, import_hf
from megajax.convert.hf_weights import to_hf_tensors
from megajax.core.attention import kv_copies
from megajax.errors import UserError
from megajax.models.generate import generate
from megajax.models.registry import ModelDef
from megajax.runs.workdir import load_workdir
from megajax.tasks import param_count

FIXTURES = HF_FIXTURES
NAMES = ("llama", "llama_tied", "mistral", "qwen2", "qwen3", "mistral_window", "qwen2_window")
SETTINGS = HF_IMPORT_SETTINGS  # float32; vocab 320 -> 384
# (fixture, mesh): every fixture on one device; 1x8 and 2x4 replicate the key/value heads
# of llama (2 of them), qwen2 (2) and qwen3 (2), 1x8 mistral's (4); llama_tied has 8 (split on
# 2x4).
CASES = [(n, "1x1") for n in NAMES] + [
    ("llama", "2x4"),
    ("llama", "1x8"),
    ("llama_tied", "2x4"),
    ("mistral", "1x8"),
    ("qwen2", "2x4"),
    ("qwen3", "1x8"),
    ("qwen3", "2x4"),
    ("mistral_window", "2x4"),
    ("qwen2_window", "1x8"),
]


@pytest.fixture(scope="module")
def imported(hf_imported):
    return {name: hf_imported[name] for name in NAMES}


reference = hf_reference


def test_configs_come_from_the_hf_config(imported):
    llama, tied, mistral, qwen, qwen3, window, qwen_window = (imported[n][0].model for n in NAMES)
    assert (llama.norm, llama.positions, llama.mlp, llama.bias, llama.tie_embeddings) == (
        "rmsnorm",
        "rope",
        "swiglu",
        "none",
        False,
    )
    assert (
        llama.num_heads,
        llama.kv_heads,
        llama.head_dim,
        llama.ffn,
        llama.seq_len,
        llama.max_positions,
    ) == (8, 2, 8, 96, 64, 64)
    assert (
        llama.rope_scaling,
        llama.rope_theta,
        llama.rope_factor,
        llama.rope_original_context,
    ) == ("llama3", 500000.0, 8.0, 16)
    assert (tied.tie_embeddings, tied.kv_heads, tied.rope_scaling) == (True, 8, "none")
    assert (mistral.kv_heads, mistral.rope_theta, qwen.bias, qwen.kv_heads) == (4, 1e6, "qkv", 2)
    assert (mistral.sliding_window, qwen.sliding_window) == (0, 0)
    # the window slides over sequences as long as the context: nothing cut to it
    assert (window.sliding_window, window.max_positions, window.seq_len) == (8, 64, 64)
    assert (qwen_window.sliding_window, qwen_window.bias) == (8, "qkv")
    # QK-norm, and heads of 16 where hidden / heads is 8
    assert (qwen3.qk_norm, qwen3.head_dim, qwen3.kv_channels, qwen3.bias) == (True, 16, 16, "none")
    assert not any(m.qk_norm for m in (llama, tied, mistral, qwen, window, qwen_window))


@pytest.mark.parametrize(
    "name,spec",
    tiered(
        CASES,
        ("llama", "1x1"),
        ("llama", "2x4"),
        ("mistral", "1x8"),
        ("qwen2", "2x4"),
        ("qwen3", "1x8"),
        ("llama_tied", "1x1"),
        ("mistral_window", "2x4"),
    ),
)
def test_logits_and_every_gradient_match_transformers(imported, name, spec):
    """Forward and backward through the whole model on each mesh, against transformers' float32:
    a wrongly rotated, grouped, replicated or untied weight moves its gradient by O(1), and so
    does a sliding window not slid (24-token rows, windows of 8)."""
    cfg, workdir = imported[name]
    ref = reference(name)
    loaded = load_workdir(workdir, mesh_for(spec))
    modeldef = ModelDef(loaded.model)
    params = modeldef.params(loaded.model)
    assert (kv_copies(cfg.model, loaded.model.layout.shape) > 1) == (
        cfg.model.kv_heads < loaded.model.layout.tp
    )

    @jax.jit
    def run(params, ids):
        model = modeldef.bind(params)
        logits = model(ids)
        loss, grads = jax.value_and_grad(lambda p: modeldef.bind(p).objective(ids)[0])(params)
        return logits, loss, grads

    logits, loss, grads = run(params, jnp.asarray(ref["ids"]))
    assert_close(
        np.asarray(logits)[..., : cfg.model.vocab_size], ref["logits"], what=f"{name} {spec} logits"
    )
    assert_close(loss, ref["loss"], what="loss")
    hf_grads = to_hf_tensors(name.split("_")[0], jax.tree.map(np.asarray, grads), cfg.model)
    assert set(hf_grads) == {
        k.removeprefix("grad/") for k in ref.files if k.startswith("grad/")
    } - ({"lm_head.weight"} if cfg.model.tie_embeddings else set())
    for hf_name, grad in hf_grads.items():
        assert_close(grad, ref[f"grad/{hf_name}"], tol=F32, what=f"{name} {spec} d/d{hf_name}")


@pytest.mark.parametrize(
    "name,spec",
    tiered(
        [
            ("llama", "1x8"),
            ("qwen2", "1x1"),
            ("qwen3", "2x4"),
            ("mistral", "2x4"),
            ("mistral_window", "1x8"),
            ("qwen2_window", "2x4"),
        ],
        ("llama", "1x8"),
        ("mistral_window", "1x8"),
    ),
)
def test_greedy_kv_cache_decoding_matches_transformers_generate(imported, name, spec):
    """32 greedy tokens through the KV cache (which holds the key/value heads only, or each
    device's copy) equal transformers' generate, and the full recomputation of each prefix;
    with a window of 8 the 6-token prompt's continuation is past it from its third token."""
    cfg, workdir = imported[name]
    ref = reference(name)
    model = load_workdir(workdir, mesh_for(spec)).model
    got = generate(model, ref["prompt"], 32, temperature=0)
    np.testing.assert_array_equal(got, ref["greedy"])
    cache = model.init_cache(2, 8)[0]
    layout_heads = cfg.model.kv_heads * kv_copies(cfg.model, model.layout.shape)
    assert cache.shape == (cfg.model.num_layers, 2, layout_heads, 8, cfg.model.head_dim)
    full = np.concatenate([ref["prompt"], got], axis=1)
    rows = np.repeat(full, model.layout.dp, axis=0)
    recomputed = np.asarray(jax.jit(lambda m, x: m(x))(model, jnp.asarray(rows)))[0]
    np.testing.assert_array_equal(recomputed[ref["prompt"].shape[1] - 1 : -1].argmax(-1), got[0])


@pytest.mark.parametrize("name", NAMES)
def test_export_then_import_is_bitwise(imported, name, tmp_path):
    cfg, workdir = imported[name]
    notes = export_hf(workdir, tmp_path / "hf")
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    # Mistral without a window is a Llama
    expected = (
        "Qwen3ForCausalLM"
        if name == "qwen3"
        else "Qwen2ForCausalLM"
        if name.startswith("qwen2")
        else "MistralForCausalLM"
        if name == "mistral_window"
        else "LlamaForCausalLM"
    )
    assert written["architectures"] == [expected] and expected in notes[0]
    assert written.get("sliding_window") == (cfg.model.sliding_window or None)
    assert (tmp_path / "hf" / "tokenizer.json").is_file()
    again = import_hf(tmp_path / "hf", tmp_path / "again", SETTINGS)
    assert again.model == cfg.model
    a, b = (load_workdir(w, mesh_for("1x1")) for w in (workdir, tmp_path / "again"))
    pa, pb = (jax.tree.map(np.asarray, ModelDef(x.model).params(x.model)) for x in (a, b))
    jax.tree.map(np.testing.assert_array_equal, pa, pb)


def test_the_chat_template_and_tokenizer_config_are_kept(imported):
    _, workdir = imported["llama"]
    assert "<|start_header_id|>" in (workdir / "chat_template.jinja").read_text()
    assert json.loads((workdir / "tokenizer_config.json").read_text())["eos_token"] == "<|eot_id|>"


@pytest.mark.parametrize(
    "name,change,says",
    [
        (
            "llama",
            dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}),
            "rope scaling 'yarn'",
        ),
        # transformers' layer_types: the window over the second layer only
        (
            "qwen2",
            dict(
                use_sliding_window=True,
                sliding_window=16,
                layer_types=["full_attention", "sliding_attention"],
            ),
            "over 1 of its 2 layers (max_window_layers / layer_types)",
        ),
        (
            "qwen2",
            dict(use_sliding_window=True, sliding_window=16, layer_types=None, max_window_layers=1),
            "over 1 of its 2 layers",
        ),
        ("llama", dict(attention_bias=True), "attention_bias = true"),
        ("llama", dict(mlp_bias=True), "mlp_bias = true"),
        ("qwen3", dict(attention_bias=True), "attention_bias = true"),
        ("mistral", dict(hidden_act="gelu"), "hidden_act = 'gelu'"),
        # mixtures of experts: router jitter, a dense layer after a sparse one
        ("mixtral", dict(router_jitter_noise=0.01), "router_jitter_noise = 0.01"),
        ("qwen3_moe", dict(mlp_only_layers=[1]), "mlp_only_layers = [1] makes layers dense after"),
        (
            "mistral",
            dict(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3"),
            "unsupported architecture DeepseekV3ForCausalLM",
        ),
    ],
)
def test_unsupported_options_are_one_line_and_nothing_is_written(tmp_path, name, change, says):
    src = tmp_path / "src"
    src.mkdir()
    for f in (FIXTURES / name).iterdir():
        (src / f.name).write_bytes(f.read_bytes())
    config = json.loads((src / "config.json").read_text())
    settings = change.pop("settings", [])
    (src / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(UserError, match=re.escape(says)) as e:
        import_hf(src, tmp_path / "out", [*SETTINGS, *settings])
    assert "\n" not in str(e.value) and not (tmp_path / "out").exists()


def test_a_window_over_every_layer_or_none(tmp_path):
    """Qwen2's use_sliding_window from layer max_window_layers on (transformers' rule when
    config.json lists no layer_types): from layer 0, every layer slides; from past the last,
    none does."""
    for first, window in ((0, 16), (2, 0)):
        src = tmp_path / f"src{first}"
        src.mkdir()
        for f in (FIXTURES / "qwen2").iterdir():
            (src / f.name).write_bytes(f.read_bytes())
        config = json.loads((src / "config.json").read_text())
        config.pop("layer_types")
        (src / "config.json").write_text(
            json.dumps(
                {
                    **config,
                    "use_sliding_window": True,
                    "sliding_window": 16,
                    "max_window_layers": first,
                }
            )
        )
        assert import_hf(src, tmp_path / f"w{first}", SETTINGS).model.sliding_window == window


@pytest.mark.parametrize(
    "name,published",
    [
        ("llama3.2_1b", 1_235_814_400),
        ("llama3.1_8b", 8_030_261_248),
        ("llama3.1_70b", 70_553_706_496),
        ("mistral_7b", 7_241_732_096),
        ("qwen2_7b", 7_615_616_512),
        ("qwen3_8b", 8_190_735_360),
    ],
)
def test_shipped_shapes_have_the_published_parameter_counts(name, published):
    assert param_count(load_config(name)) == published


def test_architecture_fields_are_validated_together():
    base = ["model.positions=rope", "model.norm=rmsnorm", "model.mlp=swiglu", "model.bias=none"]
    with pytest.raises(ConfigError, match="not divisible by model.num_kv_heads=3"):
        load_config("tiny", base + ["model.num_kv_heads=3"])
    with pytest.raises(ConfigError, match="scales rotary positions"):
        load_config("tiny", ["model.rope_scaling=llama3"])
    with pytest.raises(ConfigError, match="rope_scaling must be none, linear or llama3"):
        load_config("tiny", base + ["model.rope_scaling=yarn"])
    for change in ("model.positions=rope", "model.qk_norm=true"):
        with pytest.raises(ConfigError, match="are for GPT-style decoders"):
            load_config("bert_tiny", [change])


def test_fused_attention_takes_the_grouped_heads_directly(imported, tmp_path):
    """model.attention = "fused" (jax.nn.dot_product_attention, given the key/value heads as
    they are): transformers' logits, on a mesh that copies the key/value heads."""
    ref = reference("llama")
    cfg = import_hf(FIXTURES / "llama", tmp_path / "w", [*SETTINGS, "model.attention=fused"])
    assert cfg.model.attention == "fused"
    model = load_workdir(tmp_path / "w", mesh_for("1x8")).model
    logits = np.asarray(jax.jit(lambda m, x: m(x))(model, jnp.asarray(ref["ids"])))
    assert_close(
        logits[..., : cfg.model.vocab_size], ref["logits"], what="fused attention's logits"
    )
