"""The paper's optimiser recipe (optax) and the jit-compiled, sharded train step.

One step: forward and backward on each microbatch (gradient accumulation), global-norm
clipping, AdamW with warmup + cosine decay. Params and optimizer state are float32 and keep
their mesh shardings in and out; their buffers are donated so the step updates in place.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from megajax import sharding as S
from megajax.config import Config, ConfigError, TrainConfig
from megajax.model import MODELS, ModelDef, abstract_model, init_model

# Megatron-LM decays every weight matrix and embedding (token, position, token-type tables)
# and exempts only biases and LayerNorm parameters (scale and shift).
_NOT_DECAYED = ("bias", "scale")


def lr_schedule(t: TrainConfig):
    """Linear warmup to lr, then cosine (GPT-2) or linear (the paper's BERT) decay to min_lr."""
    decay_steps = max(t.decay_steps or t.steps, t.warmup_steps + 1)
    if t.schedule == "linear":
        return optax.join_schedules([optax.linear_schedule(0.0, t.lr, t.warmup_steps),
                                     optax.linear_schedule(t.lr, t.min_lr, decay_steps - t.warmup_steps)],
                                    [t.warmup_steps])
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=t.lr, warmup_steps=t.warmup_steps,
        decay_steps=decay_steps, end_value=t.min_lr)


def weight_decay_mask(params: dict):
    return jax.tree_util.tree_map_with_path(lambda path, _: not str(path[-1].key).endswith(_NOT_DECAYED), params)


def make_optimizer(t: TrainConfig) -> optax.GradientTransformation:
    return optax.chain(
        optax.clip_by_global_norm(t.grad_clip),
        optax.adamw(lr_schedule(t), b1=t.beta1, b2=t.beta2, eps=t.eps,
                    weight_decay=t.weight_decay, mask=weight_decay_mask),
    )


