"""A run's workdir: what is in it, and reading it back.

    WORKDIR/config.json        the resolved config (vocabulary size included)
    WORKDIR/tokenizer.json     the tokenizer (and its vocab.txt / hf_tokenizer.json)
    WORKDIR/checkpoints/STEP   orbax checkpoints (megajax/runs/checkpoint.py)
    WORKDIR/damaged/STEP       checkpoints that could not be read, set aside
    WORKDIR/diverged/STEP      checkpoints whose weights gave a non-finite loss, set aside
    WORKDIR/metrics.jsonl      one JSON record per logged step and evaluation
    WORKDIR/loss.png           the loss curve
    WORKDIR/tensorboard/       TensorBoard event files (and WORKDIR/wandb/: W&B's run, if asked)

Also here: `--init-from`, which takes a run's model shape and weights from another workdir
(a pretrained BERT's encoder for fine-tuning, a GPT's every weight to train it further, or a
Hugging Face model imported by megajax-convert).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

import jax

from megajax.config import Config, load_config
from megajax.core.lora import folded
from megajax.core.mesh import as_mesh, check_fits
from megajax.core.sharding import Layout, param_shardings
from megajax.data.tokenizer import FILE as TOKENIZER_FILE
from megajax.data.tokenizer import Tokenizer, load_tokenizer
from megajax.errors import UserError
from megajax.model_config import ARCHITECTURE
from megajax.models import vocab_rows
from megajax.models.registry import ModelDef, abstract_model
from megajax.runs.checkpoint import Checkpoints
from megajax.specs import is_blend

CONFIG_FILE = "config.json"
CHECKPOINTS = "checkpoints"
FILES = (CONFIG_FILE, TOKENIZER_FILE, "metrics.jsonl", "loss.png")
DIRECTORIES = (CHECKPOINTS, "damaged", "diverged", "tensorboard", "wandb")


def is_main() -> bool:
    """Process 0 writes the workdir's files and prints; every process reads and computes."""
    return jax.process_index() == 0


def check_layout(workdir: Path, writing: bool = True):
    """What the workdir holds is of the kind megajax makes (a file where it keeps a file, a
    directory where it keeps one) and, for a run that will write there, writable: refused in
    one line before anything is read or written, not met halfway through a save."""
    for name in FILES + DIRECTORIES if writing else (CONFIG_FILE, TOKENIZER_FILE, CHECKPOINTS):
        path = Path(workdir) / name
        if not path.exists():
            continue
        directory = name in DIRECTORIES
        if path.is_dir() != directory:
            raise UserError(
                f"{path} is a {'file' if directory else 'directory'}, where megajax keeps its "
                f"{'directory' if directory else 'file'} of that name: move it away, or use "
                "another --workdir"
            )
        if writing and not os.access(path, os.W_OK | (os.X_OK if directory else 0)):
            raise UserError(f"{path} is not writable: make it writable, or use another --workdir")
    # Another program's directory (a Hugging Face model's, a prepared corpus): a run there would
    # replace its config.json, or take its tokenizer.json for the run's own.
    config = Path(workdir) / CONFIG_FILE
    names = [
        n
        for n in FILES + DIRECTORIES
        if (Path(workdir) / n).exists() and not _left_by_a_start(Path(workdir) / n)
    ]
    if not _megajax_config(config) if config.is_file() else writing and names:
        raise UserError(
            f"{workdir} is not a megajax workdir: it holds another program's files "
            f"({', '.join(names)}); "
            + ("give a new or empty --workdir" if writing else "a Hugging Face model directory?")
            + " (megajax-convert import makes a workdir of a Hugging Face model)"
        )


