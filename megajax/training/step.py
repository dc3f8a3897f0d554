"""The jit-compiled, sharded train step.

One step: forward and backward on each microbatch (gradient accumulation), then the optimizer
(megajax/training/optimizer.py). Params and optimizer state are float32 and keep their mesh
shardings in and out; their buffers are donated so the step updates in place.

Over "data", three schemes (megajax/training/data_parallel.py has the data-manual part):
  plain            GSPMD all-reduces each gradient where the backward pass computes it (once
                   per microbatch);
  shard_optimizer  ZeRO-1: Adam's state split over "data"; gradients accumulated locally and
                   reduce-scattered once per step; the updated slices all-gathered;
  shard_params     FSDP: parameters split over "data" too, each layer's gathered just in time
                   (forward and backward) and its gradient reduce-scattered.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import optax
from flax import traverse_util
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from megajax.config import Config
from megajax.core import sharding as S
from megajax.core.mesh import as_mesh, check_fits
from megajax.core.moe import LOAD, balanced, is_router_bias
from megajax.core.stack import LISTED_PATH, STACKED_PATH
from megajax.models import vocab_rows
from megajax.models.registry import ModelDef, abstract_model, init_model, path_keys
from megajax.tasks import Task, task_for
from megajax.training.data_parallel import DataParallel
from megajax.training.gradients import GradientStrategy, PlainGradients, split_on_shards
from megajax.training.layer_programs import LayerProgramStep
from megajax.training.loss_scale import around, scaled, uses_loss_scaling
from megajax.training.optimizer import lr_schedule, make_optimizer
from megajax.training.pipeline import Pipeline, stage_specs
from megajax.training.trainable import trained, with_trained


@dataclasses.dataclass
class Trainer:
    """A model definition, its optimizer and the compiled step for one mesh."""

    cfg: Config
    mesh: jax.sharding.Mesh
    task: Task
    modeldef: ModelDef
    tx: optax.GradientTransformation
    param_shardings: dict
    opt_shardings: object
    # how the gradients are computed over the mesh (megajax/training/gradients.py)
    strategy: GradientStrategy

    @property
    def pipeline(self) -> Pipeline | None:
        """The pipelined gradient computation, on a mesh with a "pipe" axis (for the audit)."""
        return self.strategy if isinstance(self.strategy, Pipeline) else None

    @property
    def data_parallel(self) -> DataParallel | None:
        """ZeRO-1 / FSDP's data-manual part, pipelined or not (for the audit and reports)."""
        if isinstance(self.strategy, Pipeline):
            return self.strategy.data_parallel
        return self.strategy if isinstance(self.strategy, DataParallel) else None

    @property
    def batch_sharding(self):
        """Every batch array is split over "data" (and "expert") by rows (a prefix spec: the
        rest stays whole)."""
        return NamedSharding(self.mesh, P(S.rows_axes(self.mesh)))

    def batch_shapes(self):
        """The task's global batch as ShapeDtypeStructs (GPT: a token array; BERT: a dict)."""
        return self.task.batch_shapes(self.cfg, self.cfg.train.batch_size, self.batch_sharding)

    def replicated(self):
        return NamedSharding(self.mesh, P())

    # -- state ---------------------------------------------------------------------------
    def init_state(self, seed: int | None = None):
        """Fresh float32 params (same values on every mesh for a seed) and optimizer state."""
        seed = self.cfg.train.seed if seed is None else seed
        params = self.modeldef.params(
            init_model(self.cfg.model, self.mesh, seed, self.param_shardings)
        )
        params = self.stored(params)[0]
        opt_state = jax.jit(self.tx.init, out_shardings=self.opt_shardings)(self.trained(params))
        return params, opt_state

    def stored(self, params, opt_state=None, inverse: bool = False):
        """(params, optimizer state) in the order the step keeps them: an interleaved pipeline
        stores its stacked layers stage-major (training/pipeline.py); with `inverse`, back to
        the layers' own order, which checkpoints, evaluation and sampling use. Otherwise the
        same arrays."""
        if self.strategy.layer_order() is None:
            return params, opt_state
        return jax.jit(
            lambda t: self.strategy.reorder(t, inverse),
            out_shardings=jax.tree.map(lambda x: x.sharding, (params, opt_state)),
        )((params, opt_state))

    def natural(self, params, opt_state=None):
        """(params, optimizer state) as checkpoints keep them: the layers in their own order,
        the vocabulary in model.padded_vocab rows (models/vocab_rows.py)."""
        params, opt_state = self.stored(params, opt_state, inverse=True)
        return vocab_rows.for_checkpoint((params, opt_state), self.cfg.model.padded_vocab)

    def from_checkpoint(self, params, opt_state=None):
        """The inverse of `natural`: what a checkpoint held, as the step keeps it."""
        abstract = self.abstract_state()
        if opt_state is None:
            params = vocab_rows.for_mesh(params, abstract[0])
        else:
            params, opt_state = vocab_rows.for_mesh((params, opt_state), abstract)
        return self.stored(params, opt_state)

    def checkpoint_target(self):
        """abstract_state() as a checkpoint holds it (models/vocab_rows.py)."""
        return vocab_rows.checkpoint_target(self.abstract_state(), self.cfg.model.padded_vocab)

    def trained(self, tree: dict) -> dict:
        """The trained part of a params-shaped dict: all of it, or the LoRA adapters alone."""
        return trained(self.cfg, tree)

    def abstract_state(self):
        """ShapeDtypeStructs with shardings for params and optimizer state: nothing allocated."""
        params = self.modeldef.abstract_sharded_params(self.param_shardings)
        opt = jax.eval_shape(self.tx.init, self.trained(params))
        opt = jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), opt, self.opt_shardings
        )
        return params, opt

    def legacy_opt_state(self):
        """(the abstract optimizer state megajax saved before the loss scale, a function that
        puts a fresh scale in front of it) for `Checkpoints.restore`."""
        _, opt = self.abstract_state()
        upgrade = jax.jit(functools.partial(around, cfg=self.cfg), out_shardings=self.opt_shardings)
        return opt.inner, upgrade

    # -- step ----------------------------------------------------------------------------
    def objective(self, params, batch, key, loss_scale=None):
        """(loss, metrics) of the model's training objective on one batch; with a loss scale
        (float16) the loss is multiplied by it, the metrics are not."""
        return scaled(self.modeldef.bind(params).objective(batch, key=key), loss_scale)

    @property
    def loss_scaling(self) -> bool:
        return uses_loss_scaling(self.cfg)

    def loss_scale(self, opt_state):
        """What this step multiplies its loss by (None: no loss scaling)."""
        return opt_state.scale if self.loss_scaling else None

    def loss_fn(self, params, batch, key):
        return self.objective(params, batch, key)[0]

    def _step(self, params, opt_state, batch, step):
        metrics, grads = self.gradients(
            params, batch, self.step_key(step), self.loss_scale(opt_state)
        )
        return self.apply_gradients(params, opt_state, grads, metrics, step)

    def step_key(self, step):
        """The step's dropout key: a function of (seed, step) only, so a resumed run draws the
        same."""
        return jax.random.fold_in(jax.random.key(self.cfg.train.seed), step)

    def split_microbatches(self, batch):
        """Every batch array as (microbatches, rows, ...), by the one rule
        (training/microbatches.py), each microbatch's rows kept on their data shard."""
        return split_on_shards(batch, self.cfg, self.mesh)

    def apply_gradients(self, params, opt_state, grads, metrics, step):
        """The optimizer's update from one step's gradients (loss-scaled ones with float16:
        divided by the scale here); metrics gain grad_norm and lr, and with float16 the scale
        used and the steps skipped so far."""
        t, scale, extra = self.cfg.train, self.loss_scale(opt_state), {}
        if scale is not None:
            grads = jax.tree.map(lambda g: g / scale, grads)
            step = step - opt_state.skipped  # a skipped step did not advance the schedule
        with jax.named_scope("optimizer"):
            grad_norm = optax.tree.norm(grads)
            part = self.trained(params)
            updates, new_state = self.tx.update(grads, opt_state, part)
            part = optax.apply_updates(part, updates)
        params = with_trained(params, self.strategy.updated_params(part))
        if LOAD in metrics:  # the routers' balancing biases, moved once per step
            metrics = dict(metrics)
            params = balance_routers(params, metrics.pop(LOAD), self.cfg.model.moe_bias_update_rate)
        if scale is not None:
            extra = {"loss_scale": scale, "skipped_steps": new_state.skipped}
        metrics = {**metrics, "grad_norm": grad_norm, "lr": lr_schedule(t)(step), **extra}
        return params, new_state, metrics

    def gradients(self, params, batch, key, loss_scale=None):
        """(metrics, gradients of the trained part): means over the step's microbatches, reduced
        over "data" (the gradients of the loss times `loss_scale`, if given)."""
        return self.strategy.gradients(params, batch, key, loss_scale)

    def jit_step(self, donate: bool = True):
        return jax.jit(
            self._step,
            in_shardings=(
                self.param_shardings,
                self.opt_shardings,
                self.batch_sharding,
                self.replicated(),
            ),
            out_shardings=(self.param_shardings, self.opt_shardings, self.replicated()),
            donate_argnums=(0, 1) if donate else (),
        )

    def jit_eval(self):
        """Metrics of one batch without dropout (a dict; "loss" always among them, and
        "targets", the count of what the loss averages, for a task whose loss has a mask)."""

        def eval_metrics(params, batch):
            params = self.strategy.reorder(params, inverse=True)
            metrics = dict(self.objective(params, batch, None)[1])
            metrics.pop(LOAD, None)
            targets = self.task.loss_targets(batch)
            if targets is not None:
                metrics["targets"] = targets
            return metrics

        return jax.jit(
            eval_metrics,
            in_shardings=(self.param_shardings, self.batch_sharding),
            out_shardings=self.replicated(),
        )

    def compiled_step(self):
        """What the train loop calls: the donated step compiled as one program, or with
        train.layer_programs the sequence of per-layer programs
        (megajax/training/layer_programs.py). Either has XLA's memory_analysis() for the fit
        check."""
        if self.cfg.train.layer_programs:
            return LayerProgramStep(self)
        return self.lower_step().compile()

    def lower_step(self):
        """The train step lowered for abstract inputs (for compiling, the audit and memory
        analysis)."""
        params, opt = self.abstract_state()
        step = jax.ShapeDtypeStruct((), jnp.int32, sharding=self.replicated())
        return self.jit_step(donate=True).lower(params, opt, self.batch_shapes(), step)


