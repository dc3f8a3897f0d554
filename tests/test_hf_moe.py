"""Mixtures of experts from Hugging Face (Mixtral, Qwen2-MoE, Qwen3-MoE) against `transformers`
itself.

The fixtures tests/fixtures/hf/{mixtral,qwen2_moe,qwen3_moe} were made by
tests/make_llama_fixtures.py (run by hand with PyTorch and transformers 5.25): a Mixtral of 4
experts, top-2, with grouped-query attention; a Qwen2-MoE with q/k/v biases, its first layer
dense, 4 experts beside a shared expert under its sigmoid gate; a Qwen3-MoE of 8 experts of
width 32, top-2, the chosen weights renormalised, with QK-norm; their routers' choices checked
clear of near-ties; transformers' logits, the gradient of the mean next-token loss for every
weight (the experts' under the files' per-expert names) and 32 greedy tokens. Here each is
imported, run dropless on one device and on expert meshes with and without a model axis,
exported and imported again. (Their import refusals are test_llama.py's, with the family's.)
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import HF_IMPORT_SETTINGS
from helpers import hf_reference, tiered
from tolerances import F32, assert_close

from megajax.config import load_config
from megajax.convert import export_hf, import_hf
from megajax.convert.hf_config import export_architecture
from megajax.convert.hf_weights import to_hf_tensors
from megajax.core.mesh import make_mesh
from megajax.errors import UserError
from megajax.mesh_shape import MeshShape
from megajax.models.generate import generate
from megajax.models.registry import ModelDef
from megajax.runs.workdir import load_workdir

NAMES = ("mixtral", "qwen2_moe", "qwen3_moe")
ARCHITECTURES = {
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}


def mesh(spec: str):
    """The mesh over as many of the 8 simulated devices as it takes."""
    n = MeshShape.devices_asked(spec)
    return make_mesh(spec, devices=jax.devices()[:n])


@pytest.fixture(scope="module")
def imported(hf_imported):
    return {name: hf_imported[name] for name in NAMES}


def test_configs_come_from_the_hf_config(imported):
    mixtral, qwen2, qwen = (imported[n][0].model for n in NAMES)
    assert (mixtral.num_experts, mixtral.experts_per_token, mixtral.moe_ffn, mixtral.kv_heads) == (
        4,
        2,
        96,
        2,
    )
    assert (mixtral.moe_router, mixtral.moe_norm_topk, mixtral.qk_norm) == ("softmax", True, False)
    assert (qwen.num_experts, qwen.moe_ffn, qwen.head_dim, qwen.qk_norm, qwen.moe_norm_topk) == (
        8,
        32,
        16,
        True,
        True,
    )
    # its first layer dense: an unrolled stack; the shared expert gated; not renormalised
    assert (qwen2.sparse_layers, qwen2.scan_layers, qwen2.bias) == ((False, True), False, "qkv")
    assert (qwen2.moe_shared_experts, qwen2.moe_shared_ffn, qwen2.moe_shared_gate) == (1, 48, True)
    assert (qwen2.ffn, qwen2.moe_ffn, qwen2.moe_norm_topk) == (96, 32, False)
    # transformers adds the balancing loss only with output_router_logits; no file asks
    assert mixtral.moe_aux_loss == qwen2.moe_aux_loss == qwen.moe_aux_loss == 0.0
    assert all(m.moe_capacity_factor == 0 and all(m.sparse_layers) for m in (mixtral, qwen))


CASES = [(n, spec) for n in NAMES for spec in ("1x1", "data=2,expert=4", "expert=2,model=2")]


@pytest.mark.parametrize(
    "name,spec",
    tiered(
        CASES,
        ("mixtral", "data=2,expert=4"),
        ("qwen2_moe", "data=2,expert=4"),
        ("qwen3_moe", "expert=2,model=2"),
    ),
)
def test_logits_and_every_gradient_match_transformers(imported, name, spec):
    """Forward and backward through the whole model, dropless, against transformers' float32:
    the router, each expert's three weights and the attention (QK-norm's scales too). The two
    reference rows are repeated to fill the mesh's eight row shards: the mean loss and its
    gradient are the same, and each row is routed by itself."""
    cfg, workdir = imported[name]
    ref = hf_reference(name)
    loaded = load_workdir(workdir, mesh(spec))
    modeldef = ModelDef(loaded.model)
    params = modeldef.params(loaded.model)
    ids = jnp.asarray(np.tile(ref["ids"], (4, 1)))

    @jax.jit
    def run(params, ids):
        logits = modeldef.bind(params)(ids)
        loss, grads = jax.value_and_grad(lambda p: modeldef.bind(p).objective(ids)[0])(params)
        return logits, loss, grads

    logits, loss, grads = run(params, ids)
    got = np.asarray(logits)[: ref["ids"].shape[0], :, : cfg.model.vocab_size]
    assert_close(got, ref["logits"], what=f"{name} {spec} logits")
    assert_close(loss, ref["loss"], what="loss")
    hf_grads = to_hf_tensors(name, jax.tree.map(np.asarray, grads), cfg.model)
    assert set(hf_grads) == {k.removeprefix("grad/") for k in ref.files if k.startswith("grad/")}
    for hf_name, grad in hf_grads.items():
        assert_close(grad, ref[f"grad/{hf_name}"], tol=F32, what=f"{name} {spec} d/d{hf_name}")


@pytest.mark.parametrize(
    "name,spec",
    [
        ("mixtral", "expert=2,model=2"),
        ("qwen2_moe", "data=1,expert=2,model=2"),
        ("qwen3_moe", "1x1"),
    ],
)
def test_greedy_kv_cache_decoding_matches_transformers_generate(imported, name, spec):
    _, workdir = imported[name]
    ref = hf_reference(name)
    model = load_workdir(workdir, mesh(spec)).model
    np.testing.assert_array_equal(generate(model, ref["prompt"], 32, temperature=0), ref["greedy"])


@pytest.mark.parametrize("name", NAMES)
def test_export_then_import_is_bitwise(imported, name, tmp_path):
    """Written one tensor per expert under the files' names, as transformers saves them."""
    cfg, workdir = imported[name]
    notes = export_hf(workdir, tmp_path / "hf")
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert written["architectures"] == [ARCHITECTURES[name]] and ARCHITECTURES[name] in notes[0]
    assert written["num_experts_per_tok"] == 2 and written["output_router_logits"] is False
    again = import_hf(tmp_path / "hf", tmp_path / "again", HF_IMPORT_SETTINGS)
    assert again.model == cfg.model
    a, b = (load_workdir(w, mesh("1x1")) for w in (workdir, tmp_path / "again"))
    pa, pb = (jax.tree.map(np.asarray, ModelDef(x.model).params(x.model)) for x in (a, b))
    jax.tree.map(np.testing.assert_array_equal, pa, pb)