def _left_by_a_start(path: Path) -> bool:
    """What a run killed before it wrote config.json can have left: its checkpoints directory,
    made when the checkpoint manager opens, holding nothing or only the temporary directory of a
    first save that never committed (orbax's `STEP.orbax-checkpoint-tmp*`, removed when a run
    opens it again). No step of anyone's is in it, so a run may start there afresh."""
    if path.name != CHECKPOINTS or not path.is_dir():
        return False
    try:
        return all(".orbax-checkpoint-tmp" in entry.name for entry in path.iterdir())
    except OSError:
        return False


def _megajax_config(path: Path) -> bool:
    """Whether config.json is a megajax run's ({"model": {...}, "train": {...}, ...}), not another
    program's of the same name (Hugging Face's)."""
    try:
        config = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return True  # unreadable: load_config says why in its own line
    return (
        isinstance(config, dict)
        and isinstance(config.get("model"), dict)
        and isinstance(config.get("train"), dict)
    )


def refuse_run_file(out: Path, may_write: tuple[str, ...] = ()):
    """An output path (eval.py's or megajax-plot's --out) that would replace what a workdir keeps
    (its config, tokenizer, metrics, loss curve, anything in its checkpoints) is refused: a
    workdir without one of them cannot resume or be evaluated. `may_write`: the caller's own."""
    out = Path(os.path.abspath(out))
    for below, parent in zip((out, *out.parents), out.parents):
        if not ((parent / CONFIG_FILE).is_file() and (parent / TOKENIZER_FILE).is_file()):
            continue  # not a workdir
        if below == out and out.name in FILES and out.name not in may_write:
            raise UserError(
                f"--out {out} is the {out.name} of the workdir {parent}: give another file"
            )
        if below != out and below.name in DIRECTORIES:
            raise UserError(
                f"--out {out} is inside the {below.name} directory of the workdir {parent}: give "
                "another file"
            )


def write_run_files(cfg: Config, workdir: Path, tokenizer: Tokenizer):
    """config.json (rewritten: a resumed run may change steps or intervals) and the tokenizer
    (written once: its ids are in the checkpoints)."""
    workdir.mkdir(parents=True, exist_ok=True)
    if is_main():
        cfg.save(workdir / CONFIG_FILE)
        if not (workdir / TOKENIZER_FILE).exists():
            tokenizer.save(workdir)


def run_tokenizer(workdir: Path, pretrained: Path | None) -> Tokenizer | None:
    """The tokenizer a run must use: the workdir's own when resuming, else the pretrained
    workdir's when fine-tuning; None when the run makes its own from data.tokenizer. A workdir
    with checkpoints but no tokenizer file is refused: a vocabulary made again from the data
    need not give its tokens the ids the checkpoints were trained on."""
    workdir = Path(workdir)
    if (workdir / TOKENIZER_FILE).exists():
        return load_tokenizer(workdir)
    if has_checkpoints(workdir):
        raise UserError(
            f"{workdir} has checkpoints but no {TOKENIZER_FILE}, which holds the token ids they "
            "were trained on: put the file back, or use another --workdir"
        )
    return load_tokenizer(pretrained) if pretrained is not None else None


def has_checkpoints(workdir: Path) -> bool:
    directory = Path(workdir) / CHECKPOINTS
    return directory.is_dir() and any(p.name.isdigit() for p in directory.iterdir())


def check_same_tokenizer(cfg: Config, workdir: Path):
    """A workdir keeps the tokenizer it was started with (its ids are in the checkpoints):
    asking for another one on resume is refused rather than silently ignored."""
    saved = Path(workdir) / CONFIG_FILE
    if saved.is_file() and (Path(workdir) / TOKENIZER_FILE).is_file():
        before = load_config(str(saved)).data.tokenizer
        if before != cfg.data.tokenizer:
            raise UserError(
                f"{workdir} was trained with tokenizer '{before}', not '{cfg.data.tokenizer}': "
                f"resume without --tokenizer (or with '{before}'), or use another --workdir"
            )