@dataclasses.dataclass
class Trainer:
    """A model definition, its optimizer and the compiled step for one mesh."""

    cfg: Config
    mesh: jax.sharding.Mesh
    modeldef: ModelDef
    tx: optax.GradientTransformation
    param_shardings: dict
    opt_shardings: object

    @property
    def batch_sharding(self):
        """Every batch array is split over "data" by rows (a prefix spec: the rest stays whole)."""
        return NamedSharding(self.mesh, S.BATCH)

    def batch_shapes(self):
        """The model's global batch as ShapeDtypeStructs (GPT: a token array; BERT: a dict)."""
        shapes = MODELS[self.cfg.model.kind].batch_shapes(self.cfg, self.cfg.train.batch_size)
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=self.batch_sharding), shapes)

    def replicated(self):
        return NamedSharding(self.mesh, P())

    # -- state ---------------------------------------------------------------------------
    def init_state(self, seed: int | None = None):
        """Fresh float32 params (same values on every mesh for a seed) and optimizer state."""
        seed = self.cfg.train.seed if seed is None else seed
        params = self.modeldef.params(init_model(self.cfg.model, self.mesh, seed))
        opt_state = jax.jit(self.tx.init, out_shardings=self.opt_shardings)(params)
        return params, opt_state

    def abstract_state(self):
        """ShapeDtypeStructs with shardings for params and optimizer state: nothing allocated."""
        params = self.modeldef.abstract_sharded_params(self.param_shardings)
        opt = jax.eval_shape(self.tx.init, params)
        opt = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                           opt, self.opt_shardings)
        return params, opt

    # -- step ----------------------------------------------------------------------------
    def objective(self, params, batch, key):
        """(loss, metrics) of the model's training objective on one batch."""
        return self.modeldef.bind(params).objective(batch, key=key)

    def loss_fn(self, params, batch, key):
        return self.objective(params, batch, key)[0]

    def _step(self, params, opt_state, batch, step):
        t = self.cfg.train
        key = jax.random.fold_in(jax.random.key(t.seed), step)
        grad_fn = jax.value_and_grad(self.objective, has_aux=True)
        if t.microbatches == 1:
            (_, metrics), grads = grad_fn(params, batch, key)
        else:
            # Microbatch j takes rows j, j+m, j+2m, ...: every data shard keeps its own rows.
            m = t.microbatches

            def split(x):
                x = x.reshape(x.shape[0] // m, m, *x.shape[1:]).swapaxes(0, 1)
                return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, P(None, S.DATA)))

            def accumulate(carry, xs):
                mb, j = xs
                (_, metrics), grads = grad_fn(params, mb, jax.random.fold_in(key, j))
                return jax.tree.map(jnp.add, carry, (metrics, grads)), None

            micro = jax.tree.map(split, batch)
            metric_shapes = jax.eval_shape(lambda mb: self.objective(params, mb, key)[1],
                                           jax.tree.map(lambda x: x[0], micro))
            zeros = (jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), metric_shapes),
                     jax.tree.map(jnp.zeros_like, params))
            if t.unroll_microbatches:
                # Independent subgraphs, summed in the scan's order: XLA may run them at once.
                total = zeros
                for j in range(m):
                    total, _ = accumulate(total, (jax.tree.map(lambda x: x[j], micro), j))
                metrics, grads = total
            else:
                (metrics, grads), _ = jax.lax.scan(accumulate, zeros, (micro, jnp.arange(m)))
            metrics, grads = jax.tree.map(lambda x: x / m, (metrics, grads))
        with jax.named_scope("optimizer"):
            grad_norm = optax.tree.norm(grads)
            updates, opt_state = self.tx.update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
        metrics = {**metrics, "grad_norm": grad_norm, "lr": lr_schedule(t)(step)}
        return params, opt_state, metrics

    def jit_step(self, donate: bool = True):
        return jax.jit(
            self._step,
            in_shardings=(self.param_shardings, self.opt_shardings, self.batch_sharding, self.replicated()),
            out_shardings=(self.param_shardings, self.opt_shardings, self.replicated()),
            donate_argnums=(0, 1) if donate else ())

    def jit_eval(self):
        """Metrics of one batch without dropout (a dict; "loss" always among them)."""
        def eval_metrics(params, batch):
            return self.objective(params, batch, None)[1]
        return jax.jit(eval_metrics, in_shardings=(self.param_shardings, self.batch_sharding),
                       out_shardings=self.replicated())

    def lower_step(self):
        """The train step lowered for abstract inputs (for compiling, the audit and memory analysis)."""
        params, opt = self.abstract_state()
        step = jax.ShapeDtypeStruct((), jnp.int32, sharding=self.replicated())
        return self.jit_step(donate=True).lower(params, opt, self.batch_shapes(), step)


def make_trainer(cfg: Config, mesh) -> Trainer:
    """Check the config against the mesh and build the optimizer and shardings (nothing allocated)."""
    t = cfg.train
    cfg.model.check_mesh(mesh.shape[S.MODEL], mesh.shape[S.DATA], t.batch_size)
    if (t.batch_size // t.microbatches) % mesh.shape[S.DATA]:
        raise ConfigError(f"microbatch of {t.batch_size // t.microbatches} rows (batch {t.batch_size} / "
                          f"{t.microbatches} microbatches) is not divisible by the data axis "
                          f"({mesh.shape[S.DATA]})")
    modeldef = ModelDef(abstract_model(cfg.model, S.Layout(mesh)))
    shardings = S.param_shardings(mesh, modeldef.specs())
    tx = make_optimizer(t)
    opt_shapes = jax.eval_shape(tx.init, modeldef.abstract_params())
    return Trainer(cfg, mesh, modeldef, tx, shardings, _opt_shardings(opt_shapes, shardings, mesh))


def _path(path) -> tuple[str, ...]:
    return tuple(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def _opt_shardings(opt_shapes, param_shardings, mesh):
    """Optimizer-state leaves that mirror a param (Adam's mu and nu) get that param's
    sharding, found by the param's path at the end of theirs; the rest is replicated."""
    by_path = {_path(p): s for p, s in jax.tree_util.tree_flatten_with_path(param_shardings)[0]}

    def pick(path, leaf):
        keys = _path(path)
        for n in range(len(keys)):
            if keys[n:] in by_path and leaf.ndim == len(by_path[keys[n:]].spec):
                return by_path[keys[n:]]
        return NamedSharding(mesh, P())

    return jax.tree_util.tree_map_with_path(pick, opt_shapes)
