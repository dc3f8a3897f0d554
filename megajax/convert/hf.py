"""Hugging Face model directories in and out of megajax workdirs.

    import_hf(hf_dir, workdir)   config.json + model.safetensors + tokenizer files -> a workdir
                                 (config.json, tokenizer, an orbax checkpoint at step 0 with a
                                 fresh optimizer state) that train.py, eval.py and generation
                                 read like any other, on any mesh
    export_hf(workdir, out_dir)  the inverse, from a checkpoint saved on any mesh, loaded here
                                 on one device: a directory `from_pretrained` loads

Weights are read with the `safetensors` package's NumPy API: no PyTorch.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path

import jax

# Registers bfloat16 with NumPy: safetensors reads bf16 weights through it.
import ml_dtypes  # noqa: F401
import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load_file, save_file

from megajax.config import Config, ConfigError, apply_overrides
from megajax.convert import hf_config, hf_decoders, hf_weights
from megajax.convert.hf_tokenizer import read_tokenizer, write_tokenizer
from megajax.core.mesh import single_device_mesh
from megajax.data.chat_template import TOKENIZER_EXTRAS
from megajax.data.tokenizer import HF_FILE, VOCAB_FILE, WordPieceTokenizer
from megajax.errors import UserError, first_line
from megajax.files import staged_directory, write_atomic
from megajax.model_config import ARCHITECTURE
from megajax.models.registry import ModelDef, abstract_model
from megajax.runs.checkpoint import Checkpoints
from megajax.runs.workdir import CONFIG_FILE, load_workdir
from megajax.training.optimizer import make_optimizer

WEIGHTS = "model.safetensors"


class ExportNote(UserWarning):
    """What an export could not carry over (a tokenizer with no Hugging Face file): warned to a
    Python caller, printed by megajax-convert with its other notes."""


INDEX = "model.safetensors.index.json"
# Model fields the HF config decides: a --set of one of them would contradict the weights.
FROM_HF = (
    "kind",
    "task",
    "num_layers",
    "hidden",
    "num_heads",
    "ffn_hidden",
    "seq_len",
    "vocab_size",
    "ln_placement",
    "ln_eps",
    "gelu",
    *ARCHITECTURE,
)


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise UserError(f"{path} is not valid JSON") from None
    if not isinstance(value, dict):
        raise UserError(f"{path} is not a JSON object")
    return value


def read_tensors(hf_dir: Path) -> dict:
    """name -> NumPy array from model.safetensors (or the shards its index names)."""
    if (hf_dir / INDEX).is_file():
        files = sorted(set(_read_json(hf_dir / INDEX).get("weight_map", {}).values()))
    elif (hf_dir / WEIGHTS).is_file():
        files = [WEIGHTS]
    elif any((hf_dir / n).is_file() for n in ("pytorch_model.bin", "pytorch_model.bin.index.json")):
        raise UserError(
            f"{hf_dir} has PyTorch weights (pytorch_model.bin) but no {WEIGHTS}: convert them once "
            "where transformers is installed: "
            "AutoModelForPreTraining.from_pretrained(DIR).save_pretrained(DIR, "
            "safe_serialization=True)"
        )
    else:
        raise UserError(f"no {WEIGHTS} in {hf_dir}")
    tensors = {}
    for name in files:
        try:
            tensors.update(load_file(hf_dir / name))
        except (SafetensorError, OSError, ValueError) as e:
            raise UserError(f"{hf_dir / name} cannot be read ({first_line(e, 120)})") from None
    return tensors


def hf_run_config(hf_dir: Path, overrides: list[str] | None = None) -> tuple[str, Config]:
    """(model_type, Config) of an HF directory, with --set overrides of what HF does not decide."""
    hf_dir = Path(hf_dir)
    if not (hf_dir / "config.json").is_file():
        raise UserError(f"{hf_dir} is not a Hugging Face model directory (no config.json)")
    hf = _read_json(hf_dir / "config.json")
    # Rotary positions leave the training length free: --set model.seq_len=N picks it.
    rotary = hf_config.ARCHITECTURES[hf_config.architecture(hf)][0] in hf_decoders.MODEL_TYPES
    base = import_base(overrides, str(hf_dir / "config.json"), free=("seq_len",) if rotary else ())
    seq_len_given = any(
        item.split("=", 1)[0].strip() == "model.seq_len" for item in overrides or []
    )
    model_type, model = hf_config.model_config(hf, base.model, seq_len_given)
    cfg = dataclasses.replace(base, model=model, name=hf_dir.resolve().name)
    return model_type, cfg.validate()


def import_base(overrides: list[str] | None, source: str, free: tuple[str, ...] = ()) -> Config:
    """The defaults with --set overrides of what the imported model does not decide (`free`:
    model fields it leaves open)."""
    for item in overrides or []:
        key = item.split("=", 1)[0].strip()
        if (
            key.startswith("model.")
            and key.removeprefix("model.") in FROM_HF
            and key.removeprefix("model.") not in free
        ):
            raise ConfigError(f"{key} comes from {source} and cannot be set on import")
    return apply_overrides(Config(), overrides)


def import_hf(hf_dir, workdir, overrides: list[str] | None = None) -> Config:
    """Write a megajax workdir holding the HF model in `hf_dir`; returns its config."""
    hf_dir, workdir = Path(hf_dir), Path(workdir).absolute()
    model_type, cfg = hf_run_config(hf_dir, overrides)
    tensors = read_tensors(hf_dir)
    params = hf_weights.from_hf(model_type, tensors, cfg.model)
    check_shapes(params, cfg)
    with staged_directory(workdir, "--workdir") as tmp:
        tokenizer = read_tokenizer(hf_dir, tmp)
        if tokenizer.vocab_size > cfg.model.vocab_size:
            raise UserError(
                f"the tokenizer has {tokenizer.vocab_size} tokens but the model's embedding only "
                f"{cfg.model.vocab_size} rows"
            )
        tokenizer.save(tmp)
        copy_tokenizer_extras(hf_dir, tmp, tokenizer)
        cfg = dataclasses.replace(
            cfg, data=dataclasses.replace(cfg.data, tokenizer=workdir_spec(tokenizer, workdir))
        )
        cfg.save(tmp / CONFIG_FILE)
        save_step0(tmp, cfg, params, source=str(hf_dir))
    return cfg


def copy_tokenizer_extras(src: Path, dst: Path, tokenizer):
    """A fast tokenizer's companion files, from an HF directory or a workdir, to the other."""
    if getattr(tokenizer, "kind", None) != "hf":
        return
    for name in TOKENIZER_EXTRAS:
        if (src / name).is_file():
            write_atomic(dst / name, (src / name).read_bytes())


