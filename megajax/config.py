"""Typed run configuration: model shape, training recipe and data, loaded from configs/*.toml.

A config file has up to three tables, [model], [train] and [data], whose keys are the fields
below; anything not given keeps its default. `base = "name"` at the top inherits another config.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import json
import re
import tomllib
import typing
from pathlib import Path

from megajax.files import write_atomic
from megajax.model_config import REMAT_ALIASES, ConfigError, ModelConfig, one_of
from megajax.schedules import SCHEDULES
from megajax.specs import DataSpec, is_blend


def _config_dir() -> Path:
    """configs/ of a checkout, or the copy installed with the package (pip install .)."""
    here = Path(__file__).resolve().parent
    checkout = here.parent / "configs"
    return checkout if checkout.is_dir() else here / "configs"


CONFIG_DIR = _config_dir()


FLOAT32_TINY, FLOAT32_MAX = 2.0**-126, (2 - 2.0**-23) * 2.0**127  # float32 arrays hold these
MAX_LOSS_SCALE = 2.0**32


# train.py's flags that are shorthands for config keys (--steps N is --set train.steps=N)
FLAG_KEYS = (
    ("steps", "train.steps"),
    ("log_every", "train.log_every"),
    ("eval_every", "train.eval_every"),
    ("save_every", "train.save_every"),
    ("data", "data.source"),
    ("tokenizer", "data.tokenizer"),
    ("init_from", "train.init_from"),
    ("tracker", "train.tracker"),
)


def in_python_terms(message: str) -> str:
    """A message written for train.py's user, for a caller of megajax.train(cfg, mesh, workdir):
    `--set model.x=1` is `cfg.model.x = 1`, `--steps` is `cfg.train.steps`, `--workdir` the
    workdir argument."""
    message = re.sub(r"--set ([\w.]+)=(\S+)", r"cfg.\1 = \2", message)
    message = re.sub(r"--set\b", "a field of cfg", message)
    for flag, key in FLAG_KEYS:
        message = re.sub(rf"--{flag.replace('_', '-')}\b", f"cfg.{key}", message)
    for flag in ("workdir", "profile", "sample-tokens"):
        message = re.sub(rf"--{flag}\b", flag.replace("-", "_"), message)
    return message


@dataclasses.dataclass(slots=True)
class TrainConfig:
    batch_size: int = 16  # global, over all data-parallel replicas
    microbatches: int = 1  # gradient accumulation steps per optimizer step
    # True: microbatches as independent branches XLA can run at once (CPU cores)
    unroll_microbatches: bool = False
    # ZeRO-1: optimizer state split over "data", gradients reduce-scattered once per step
    shard_optimizer: bool = False
    # FSDP (implies shard_optimizer): parameters split over "data" too, gathered per layer
    shard_params: bool = False
    # the step as one compiled program per layer, called from Python (docs/performance.md)
    layer_programs: bool = False
    # with a "pipe" mesh axis: gpipe | 1f1b | interleaved (of train.microbatches)
    pipeline_schedule: str = "1f1b"
    pipeline_chunks: int = 1  # layer chunks per stage (interleaved: 2 or more)
    steps: int = 1000  # optimizer steps in all
    lr: float = 6e-4  # peak learning rate, after warmup
    min_lr: float = 6e-5  # where the decay ends
    warmup_steps: int = 100  # linear warmup from 0
    decay_steps: int = 0  # 0 -> steps
    schedule: str = "cosine"  # cosine | linear: the decay after the linear warmup
    weight_decay: float = 0.01  # AdamW's (not on biases and norms)
    beta1: float = 0.9  # Adam's
    beta2: float = 0.95  # Adam's
    eps: float = 1e-8  # Adam's
    grad_clip: float = 1.0  # global-norm clipping
    spike_factor: float = 10.0  # diverged: loss > this x its 20 steps' median and > chance
    loss_scale: float = 65536.0  # float16: the dynamic loss scale's start (loss_scale.py)
    loss_scale_window: int = 1000  # float16: the scale doubles after this many clean steps
    loss_scale_hysteresis: int = 2  # float16: overflows tolerated before one halves the scale
    seed: int = 0  # weights, batches and dropout follow from it
    init_from: str = ""  # a workdir whose weights start this run (BERT: its encoder)
    random_base: bool = False  # LoRA without init_from: adapt random weights (else refused)
    log_every: int = 10  # steps between log lines
    eval_every: int = 200  # steps between validations
    eval_batches: int = 8  # validation batches, at most
    save_every: int = 500  # steps between checkpoints
    keep_checkpoints: int = 3  # the newest this many are kept
    tracker: str = "tensorboard"  # and metrics.jsonl: tensorboard | wandb ('megajax[wandb]')

    def validate(self):
        for name in (
            "batch_size",
            "microbatches",
            "steps",
            "log_every",
            "eval_every",
            "eval_batches",
            "save_every",
            "keep_checkpoints",
            "lr",
            "eps",
            "grad_clip",
            "loss_scale",
            "loss_scale_window",
            "loss_scale_hysteresis",
            "pipeline_chunks",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"train.{name} must be positive, got {getattr(self, name)}")
        if self.loss_scale > MAX_LOSS_SCALE:
            raise ConfigError(
                "train.loss_scale must be at most 2^32 (where the dynamic scale stops growing), "
                f"got {self.loss_scale:g}"
            )
        if 0 < self.spike_factor <= 1:
            raise ConfigError(f"train.spike_factor must be 0 or above 1, got {self.spike_factor}")
        for name in (
            "warmup_steps",
            "decay_steps",
            "seed",
            "min_lr",
            "weight_decay",
            "spike_factor",
        ):
            if getattr(self, name) < 0:
                raise ConfigError(f"train.{name} must be 0 or more, got {getattr(self, name)}")
        if self.batch_size % self.microbatches:
            raise ConfigError(
                f"train.batch_size={self.batch_size} is not divisible by "
                f"train.microbatches={self.microbatches}"
            )
        for name in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(f"train.{name} must be in [0, 1), got {getattr(self, name)}")
        if self.min_lr > self.lr:  # Megatron-LM refuses it too: the "decay" would raise the rate
            raise ConfigError(
                f"train.min_lr ({self.min_lr:g}) must not exceed train.lr ({self.lr:g})"
            )
        one_of(
            self,
            "train",
            schedule=("cosine", "linear"),
            tracker=("tensorboard", "wandb"),
            pipeline_schedule=SCHEDULES,
        )
        if (self.pipeline_chunks > 1) != (self.pipeline_schedule == "interleaved"):
            raise ConfigError(
                f"train.pipeline_chunks={self.pipeline_chunks}: the interleaved schedule runs 2 or "
                "more chunks per stage, the others 1"
            )


@dataclasses.dataclass(slots=True)
class DataConfig:
    # builtin | text:PATH[,GLOB] | bin:PATH | tfds:NAME[/CONFIG] | bin:DIR, pairs:DIR
    # (megajax-prepare's) | megatron:PREFIX | chat:FILE.jsonl; fine-tuning: the task's dir
    source: str = "builtin"
    # bytes | chars | hf:PATH/tokenizer.json | tiktoken:NAME | wordpiece:PATH/vocab.txt |
    # wordpiece[:SIZE] (trained on the corpus)
    tokenizer: str = "bytes"
    val_fraction: float = 0.1  # the last this fraction of text is held out
    bin_dtype: str = "uint16"  # for bin: sources
    # BERT pretraining: fraction of tokens to predict (80% [MASK], 10% random, 10% kept)
    mask_prob: float = 0.15
    # whole_word (Megatron-LM: whole words in n-gram spans) | token (independent tokens)
    masking: str = "whole_word"
    # whole_word: spans of 1..max_ngram words, n drawn with probability ~ 1/n
    max_ngram: int = 3
    # chat: sources: the tokens the loss covers, assistant (what the assistant writes) | all
    chat_loss: str = "assistant"
    # chat: a conversation longer than seq_len + 1 tokens: refuse (the run) | truncate (it)
    chat_overflow: str = "refuse"

    def validate(self):
        for name in ("val_fraction", "mask_prob"):
            if not 0.0 < getattr(self, name) < 1.0:
                raise ConfigError(f"data.{name} must be in (0, 1), got {getattr(self, name)}")
        one_of(
            self,
            "data",
            bin_dtype=("uint16", "uint32"),
            masking=("whole_word", "token"),
            chat_loss=("assistant", "all"),
            chat_overflow=("refuse", "truncate"),
        )
        if self.max_ngram < 1:
            raise ConfigError(f"data.max_ngram must be at least 1, got {self.max_ngram}")


@dataclasses.dataclass(slots=True)
class Config:
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    name: str = "custom"

    def validate(self) -> "Config":
        """Every value's type and range, before anything is written: a bad value is one clear line.
        Values set from Python (cfg.train.lr = "3e-4") are typed as a file's or --set's would be."""
        for section in (self.model, self.train, self.data):
            for f in dataclasses.fields(section):
                set_value(
                    self, f"{SECTION_NAMES[type(section)]}.{f.name}", getattr(section, f.name)
                )
        self.model.validate()
        self.train.validate()
        self.data.validate()
        if self.train.layer_programs and not self.model.scan_layers:
            raise ConfigError(
                "train.layer_programs runs the stacked layers of model.scan_layers = true one at "
                "a time; set model.scan_layers = true (or train.layer_programs = false)"
            )
        if self.model.lora_rank and self.model.kind != "gpt":
            raise ConfigError(
                "LoRA adapters (model.lora_rank) are for GPT decoders: BERT's heads train from "
                "scratch, so its fine-tuning trains every weight"
            )
        if self.train.layer_programs and self.model.lora_rank:
            raise ConfigError(
                "train.layer_programs trains every weight: LoRA adapters (model.lora_rank) train "
                "with the single-program step"
            )
        if self.train.layer_programs and self.model.num_experts:
            raise ConfigError(
                "train.layer_programs runs dense layers: a mixture of experts (model.num_experts) "
                "trains with the single-program step"
            )
        if self.train.layer_programs and (self.train.shard_optimizer or self.train.shard_params):
            raise ConfigError(
                "train.layer_programs works with plain data parallelism only: unset "
                "train.shard_optimizer and train.shard_params (or train.layer_programs)"
            )
        return self

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def save(self, path: Path):
        write_atomic(path, json.dumps(self.to_dict(), indent=2) + "\n")


def _check_representable(key: str, value):
    """`value`, which the run keeps in float32 and int32 arrays: a value neither can hold is
    refused."""
    if isinstance(value, float) and not (value == 0 or FLOAT32_TINY <= abs(value) <= FLOAT32_MAX):
        raise ConfigError(
            f"{key} must be a finite number in float32's range (0, or 1.2e-38 to 3.4e+38 in "
            f"magnitude), got {value}"
        )
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 2**31:
        raise ConfigError(f"{key} must be below 2^31 (the run counts in int32), got {value}")
    return value


SECTIONS = {"model": ModelConfig, "train": TrainConfig, "data": DataConfig}
SECTION_NAMES = {cls: name for name, cls in SECTIONS.items()}
# of a section's class: validate() asks for each value
_field_types = functools.cache(typing.get_type_hints)


def _unknown(key: str) -> ConfigError:
    keys = [f"{s}.{f.name}" for s, cls in SECTIONS.items() for f in dataclasses.fields(cls)]
    close = difflib.get_close_matches(key, keys, n=1, cutoff=0.5)
    return ConfigError(
        f"unknown config key '{key}'" + (f"; did you mean '{close[0]}'?" if close else "")
    )


def _coerce(key: str, value, typ):
    """Convert `value` (a TOML value or a --set string) to the field type, or raise ConfigError."""
    if isinstance(value, str) and typ is not str:
        text = value.strip()
        if typ is bool:
            if text.lower() in ("true", "1", "yes", "on", "false", "0", "no", "off"):
                return text.lower() in ("true", "1", "yes", "on")
            raise ConfigError(f"{key} expects true or false, got '{value}'")
        try:
            if typ is int and "e" in text.lower():  # 1e6 is an integer written as a float
                number = float(text)
                if not number.is_integer():
                    raise ValueError
                return int(number)
            return typ(text)
        except (ValueError, OverflowError):
            raise ConfigError(f"{key} expects {typ.__name__}, got '{value}'") from None
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if typ is int and isinstance(value, float) and value.is_integer():
        return int(value)
    if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
        raise ConfigError(f"{key} expects {typ.__name__}, got {value!r}")
    return value


def set_value(cfg: Config, key: str, value) -> None:
    section, _, field = key.partition(".")
    cls = SECTIONS.get(section)
    names = {f.name: f for f in dataclasses.fields(cls)} if cls else {}
    if field not in names:
        raise _unknown(key)
    if key == "model.remat" and isinstance(value, (bool, str)):
        value = REMAT_ALIASES.get(value.lower() if isinstance(value, str) else value, value)
    setattr(
        getattr(cfg, section),
        field,
        _check_representable(key, _coerce(key, value, _field_types(cls)[field])),
    )


def with_values(cfg: Config, values: dict) -> Config:
    """A validated copy of cfg with {"section.field": value} changed (cfg itself untouched)."""
    out = copy.deepcopy(cfg)
    for key, value in values.items():
        set_value(out, key, value)
    return out.validate()


def apply_overrides(cfg: Config, overrides: list[str]) -> Config:
    # a single "key=value" string is taken too
    for item in [overrides] if isinstance(overrides, str) else overrides or []:
        if "=" not in item:
            raise ConfigError(f"--set expects key=value, got '{item}'")
        key, value = item.split("=", 1)
        set_value(cfg, key.strip(), value)
    return cfg


def find_config(name_or_path: str) -> Path:
    p, suffixed = Path(name_or_path), Path(name_or_path).suffix in (".toml", ".json")
    named = [CONFIG_DIR / f"{name_or_path}.toml", Path("configs") / f"{name_or_path}.toml"]
    if found := [c for c in [p] * suffixed + named if c.is_file()]:
        return found[0]
    if suffixed or len(p.parts) > 1:  # meant as a file, not a name
        what = (
            "not found"
            if not p.exists()
            else "is not a .toml or .json file"
            if p.is_file()
            else "is not a file"
        )
        raise ConfigError(
            f"config {name_or_path} {what} (give a name in configs/, or a .toml or .json file)"
        )
    close = difflib.get_close_matches(name_or_path, known := available_configs(), n=1)
    raise ConfigError(
        f"no config named '{name_or_path}'"
        + (f"; did you mean '{close[0]}'?" if close else f"; available: {', '.join(known)}")
    )


def _read(path: Path) -> dict:
    try:
        text = path.read_bytes().decode("utf-8")
        raw = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
    except UnicodeDecodeError as e:
        raise ConfigError(f"cannot parse {path}: not UTF-8 (byte {e.start})") from None
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"cannot parse {path}: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(
            f"{path}: expected a table of sections at the top, got {type(raw).__name__}"
        )
    return raw


def load_config(
    name_or_path: str = "default", overrides: list[str] | None = None, _seen: tuple[Path, ...] = ()
) -> Config:
    """Load a config by name (configs/NAME.toml) or path (.toml or a saved .json), then apply
    `overrides`."""
    path = find_config(name_or_path)
    if path.resolve() in _seen:
        chain = " -> ".join(p.stem for p in (*_seen, path.resolve()))
        raise ConfigError(f"{path}: its base chain loops ({chain})")
    raw = _read(path)
    base = raw.pop("base", None)
    if base is not None and not isinstance(base, str):
        raise ConfigError(f"{path}: base must be a config name, got {base!r}")
    cfg = load_config(base, None, (*_seen, path.resolve())) if base else Config()
    cfg.name = str(raw.pop("name", path.stem))
    for section, table in raw.items():
        if section not in SECTIONS:
            raise _unknown(section if not isinstance(table, dict) else f"{section}.?")
        if not isinstance(table, dict):
            raise ConfigError(f"{path}: [{section}] must be a table of keys, got {table!r}")
        for key, value in table.items():
            set_value(cfg, f"{section}.{key}", value)
    if path.resolve().parent == CONFIG_DIR.resolve():
        cfg.data.source = _from_checkout(cfg.data.source)
    return apply_overrides(cfg, overrides).validate()


def _from_checkout(source: str) -> str:
    """A shipped config's data paths are the repository's own (data/tinyshakespeare.txt): found
    from any directory, not only from the checkout's (each of a blend's sources)."""
    if is_blend(source):
        words = source.split()
        return " ".join(w if i % 2 == 0 else _from_checkout(w) for i, w in enumerate(words))
    spec = DataSpec.of(source)
    if spec.kind not in ("text", "bin", "chat", "pairs", "megatron") or not spec.arg:
        return source
    root = CONFIG_DIR.parent
    paths = [
        str(root / p) if not Path(p).is_absolute() and (root / p).exists() else p
        for p in spec.paths
    ]
    return str(DataSpec(spec.kind, ",".join(paths)))


def available_configs() -> list[str]:
    return sorted(p.stem for p in CONFIG_DIR.glob("*.toml"))
