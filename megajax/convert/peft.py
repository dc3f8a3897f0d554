"""LoRA adapters out of a workdir: in PEFT's format (adapter_config.json and
adapter_model.safetensors, which `PeftModel.from_pretrained` loads onto the exported base
model), or folded into the base weights and exported as a whole Hugging Face model.

The adapters follow their layer's kernel through the HF rules (hf_weights.py): a kernel K
(in, out) of form `linear` is W = K^T in HF, so K + s A B is W + s B^T A^T, and PEFT's
lora_A.weight is A^T (rank, in), its lora_B.weight the form's own rearrangement of B's columns,
transposed (out, rank); a fused q|k|v kernel gives each of q_proj, k_proj and v_proj the shared
A and its own columns of B. GPT-2's Conv1D layers store (in, out), which PEFT's fan_in_fan_out
takes as it is.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import numpy as np
from safetensors.numpy import save_file

from megajax.convert import hf_config
from megajax.convert.hf import write_hf_model
from megajax.convert.hf_weights import LAYER, PREFIX, _expand, _flatten, rules_for, to_hf
from megajax.core.lora import folded
from megajax.core.mesh import single_device_mesh
from megajax.errors import UserError
from megajax.files import staged_directory, write_atomic
from megajax.models.registry import ModelDef
from megajax.runs.workdir import load_workdir

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
CONV1D_FORMS = ("as_is", "qkv_fused")  # GPT-2's Conv1D: fan_in_fan_out


def _adapter_names(ours: str) -> tuple[str, str] | None:
    """(A's, B's) dotted names for a rule's kernel, or None for a weight that is no kernel."""
    parent, _, leaf = ours.rpartition(".")
    if leaf == "kernel":
        return f"{parent}.lora.a", f"{parent}.lora.b"
    if leaf.endswith("_kernel"):
        return f"{parent}.lora.a", f"{parent}.lora.b_{leaf.removesuffix('_kernel')}"
    return None


def adapter_tensors(arch: str, params: dict, cfg) -> tuple[dict, list[str], bool]:
    """(PEFT's tensors, the adapted modules' names, whether they are Conv1D) of a params dict
    (numpy) with adapters."""
    flat, per_layer = _flatten(params, cfg)
    out, modules, conv = {}, [], False
    for rule in rules_for(arch, cfg):
        names = _adapter_names(rule.ours)
        if names is None:
            continue
        for hf_names, _ours, i in _expand(rule, cfg):
            source = flat if i is None else per_layer[i]
            a_name, b_name = (n.removeprefix(LAYER) for n in names)
            if a_name not in source:
                continue  # a layer model.lora_targets leaves out
            a, bs = source[a_name], to_hf(rule.form, source[b_name], cfg)
            conv = conv or rule.form in CONV1D_FORMS
            for hf_name, b in zip(hf_names, bs):
                module = PREFIX.get(arch, "") + hf_name.removesuffix(".weight")
                b = b.T if rule.form in CONV1D_FORMS else b  # (out, rank) either way
                out[f"base_model.model.{module}.lora_A.weight"] = np.ascontiguousarray(a.T)
                out[f"base_model.model.{module}.lora_B.weight"] = np.ascontiguousarray(b)
                modules.append(module)
    return {k: v.astype(np.float32) for k, v in out.items()}, modules, conv


def adapter_config(cfg, modules: list[str], conv: bool, base: str) -> dict:
    """PEFT's LoraConfig for the adapters: each module named by its last two parts (q_proj's
    `self_attn.q_proj`), which PEFT matches at the end of a module's name."""
    m = cfg.model
    targets = sorted({".".join(name.split(".")[-2:]) for name in modules})
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": m.lora_rank,
        "lora_alpha": m.lora_alpha,
        "lora_dropout": m.lora_dropout,
        "bias": "none",
        "target_modules": targets,
        "fan_in_fan_out": conv,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "base_model_name_or_path": base,
    }


def merged(params: dict, cfg) -> tuple[dict, object]:
    """(params with every adapter folded into its kernel and none left, numpy; the config
    without adapters)."""
    m = cfg.model
    params = jax.tree.map(lambda x: np.asarray(x, np.float32), folded(params, m))
    return params, dataclasses.replace(cfg, model=dataclasses.replace(m, lora_rank=0))


def _loaded_adapters(workdir: Path, step):
    loaded = load_workdir(Path(workdir), single_device_mesh(), step)
    if not loaded.cfg.model.lora_rank:
        raise UserError(
            f"{workdir} has no LoRA adapters (model.lora_rank is 0): export it whole with "
            "megajax-convert export"
        )
    params = jax.tree.map(np.asarray, ModelDef(loaded.model).params(loaded.model))
    return loaded, params


def export_adapter(workdir, out_dir, step: int | None = None, base: str = "") -> list[str]:
    """PEFT's adapter files for a workdir's adapters; returns notes for the user."""
    loaded, params = _loaded_adapters(workdir, step)
    arch = hf_config.hf_config(loaded.cfg.model)["model_type"]
    tensors, modules, conv = adapter_tensors(arch, params, loaded.cfg.model)
    config = adapter_config(loaded.cfg, modules, conv, base)
    with staged_directory(Path(out_dir), "--out") as tmp:
        write_atomic(tmp / CONFIG, json.dumps(config, indent=1) + "\n")
        save_file(tensors, str(tmp / WEIGHTS), metadata={"format": "pt"})
    return [
        f"step {loaded.step} of {workdir}: LoRA adapters of {len(modules)} modules written to "
        f"{out_dir} (PEFT: PeftModel.from_pretrained(base, '{out_dir}'))"
    ]


def merge_export(workdir, out_dir, step: int | None = None) -> list[str]:
    """The base with the adapters folded in, as a Hugging Face model directory."""
    loaded, params = _loaded_adapters(workdir, step)
    params, cfg = merged(params, loaded.cfg)
    notes = write_hf_model(Path(workdir), Path(out_dir), cfg.model, params, loaded.tokenizer)
    return [f"step {loaded.step} of {workdir}, adapters merged, written to {out_dir}", *notes]


__all__ = ["adapter_config", "adapter_tensors", "export_adapter", "merge_export", "merged"]
