"""The model registry, sharded initialisation, and the params dict <-> module binder.

`init_model` builds a model directly into its shardings: each device only ever materialises
its own slices, and the same seed gives the same global weights on every mesh.
"""

from __future__ import annotations

import jax
from flax import nnx

from megajax.config import Config, ConfigError, ModelConfig
from megajax.core import sharding as S
from megajax.core.mesh import as_mesh, check_model_fits
from megajax.models.bert import BERT
from megajax.models.gpt import GPT

MODELS = {"gpt": GPT, "bert": BERT}


def model_class(cfg: ModelConfig):
    if cfg.kind not in MODELS:
        raise ConfigError(f"model.kind must be one of {', '.join(MODELS)}, got '{cfg.kind}'")
    return MODELS[cfg.kind]


def abstract_model(cfg: ModelConfig, layout: S.Layout | None = None):
    """The model with ShapeDtypeStructs for weights: shapes and specs, nothing allocated."""
    return nnx.eval_shape(lambda: model_class(cfg)(cfg, layout, rngs=nnx.Rngs(0)))


def param_specs(model_or_state):
    """PartitionSpecs of every parameter, read from the NNX sharding metadata."""
    state = (
        model_or_state
        if isinstance(model_or_state, nnx.State)
        else nnx.state(model_or_state, nnx.Param)
    )
    return nnx.get_partition_spec(state)


def init_model(cfg: ModelConfig, mesh, seed: int = 0, param_shardings: dict | None = None):
    """Build the model with every weight created directly in its sharding on `mesh` (the
    weights' own specs, or `param_shardings`: a params dict of shardings, e.g. FSDP's)."""
    mesh = as_mesh(mesh)
    # its types and ranges, also of a config changed in Python since loading
    Config(model=cfg).validate()
    check_model_fits(cfg, mesh)
    layout = S.Layout.for_model(mesh, cfg)
    abstract = abstract_model(cfg, layout)
    graphdef, abs_state = nnx.split(abstract)
    shardings = S.param_shardings(mesh, nnx.get_partition_spec(abs_state))
    if param_shardings is not None:
        shardings = jax.tree.map(lambda x: x, shardings)
        nnx.replace_by_pure_dict(
            shardings, _unstringify(param_shardings, nnx.to_pure_dict(shardings))
        )

    @jax.jit
    def create():
        # LoRA adapters draw from a stream of their own: a seed's base weights are the same
        # with and without them
        rngs = nnx.Rngs(seed, lora=jax.random.fold_in(jax.random.key(seed), 1))
        return nnx.state(model_class(cfg)(cfg, layout, rngs=rngs))

    state = jax.jit(create, out_shardings=shardings)()
    return nnx.merge(graphdef, state)


# --- Parameters as a plain nested dict --------------------------------------------------
# optax, orbax and the train step work on plain dicts of arrays (string keys); the NNX
# graph definition and a template state turn them back into a module inside the step.


def params_dict(tree):
    """A pure dict of an NNX state (nnx.to_pure_dict) with string keys: the params dict form."""
    return {str(k): params_dict(v) for k, v in tree.items()} if isinstance(tree, dict) else tree


def _unstringify(tree, template):
    if not isinstance(template, dict):
        return tree
    return {k: _unstringify(tree[str(k)], v) for k, v in template.items()}


def path_keys(path) -> tuple[str, ...]:
    """A jax tree path into a params dict (or optimizer state) as a tuple of strings."""
    return tuple(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


class ModelDef:
    """Everything static about a model: rebuild it from a params dict with `bind(params)`."""

    def __init__(self, model):
        self.graphdef, params_state, self.rest = nnx.split(model, nnx.Param, ...)
        self._template = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params_state
        )
        self.cfg = model.cfg
        self.layout = model.layout

    def params(self, model) -> dict:
        return params_dict(nnx.to_pure_dict(nnx.state(model, nnx.Param)))

    def abstract_params(self) -> dict:
        return params_dict(
            jax.tree.map(
                lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), nnx.to_pure_dict(self._template)
            )
        )

    def abstract_sharded_params(self, shardings) -> dict:
        """ShapeDtypeStructs carrying the given shardings: a restore or compile target, nothing
        allocated."""
        return jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
            self.abstract_params(),
            shardings,
        )

    def specs(self) -> dict:
        return params_dict(nnx.to_pure_dict(nnx.get_partition_spec(self._template)))

    def bind(self, params: dict):
        state = jax.tree.map(lambda x: x, self._template)
        nnx.replace_by_pure_dict(state, _unstringify(params, nnx.to_pure_dict(state)))
        return nnx.merge(self.graphdef, state, self.rest)
