"""LoRA adapters on the tensor-parallel layers: the adapted model starts as the base model, only
the adapters train (the base bitwise unchanged, no optimizer state for it), the same adapters
on every mesh and scheme, and the model axis carries what it carries without them."""

import dataclasses
import json
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ROOT, mesh_for, tiny_config
from flax import nnx
from helpers import cli, exact_model_axis_elements, run, tiered
from tolerances import F32, adam_tolerance, assert_close

from megajax.models.registry import init_model
from megajax.tools.audit import audit
from megajax.training.step import make_trainer

LLAMA = dict(
    norm="rmsnorm",
    positions="rope",
    mlp="swiglu",
    num_kv_heads=2,
    bias="none",
    tie_embeddings=False,
)


def lora_config(extra=None, train=None, **lora):
    cfg = tiny_config(lora_rank=4, lora_alpha=8.0, **{**(extra or {}), **lora})
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, **(train or {})))


@pytest.mark.full
@pytest.mark.parametrize(
    "mesh,extra", [("1x1", {}), ("2x4", dict(LLAMA, sequence_parallel=True)), ("1x8", LLAMA)]
)
def test_the_adapted_model_starts_as_the_base_model_bitwise(devices, mesh, extra):
    """B starts at zero and the adapters draw from their own random stream: the same seed's
    base weights, and logits bitwise the base model's."""
    cfg = tiny_config(hidden_dropout=0.0, attention_dropout=0.0, **extra).model
    base = init_model(cfg, mesh_for(mesh), seed=5)
    adapted = init_model(dataclasses.replace(cfg, lora_rank=4), mesh_for(mesh), seed=5)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 100, (8, 16)), jnp.int32)
    logits = nnx.jit(lambda model: model(tokens))
    assert np.array_equal(np.asarray(logits(base)), np.asarray(logits(adapted)))


def _train(mesh, cfg, steps):
    trainer = make_trainer(cfg, mesh_for(mesh))
    params, opt = trainer.init_state()
    before = jax.device_get(params)
    step = trainer.jit_step(donate=False)
    rng = np.random.default_rng(0)
    grads = None
    for i in range(steps):
        batch = jax.device_put(
            rng.integers(0, 100, (8, 17)).astype(np.int32), trainer.batch_sharding
        )
        if i == 0:
            grads = jax.device_get(
                jax.jit(lambda p, b: trainer.gradients(p, b, trainer.step_key(0))[1])(params, batch)
            )
        params, opt, _ = step(params, opt, batch, np.int32(i))
    return trainer, before, jax.device_get(params), opt, grads


def _flat(tree):
    return {
        jax.tree_util.keystr(k): np.asarray(v)
        for k, v in jax.tree_util.tree_flatten_with_path(tree)[0]
    }


@pytest.fixture(scope="module")
def reference():
    """3 AdamW steps on one device, with hidden, attention and LoRA dropout."""
    cfg = lora_config(LLAMA, lora_dropout=0.1)
    return _train("1x1", cfg, 3)


@pytest.mark.parametrize(
    "mesh,extra,train",
    tiered(
        [
            ("2x4", {"sequence_parallel": True}, {"shard_optimizer": True}),
            ("1x8", {"remat": "full"}, {"shard_params": True}),
        ],
        ("1x8", {"remat": "full"}, {"shard_params": True}),
    ),
)
def test_adapters_after_three_steps_equal_one_device(devices, reference, mesh, extra, train):
    """2x4 with sequence parallelism and ZeRO-1; 1x8 with full remat and FSDP (the adapters and
    their optimizer state split over "data"): 1x1's adapters within Adam's bound, and the base
    weights bitwise as they were."""
    _, _, want, _, grads = reference
    cfg = lora_config({**LLAMA, **extra}, train, lora_dropout=0.1)
    _, before, got, _, _ = _train(mesh, cfg, 3)
    want, got, before, grads = _flat(want), _flat(got), _flat(before), _flat(grads)
    scale = max(np.abs(g).max() for g in grads.values())
    for name, value in got.items():
        if "'lora'" not in name:
            assert np.array_equal(value, before[name]), name
            continue
        bound = adam_tolerance(grads[name], scale, lr=1e-2, steps=3)
        assert np.all(np.abs(value - want[name]) <= bound + F32 * np.abs(want[name])), name


