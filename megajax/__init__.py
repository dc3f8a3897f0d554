"""megajax: Megatron-LM tensor parallelism in JAX and Flax NNX.

The package is laid out in layers; a module imports only from its own layer and the ones
above it in this list (tests/test_architecture.py checks it):

    errors, files, model_config, config, shapes, progress,
    analytic, specs, hardware                                   foundation: no jax
    host/        the process: glibc settings, signals, the multi-process runtime
    core/        the parallel core: mesh, partition specs, precision, layers, vocab-parallel loss
    data/        text sources, tokenizers, GPT token batches, BERT pretraining and fine-tuning data
    models/      GPT, BERT, the model registry and sharded init, sampling
    tasks/       one object per training objective: batch layout, data, head sizes
    runs/        a run on disk: the workdir, its checkpoints, metrics.jsonl and loss curve
    training/    optimizer, compiled step, the loop and its log
    evaluation/  window scoring, WikiText, LAMBADA, BERT evaluation, eval.py's tasks
    tools/       HLO reading, the collective audit, the dry run
    plan/        the planner: memory, step time and scaling predicted for every way to run a config
    convert/     Hugging Face GPT-2 / BERT / Megatron-BERT directories to workdirs and back
    prepare/     corpora tokenized once, in parallel and resumably, for --data bin:DIR
    cli/         train.py, eval.py, megajax-plan, megajax-convert, megajax-prepare

The names below are loaded on first use, so `import megajax.cli` stays free of jax until a
program has read its --host-devices flag.
"""

import importlib

_API = {
    "Config": "megajax.config",
    "ConfigError": "megajax.config",
    "ModelConfig": "megajax.config",
    "TrainConfig": "megajax.config",
    "load_config": "megajax.config",
    "make_mesh": "megajax.core.mesh",
    "GPT": "megajax.models.gpt",
    "BERT": "megajax.models.bert",
    "abstract_model": "megajax.models.registry",
    "init_model": "megajax.models.registry",
    "param_specs": "megajax.models.registry",
    "generate": "megajax.models.generate",
    "param_count": "megajax.tasks",
    "task_for": "megajax.tasks",
    "make_trainer": "megajax.training.step",
    "train": "megajax.training.loop",
    "audit": "megajax.tools.audit",
    "import_hf": "megajax.convert",
    "export_hf": "megajax.convert",
    "import_megatron": "megajax.convert",
}

__all__ = sorted(_API) + ["plan"]


# Subpackages reached as attributes: megajax.plan.plan(...), megajax.plan.Plan
_SUBPACKAGES = ("plan",)


def __getattr__(name):
    if name in _SUBPACKAGES:
        return importlib.import_module(f"megajax.{name}")
    if name not in _API:
        raise AttributeError(f"module 'megajax' has no attribute '{name}'")
    value = getattr(importlib.import_module(_API[name]), name)
    globals()[name] = value  # resolved once
    return value


def __dir__():
    return sorted(set(globals()) | set(_API) | set(_SUBPACKAGES))
