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
from megajax.model import ModelDef, abstract_model, init_model

_DECAYED = {"kernel", "table", "pos"}   # weight matrices and embeddings; not LayerNorm, not biases


def lr_schedule(t: TrainConfig):
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=t.lr, warmup_steps=t.warmup_steps,
        decay_steps=max(t.decay_steps or t.steps, t.warmup_steps + 1), end_value=t.min_lr)


def weight_decay_mask(params: dict):
    return jax.tree_util.tree_map_with_path(lambda path, _: path[-1].key in _DECAYED, params)


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
        return NamedSharding(self.mesh, S.TOKENS)

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
    def loss_fn(self, params, tokens, key):
        model = self.modeldef.bind(params)
        return model.loss(tokens[:, :-1], tokens[:, 1:], key=key)

    def _step(self, params, opt_state, tokens, step):
        t = self.cfg.train
        key = jax.random.fold_in(jax.random.key(t.seed), step)
        grad_fn = jax.value_and_grad(self.loss_fn)
        if t.microbatches == 1:
            loss, grads = grad_fn(params, tokens, key)
        else:
            # Microbatch j takes rows j, j+m, j+2m, ...: every data shard keeps its own rows.
            m = t.microbatches
            micro = tokens.reshape(tokens.shape[0] // m, m, tokens.shape[1]).swapaxes(0, 1)
            micro = jax.lax.with_sharding_constraint(micro, NamedSharding(self.mesh, P(None, S.DATA, None)))

            def accumulate(carry, xs):
                mb, j = xs
                loss, grads = grad_fn(params, mb, jax.random.fold_in(key, j))
                return jax.tree.map(jnp.add, carry, (loss, grads)), None

            zeros = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
            (loss, grads), _ = jax.lax.scan(accumulate, zeros, (micro, jnp.arange(m)))
            loss, grads = jax.tree.map(lambda x: x / m, (loss, grads))
        with jax.named_scope("optimizer"):
            grad_norm = optax.tree.norm(grads)
            updates, opt_state = self.tx.update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
        metrics = {"loss": loss, "grad_norm": grad_norm, "lr": lr_schedule(t)(step)}
        return params, opt_state, metrics

    def jit_step(self, donate: bool = True):
        return jax.jit(
            self._step,
            in_shardings=(self.param_shardings, self.opt_shardings, self.batch_sharding, self.replicated()),
            out_shardings=(self.param_shardings, self.opt_shardings, self.replicated()),
            donate_argnums=(0, 1) if donate else ())

    def jit_eval(self):
        def eval_loss(params, tokens):
            return self.loss_fn(params, tokens, None)
        return jax.jit(eval_loss, in_shardings=(self.param_shardings, self.batch_sharding),
                       out_shardings=self.replicated())

    def lower_step(self):
        """The train step lowered for abstract inputs (for compiling, the audit and memory analysis)."""
        params, opt = self.abstract_state()
        b, s = self.cfg.train.batch_size, self.cfg.model.seq_len + 1
        tokens = jax.ShapeDtypeStruct((b, s), jnp.int32, sharding=self.batch_sharding)
        step = jax.ShapeDtypeStruct((), jnp.int32, sharding=self.replicated())
        return self.jit_step(donate=True).lower(params, opt, tokens, step)


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