def test_ten_steps_leave_the_base_bitwise_and_keep_no_state_for_it(devices):
    """In mixed precision (bfloat16 matmul operands) on 2x4, the layers unrolled: the adapters
    train, the base does not move a bit, and Adam keeps moments for the adapters alone."""
    trainer, before, after, opt, _ = _train(
        "2x4", lora_config({"compute_dtype": "mixed", "scan_layers": False}), 10
    )
    before, after = _flat(before), _flat(after)
    adapters = [n for n in after if "'lora'" in n]
    assert adapters and all(
        not np.array_equal(after[n], before[n]) for n in adapters if n.endswith("['b']")
    )
    assert all(np.array_equal(after[n], before[n]) for n in after if n not in adapters)
    # Adam's two moments for each adapter weight, nothing for the base
    moments = sum(x.size for x in jax.tree.leaves(opt) if x.ndim)
    assert moments == 2 * sum(before[n].size for n in adapters)


def _activation_collectives(r):
    """The model-axis collectives that carry activations: kind, pass, origin, elements, count."""
    return Counter(
        (c.kind, c.direction, c.origin, c.elements)
        for c in r.collectives
        for _ in range(c.count)
        if c.axis == "model" and c.origin in ("attention", "mlp", "embedding", "logits", "loss")
    )


@pytest.mark.parametrize(
    "mesh,extra,train",
    tiered(
        [
            ("2x4", {}, {}),
            ("2x4", dict(LLAMA, sequence_parallel=True), {"shard_optimizer": True}),
            ("1x8", LLAMA, {"shard_params": True}),
        ],
        ("2x4", {}, {}),
    ),
)
def test_the_audit_shows_the_model_axis_of_the_base_model(devices, mesh, extra, train):
    """The forward pass's collectives are the base model's; backward, the frozen base drops the
    gradient-only ones (sequence parallelism's replicated-weight sums, the embedding's gather),
    and the adapters' replicated factors are summed with their data-axis reduction (the plain
    step) or per layer (ZeRO-1, FSDP: `adapter_gradients`, rank x hidden numbers each)."""
    base = audit(
        dataclasses.replace(
            lora_config(extra, train),
            model=dataclasses.replace(lora_config(extra, train).model, lora_rank=0),
        ),
        mesh_for(mesh),
    )
    adapted = audit(lora_config(extra, train), mesh_for(mesh))
    ours, theirs = _activation_collectives(adapted), _activation_collectives(base)
    forward = lambda c: Counter({k: n for k, n in c.items() if k[1] == "forward"})  # noqa: E731
    assert forward(ours) == forward(theirs)
    assert ours - theirs == Counter()  # backward: a subset of the base model's
    assert exact_model_axis_elements(adapted) == adapted.analytic_min_elements + (
        adapted.regathered_elements if extra.get("sequence_parallel") else 0
    )
    if adapted.mesh.data > 1:
        assert adapted.data_axis_ratio == pytest.approx(1.0, abs=1e-9)
    x, rank = adapted.shape, 4
    per_layer = 4 * x.hidden * rank  # qkv's and fc1's A, out's and fc2's B: hidden x rank
    if x.kv_copies > 1:  # the key/value part's B in copies: one head's sum, the heads gathered
        per_layer += rank * 2 * x.head_dim * (1 + x.kv)
    assert adapted.adapter_gradient_elements == (per_layer * x.layers if train else 0)


PEFT = ROOT / "tests" / "fixtures" / "peft"
CHAT = ROOT / "tests" / "fixtures" / "chat" / "conversations.jsonl"