def make_trainer(cfg: Config, mesh) -> Trainer:
    """Check the config against the mesh and build the optimizer and shardings (nothing
    allocated)."""
    # a config changed in Python since it was loaded is checked again
    return build_trainer(cfg.validate(), as_mesh(mesh))


def balance_routers(params: dict, load, rate: float) -> dict:
    """Every router's balancing bias moved by the step's assignments per expert (`load`:
    (sparse layers, E), in layer order), DeepSeek-V3's rule (core/moe.py, balanced)."""
    flat = traverse_util.flatten_dict(params)
    paths = sorted((k for k in flat if is_router_bias(k)), key=str)
    if len(paths) == 1 and flat[paths[0]].ndim == 2:  # a scanned stack's, (layers, E)
        flat[paths[0]] = balanced(flat[paths[0]], load, rate)
    else:  # one a sparse layer, in layer order
        paths.sort(key=lambda k: int(k[len(LISTED_PATH)]))
        for j, k in enumerate(paths):
            flat[k] = balanced(flat[k], load[j], rate)
    return traverse_util.unflatten_dict(flat)


def build_trainer(cfg: Config, mesh: jax.sharding.Mesh) -> Trainer:
    """make_trainer for a config validated already (a RunSpec's) on a megajax mesh: its sizes
    checked against the mesh, and nothing else again."""
    task = task_for(cfg)
    check_fits(cfg, mesh)
    modeldef = ModelDef(abstract_model(cfg.model, S.Layout.for_model(mesh, cfg.model)))
    tx = make_optimizer(cfg)
    opt_shapes = jax.eval_shape(tx.init, trained(cfg, modeldef.abstract_params()))
    strategy, shardings, dp = _strategy(cfg, mesh, modeldef)
    # the optimizer state is split over "data" like the gradients; the weights only with FSDP
    held = shardings if dp is None else dp.sharded
    param_shardings = held if cfg.train.shard_params else shardings
    opt_shardings = _opt_shardings(opt_shapes, trained(cfg, held), mesh)
    return Trainer(cfg, mesh, task, modeldef, tx, param_shardings, opt_shardings, strategy)