def check_same_blend(cfg: Config, workdir: Path):
    """A blend's batches follow from its weights and sources (megajax/data/blend.py): resuming
    with others would take samples again or skip them, so it is refused."""
    saved = Path(workdir) / CONFIG_FILE
    if not (saved.is_file() and has_checkpoints(workdir)):
        return
    before, now = load_config(str(saved)).data.source, cfg.data.source
    if (is_blend(before) or is_blend(now)) and before.split() != now.split():
        raise UserError(
            f"{workdir} was trained on data '{before}', not '{now}': a blend's batches follow from "
            "its weights and sources; resume with the same --data, or use another --workdir"
        )


# Fields a fine-tuning run takes from its pretrained workdir: they fix the weights' shapes.
PRETRAINED_SHAPE = (
    "kind",
    "num_layers",
    "hidden",
    "num_heads",
    "ffn_hidden",
    "seq_len",
    "vocab_size",
    "vocab_multiple",
    "ln_placement",
    "ln_eps",
    "scan_layers",
    *ARCHITECTURE,
)


def with_pretrained_shape(cfg: Config, workdir: Path | None = None) -> tuple[Config, Path | None]:
    """With train.init_from: the config with the model's shape taken from that workdir's
    config (or, when this run is resuming, from its own saved one), and the pretrained
    workdir. Without: the config unchanged and None."""
    if not cfg.train.init_from:
        return cfg, None
    src = Path(cfg.train.init_from)
    own = Path(workdir) / CONFIG_FILE if workdir is not None else None
    resuming = own is not None and own.is_file() and (own.parent / CHECKPOINTS).is_dir()
    if not resuming and not (src / CONFIG_FILE).is_file():
        raise UserError(f"--init-from {src}: not a megajax workdir (no {CONFIG_FILE})")
    pre = load_config(str(own if resuming else src / CONFIG_FILE))
    if pre.model.kind != cfg.model.kind:
        raise UserError(
            f"--init-from {src} holds a {pre.model.kind} model; this run trains a {cfg.model.kind}"
        )
    shape = {name: getattr(pre.model, name) for name in PRETRAINED_SHAPE}
    # The tokenizer is the pretrained one too (run_tokenizer): config.json says so.
    return dataclasses.replace(
        cfg,
        model=dataclasses.replace(cfg.model, **shape),
        data=dataclasses.replace(cfg.data, tokenizer=pre.data.tokenizer),
    ), src


def refuse_overridden_shape(cfg: Config, decided: Config, overrides: list[str]):
    """With train.init_from the pretrained workdir decides the model's shape and the tokenizer
    (`decided` is with_pretrained_shape's config): a command-line override that decision would
    change is refused, not silently ignored."""
    if not cfg.train.init_from:
        return
    for key in dict.fromkeys(item.partition("=")[0].strip() for item in overrides):
        section, _, name = key.partition(".")
        asked, kept = (getattr(getattr(c, section, None), name, None) for c in (cfg, decided))
        if asked != kept:
            raise UserError(
                f"--init-from {cfg.train.init_from} decides {key} ({kept!r}): drop the override "
                f"{key}={asked!r}"
            )


@dataclasses.dataclass
class Loaded:
    cfg: Config
    model: object
    tokenizer: Tokenizer
    step: int


def workdir_config(workdir: Path) -> Config:
    """The resolved config a train.py workdir holds (config.json), read without writing."""
    workdir = Path(workdir)
    check_layout(workdir, writing=False)
    if not (workdir / CONFIG_FILE).is_file():
        raise UserError(f"{workdir} is not a megajax workdir (no {CONFIG_FILE})")
    return load_config(str(workdir / CONFIG_FILE))