@pytest.fixture(scope="module")
def lora_runs(tmp_path_factory):
    """A Llama and a GPT-2 fixture imported, then 3 steps of LoRA (rank 4, alpha 8) on the
    committed conversations: {name: workdir}."""
    from megajax.convert import import_hf

    root = tmp_path_factory.mktemp("lora")
    runs = {}
    for name, lr in (("llama", "1e-2"), ("gpt2", "5e-2")):
        import_hf(ROOT / "tests" / "fixtures" / "hf" / name, root / f"{name}_base", [])
        runs[name] = root / name
        run(
            "--init-from",
            str(root / f"{name}_base"),
            "--data",
            f"chat:{CHAT}",
            "--workdir",
            str(runs[name]),
            "--steps",
            "3",
            "--host-devices",
            "2",
            "--mesh",
            "1x2",
            "--sample-tokens",
            "0",
            "--set",
            "model.lora_rank=4",
            "--set",
            "model.lora_alpha=8",
            "--set",
            "data.chat_overflow=truncate",
            "--set",
            "data.chat_loss=all",
            "--set",
            f"train.lr={lr}",
            "--set",
            "train.warmup_steps=1",
        )
    return runs


def _peft_modules(config: dict, names) -> set[str]:
    """The modules PEFT adapts: those whose name is a target or ends with "." + a target."""
    return {n for n in names for t in config["target_modules"] if n == t or n.endswith("." + t)}


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_the_exported_adapter_is_laid_out_as_peft_writes_it(lora_runs, tmp_path, name):
    """Against adapters PEFT itself saved for the same model (tests/make_peft_fixtures.py): the
    same tensors by name and shape, and a config that PEFT resolves to the same modules, with
    its rank, alpha and Conv1D flag. (PeftModel.from_pretrained on the export gives megajax's
    logits: checked by hand, as PEFT needs torch.)"""
    from safetensors.numpy import load_file

    from megajax.convert import export_adapter

    export_adapter(lora_runs[name], tmp_path / "adapter")
    ours = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    theirs = load_file(PEFT / name / "adapter_model.safetensors")
    assert {k: v.shape for k, v in ours.items()} == {k: v.shape for k, v in theirs.items()}
    assert all(np.abs(v).max() > 0 for k, v in ours.items())  # trained B, and A
    mine = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    peft = json.loads((PEFT / name / "adapter_config.json").read_text())
    for key in ("peft_type", "task_type", "r", "lora_alpha", "fan_in_fan_out", "bias"):
        assert mine[key] == peft[key], key
    modules = {k.split(".lora_")[0].removeprefix("base_model.model.") for k in theirs}
    assert _peft_modules(mine, modules) == _peft_modules(peft, modules) == modules


def test_merge_folds_the_adapters_into_a_whole_model(lora_runs, tmp_path):
    """megajax-convert merge: an HF directory whose logits (imported back) are the LoRA run's;
    a plain export of a LoRA run is refused in one line."""
    from megajax.convert import import_hf
    from megajax.core.mesh import make_mesh
    from megajax.runs.workdir import load_workdir

    p = cli("convert", "merge", "--workdir", lora_runs["llama"], "--out", tmp_path / "merged")
    assert p.returncode == 0, p.stderr
    refused = cli("convert", "export", "--workdir", lora_runs["llama"], "--out", tmp_path / "whole")
    assert refused.returncode == 2 and "--adapter" in refused.stderr
    assert not (tmp_path / "whole").exists()
    import_hf(tmp_path / "merged", tmp_path / "back", [])
    mesh = make_mesh("1x1", devices=jax.devices()[:1])
    adapted, merged = (load_workdir(w, mesh).model for w in (lora_runs["llama"], tmp_path / "back"))
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 320, (2, 24)), jnp.int32)
    want = np.asarray(adapted(tokens))[..., :320]
    assert_close(np.asarray(merged(tokens))[..., :320], want, F32)