def workdir_spec(tokenizer, workdir: Path, given: str | None = None) -> str:
    """The tokenizer spec a workdir's config records: its own copy of a vocabulary file."""
    if isinstance(tokenizer, WordPieceTokenizer):
        return f"wordpiece:{workdir / VOCAB_FILE}"
    if tokenizer.kind == "hf":
        return f"hf:{workdir / HF_FILE}"
    return given or tokenizer.kind


def check_shapes(params: dict, cfg: Config):
    want = ModelDef(abstract_model(cfg.model)).abstract_params()
    got = jax.tree.map(lambda x: x.shape, params)
    if jax.tree.map(lambda x: x.shape, want) != got:
        raise UserError(
            "the converted weights do not have the model's shapes (a config.json that contradicts "
            "model.safetensors)"
        )


def save_step0(workdir: Path, cfg: Config, params: dict, source: str):
    """Step 0: the weights and a fresh optimizer state, so train.py can also resume in place."""
    with jax.default_device(single_device_mesh().devices.flat[0]):
        params = jax.tree.map(jax.numpy.asarray, params)
        opt_state = make_optimizer(cfg).init(params)
        ckpts = Checkpoints(workdir, async_save=False)
        failure = ckpts.save(
            0, params, opt_state, {"step": 0, "config": cfg.name, "imported_from": source}
        )
        ckpts.close()
    if failure is not None:
        raise UserError(f"could not write the checkpoint: {failure[1]}")


def export_hf(workdir, out_dir, step: int | None = None) -> list[str]:
    """Write an HF model directory from a workdir's checkpoint; returns notes for the user."""
    loaded = load_workdir(Path(workdir), single_device_mesh(), step)
    if loaded.cfg.model.lora_rank:
        raise UserError(
            f"{workdir} holds LoRA adapters on its base model: export them with --adapter (PEFT's "
            "format), or fold them into the base with megajax-convert merge"
        )
    params = jax.tree.map(np.asarray, ModelDef(loaded.model).params(loaded.model))
    notes = write_hf_model(Path(workdir), Path(out_dir), loaded.cfg.model, params, loaded.tokenizer)
    arch = hf_config.hf_config(loaded.cfg.model)["architectures"][0]
    return [f"step {loaded.step} of {workdir} written to {out_dir} as {arch}", *notes]


def write_hf_model(workdir: Path, out_dir: Path, model_cfg, params: dict, tokenizer) -> list[str]:
    """config.json, model.safetensors and the tokenizer of a model (params: numpy) in a new HF
    directory, which appears whole or not at all; returns notes for the user."""
    config = hf_config.hf_config(model_cfg)
    eos, bos = tokenizer.eos_id, getattr(tokenizer, "bos_id", None)
    if model_cfg.kind == "gpt" and eos is not None:  # GPT-2's <|endoftext|> opens and ends
        config.update(bos_token_id=eos if bos is None else bos, eos_token_id=eos)
    tensors = hf_weights.to_hf_tensors(config["model_type"], params, model_cfg)
    notes = []
    with staged_directory(out_dir, "--out") as tmp:
        write_atomic(tmp / "config.json", json.dumps(config, indent=1) + "\n")
        save_file(tensors, str(tmp / WEIGHTS), metadata={"format": "pt"})
        if (note := write_tokenizer(tokenizer, tmp)) is not None:
            notes.append(note)
            warnings.warn(f"{out_dir}: {note}", ExportNote, stacklevel=3)
        copy_tokenizer_extras(workdir, tmp, tokenizer)
    return notes
