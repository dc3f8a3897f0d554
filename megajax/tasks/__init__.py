"""The registry of training objectives, keyed by name; `task_for(cfg)` finds a run's task
from (model.kind, model.task). Each task is in its own module (lm.py, bert.py); the shared
interface is tasks/base.py."""

from __future__ import annotations

from megajax.config import Config, ConfigError, ModelConfig
from megajax.tasks.base import Task
from megajax.tasks.bert import BertPretraining, fine_tuning_tasks
from megajax.tasks.lm import LanguageModelling

TASKS: dict[str, Task] = {
    t.name: t for t in (LanguageModelling(), BertPretraining(), *fine_tuning_tasks())
}


def task_for(cfg) -> Task:
    """The task of a config (whose (model.kind, model.task) pair load_config has checked)."""
    m = cfg.model
    for task in TASKS.values():
        if (task.kind, task.model_task) == (m.kind, m.task):
            return task
    raise ConfigError(f'no task for model.kind = "{m.kind}", model.task = "{m.task}"')


def param_count(cfg) -> int:
    """Parameters of the model (a Config, or its ModelConfig), from its shapes alone (tests:
    equal to the built model)."""
    cfg = Config(model=cfg) if isinstance(cfg, ModelConfig) else cfg
    m = cfg.model
    positions = m.seq_len * m.hidden if m.positions == "learned" else 0
    output_layer = 0 if m.tie_embeddings else m.padded_vocab * m.hidden
    final_norm = (2 if m.norm == "layernorm" else 1) * m.hidden
    shared = (
        sum(m.params_per_layer)
        + m.num_layers * m.adapter_params
        + m.padded_vocab * m.hidden
        + positions
        + output_layer
        + final_norm
    )
    return shared + task_for(cfg).head_params(cfg)


__all__ = ["TASKS", "Task", "param_count", "task_for"]