def load_workdir(workdir: Path, mesh, step: int | None = None, cfg: Config | None = None) -> Loaded:
    """The resolved config, tokenizer and checkpointed weights of a train.py workdir, on `mesh`
    (whatever mesh trained it), as a model for inference (Layout.for_model). Reads only:
    nothing in the workdir is created or moved. `cfg`: its config, when the caller has read it
    (eval.py's RunSpec)."""
    workdir = Path(workdir)
    cfg, mesh = cfg or workdir_config(workdir), as_mesh(mesh)
    step = None if step is None else int(step)  # "2" from a command line or a file name
    check_fits(cfg, mesh, batch=False)
    tokenizer = load_tokenizer(workdir)
    ckpts = Checkpoints(workdir, writer=False) if (workdir / CHECKPOINTS).is_dir() else None
    steps = ckpts.all_steps() if ckpts else []
    if not steps:
        raise UserError(f"no checkpoint in {workdir / CHECKPOINTS}")
    if step is not None and step not in steps:
        raise UserError(f"no checkpoint for step {step} in {workdir}; have {sorted(steps)}")
    modeldef = ModelDef(abstract_model(cfg.model, Layout.for_model(mesh, cfg.model, "inference")))
    on_mesh = modeldef.abstract_sharded_params(param_shardings(mesh, modeldef.specs()))
    target = vocab_rows.checkpoint_target(on_mesh, cfg.model.padded_vocab)
    if step is not None:
        params, _ = ckpts.restore_params(step, target)
    else:  # the newest one that reads back, as train.py resumes
        found = ckpts.restore_newest_intact(
            lambda s: ckpts.restore_params(s, target),
            warn=lambda line: print(line, file=sys.stderr),
            set_aside=False,
        )
        # all removed meanwhile (by a run that has since restarted from scratch?)
        if found is None:
            raise UserError(f"no checkpoint in {workdir / CHECKPOINTS}")
        step, (params, _) = found
    ckpts.close()
    return Loaded(cfg, modeldef.bind(vocab_rows.for_mesh(params, on_mesh)), tokenizer, step)


def run_vocab_size(cfg: Config, pretrained: Path | None, tokenizer_vocab: int) -> int:
    """The model's vocabulary: the tokenizer's, or with --init-from the pretrained model's, which
    may be larger (Megatron and many HF models pad it) but never smaller than the tokenizer."""
    if pretrained is None:
        return tokenizer_vocab
    if tokenizer_vocab > cfg.model.vocab_size:
        raise UserError(
            f"the tokenizer has {tokenizer_vocab} tokens but the model in {pretrained} only "
            f"{cfg.model.vocab_size} embedding rows"
        )
    return cfg.model.vocab_size


def init_from_pretrained(trainer, params: dict, src: Path, out=print) -> dict:
    """Fresh params with every tensor that the pretrained workdir also has (a GPT's every
    weight, a BERT's encoder and pooler) replaced by its checkpointed value, placed straight
    into this mesh's shardings. A tensor both have in different shapes is an error, not a
    silent fresh start."""
    loaded = load_workdir(src, trainer.mesh)
    weights = ModelDef(loaded.model).params(loaded.model)
    if loaded.cfg.model.lora_rank and not trainer.cfg.model.lora_rank:
        # a LoRA run's model is its base with the adapters: this run starts from that
        weights = folded(weights, loaded.cfg.model)
        if is_main():
            out(f"--init-from {src}: its LoRA adapters folded into the base weights")
    pre = {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(weights)[0]}
    taken, new = set(), set()

    def pick(path, x):
        name = jax.tree_util.keystr(path)
        top = "LoRA adapters" if "'lora'" in name else name.split("'")[1]
        if name in pre and pre[name].shape != x.shape:
            raise UserError(
                f"--init-from {src}: {name} is {pre[name].shape} there but {x.shape} in this run"
            )
        if name in pre:
            taken.add(top)
            return jax.device_put(pre[name], x.sharding)  # this run's sharding (FSDP's split, say)
        new.add(top)
        return x

    params = jax.tree_util.tree_map_with_path(pick, params)
    if is_main():
        out(
            f"initialised from {src} (step {loaded.step}): {', '.join(sorted(taken))}; new: "
            f"{', '.join(sorted(new)) or 'nothing'}"
        )
    return params