def test_the_dry_run_counts_optimizer_state_for_the_adapters_alone(devices):
    """`train.py --dry-run`'s optimizer bytes: Adam's two moments of the adapters (and its
    step counters), none for the frozen base; gradients the adapters' too."""
    from megajax.tools.dry_run import dry_run_report
    from megajax.training.memory import per_device_bytes

    cfg = lora_config(LLAMA, {"shard_optimizer": True})
    report = dry_run_report(cfg, mesh_for("2x4"), out=lambda *_: None)
    trainer = make_trainer(cfg, mesh_for("2x4"))
    params, opt = trainer.abstract_state()
    adapters = per_device_bytes(trainer.trained(params))
    assert report["gradient_bytes_per_device"] == adapters < per_device_bytes(params) / 10
    assert report["optimizer_bytes_per_device"] == per_device_bytes(opt)
    # the state's arrays are the adapters' two moments (split over "data" by ZeRO-1), nothing else
    arrays = sorted(x.shape for x in jax.tree.leaves(opt) if x.ndim)
    assert arrays == sorted(2 * [x.shape for x in jax.tree.leaves(trainer.trained(params))])
    assert per_device_bytes(opt) < 2 * adapters
    assert report["trained_params"] == cfg.model.num_layers * cfg.model.adapter_params


def test_init_from_a_lora_run_starts_from_its_adapted_model(lora_runs, tmp_path):
    """A run without adapters initialised from a LoRA run starts from the model the adapters
    make (folded into the base): after one step at the warmup's learning rate of 0, its logits
    are the LoRA run's."""
    from megajax.core.mesh import make_mesh
    from megajax.runs.workdir import load_workdir

    p = run(
        "--init-from",
        str(lora_runs["llama"]),
        "--data",
        f"chat:{CHAT}",
        "--workdir",
        str(tmp_path / "plain"),
        "--steps",
        "1",
        "--host-devices",
        "1",
        "--mesh",
        "1x1",
        "--sample-tokens",
        "0",
        "--set",
        "data.chat_overflow=truncate",
    )
    assert "its LoRA adapters folded into the base weights" in p.stdout
    mesh = make_mesh("1x1", devices=jax.devices()[:1])
    adapted, plain = (load_workdir(w, mesh) for w in (lora_runs["llama"], tmp_path / "plain"))
    assert plain.cfg.model.lora_rank == 0
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, 320, (2, 24)), jnp.int32)
    want = np.asarray(adapted.model(tokens))[..., :320]
    assert_close(np.asarray(plain.model(tokens))[..., :320], want, F32)


@pytest.mark.parametrize(
    "sets,says",
    [
        (["model.lora_rank=-1"], "model.lora_rank must be 0"),
        (["model.lora_rank=4", "model.lora_targets=qkv,proj"], "model.lora_targets names layers"),
        (["model.lora_rank=4", "model.lora_dropout=1"], "lora_dropout in [0, 1)"),
        (["model.lora_rank=4", "train.layer_programs=true"], "train.layer_programs trains every"),
    ],
)
def test_lora_settings_a_user_gets_wrong_are_one_line(sets, says):
    from megajax.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=says.replace("[", r"\[").replace(")", r"\)")):
        load_config("tiny", sets)
    with pytest.raises(ConfigError, match="LoRA adapters .* are for GPT decoders"):
        load_config("bert_tiny", ["model.lora_rank=4"])


def test_adapters_without_a_pretrained_base_are_refused_unless_asked_for(tmp_path):
    """LoRA freezes the base: without --init-from it would be train.seed's random weights, and
    the adapters would learn to patch noise. Refused in one line, before anything is written;
    train.random_base=true asks for it, and trains only the adapters."""
    args = [
        "--config",
        "tiny",
        "--data",
        f"chat:{CHAT}",
        "--tokenizer",
        "chars",
        "--steps",
        "1",
        "--sample-tokens",
        "0",
        "--set",
        "model.lora_rank=4",
        "--set",
        "data.chat_overflow=truncate",
        "--set",
        "data.chat_loss=all",
    ]
    p = run(*args, "--workdir", tmp_path / "w", check=False)
    assert p.returncode == 2 and p.stderr == (
        "error: LoRA trains adapters on a frozen base: give the pretrained base with --init-from "
        "DIR (--set train.random_base=true adapts random weights)\n"
    ), p.stderr
    assert not (tmp_path / "w").exists()
    p = run(*args, "--set", "train.random_base=true", "--workdir", tmp_path / "r")
    assert "done: 1 steps" in p.stdout