def _strategy(cfg: Config, mesh, modeldef: ModelDef):
    """(the gradient strategy, the weights' shardings over "model" (and "pipe"), its
    DataParallel part if the optimizer state or the weights are split over "data")."""
    sharded_data = cfg.train.shard_optimizer or cfg.train.shard_params
    if mesh.shape.get(S.PIPE, 1) > 1:
        specs = stage_specs(modeldef.specs(), STACKED_PATH)
        dp = DataParallel.build(cfg, mesh, modeldef, stages=specs) if sharded_data else None
        return Pipeline(cfg, mesh, modeldef, dp), S.param_shardings(mesh, specs), dp
    shardings = S.param_shardings(mesh, modeldef.specs())
    if sharded_data:
        dp = DataParallel.build(cfg, mesh, modeldef)
        return dp, shardings, dp
    return PlainGradients(cfg, mesh, modeldef), shardings, None


def _opt_shardings(opt_shapes, param_shardings, mesh):
    """Optimizer-state leaves that mirror a param (Adam's mu and nu) get that param's
    sharding, found by the param's path at the end of theirs; the rest is replicated."""
    by_path = {path_keys(p): s for p, s in jax.tree_util.tree_flatten_with_path(param_shardings)[0]}

    def pick(path, leaf):
        keys = path_keys(path)
        for n in range(len(keys)):
            if keys[n:] in by_path and leaf.ndim == len(by_path[keys[n:]].spec):
                return by_path[keys[n:]]
        return NamedSharding(mesh, P())

    return jax.tree_util.tree_map_with_path(pick, opt_shapes)