def test_export_refuses_what_neither_architecture_has():
    for sets, says in (
        (["model.moe_router=sigmoid"], "MixtralForCausalLM needs model.moe_router (softmax)"),
        (["model.moe_shared_experts=1"], "Qwen2MoeForCausalLM needs model.moe_shared_gate"),
        (["model.moe_norm_topk=false"], "MixtralForCausalLM needs model.moe_norm_topk (true)"),
        (["model.qk_norm=true", "model.moe_bias_update_rate=0.01"], "moe_bias_update_rate (0)"),
    ):
        with pytest.raises(UserError, match="no Hugging Face architecture megajax writes") as e:
            export_architecture(load_config("moe_tiny", sets).model)
        assert says in str(e.value)
    assert export_architecture(load_config("moe_tiny").model) == "MixtralForCausalLM"


@pytest.mark.full
def test_an_imported_mixtral_fine_tunes_on_chat_with_lora_on_an_expert_mesh(imported, tmp_path):
    """train.py --init-from the imported Mixtral on conversations, LoRA on its attention, on
    data=2,expert=4; the adapter exports in PEFT's layout (PeftModel.from_pretrained on it gives
    megajax's logits within 2.3e-6: checked by hand, as PEFT needs torch)."""
    from helpers import cli, losses, run
    from safetensors.numpy import load_file

    _, workdir = imported["mixtral"]
    wd = tmp_path / "lora"
    run(
        *("--init-from", workdir, "--data", "chat:data/chats.jsonl", "--workdir", wd),
        *("--steps", "6", "--mesh", "data=2,expert=4", "--host-devices", "8"),
        *("--sample-tokens", "0", "--log-every", "1", "--set", "model.seq_len=64"),
        *("--set", "model.lora_rank=8", "--set", "model.lora_targets=qkv,out"),
        *("--set", "train.lr=1e-2"),
    )
    got = losses(wd)
    assert sorted(got) == list(range(1, 7)) and got[6] < got[1]
    out = tmp_path / "adapter"
    p = cli("convert", "export", "--adapter", "--workdir", wd, "--out", out)
    assert p.returncode == 0, p.stderr
    names = set(load_file(out / "adapter_model.safetensors"))
    projections = {n.split(".self_attn.")[1].split(".")[0] for n in names}
    assert projections == {"q_proj", "k_proj", "v_proj", "o_proj"} and len(names) == 16


@pytest.mark.parametrize("name", NAMES)
def test_the_chat_templates_ids_are_transformers(imported, name):
    """The imported tokenizer and its chat template give transformers' apply_chat_template ids
    for a conversation with the generation prompt."""
    from megajax.data.chat import prompt_ids, template_for
    from megajax.data.tokenizer import load_tokenizer

    _, workdir = imported[name]
    tokenizer = load_tokenizer(workdir)
    messages = [{"role": "user", "content": "Call me Ishmael."}]
    got = prompt_ids(messages, template_for(tokenizer), tokenizer)
    assert got == hf_reference(name)["chat_ids"].ravel().tolist()
