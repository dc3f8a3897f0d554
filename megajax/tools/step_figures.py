"""What a config's train step costs per sequence, from more compiles of it (nothing allocated):
activation bytes per sequence and FLOPs per step, with recomputation's share of them.

Activation bytes are the slope of the compiled step's temporary bytes between two microbatch
sizes: parameters, gradients and optimizer state do not grow with the microbatch, so they
drop out. XLA's cost analysis counts a loop's body once, so FLOPs come from one microbatch
of the model unrolled at one and at two layers: step FLOPs = (f(1) + (L - 1)·(f(2) - f(1)))
times the microbatch count (the optimizer's elementwise work, counted once per microbatch
this way, is some 1e-4 of the step).
"""

from __future__ import annotations

import dataclasses

from megajax.analytic import activation_bytes_per_layer
from megajax.config import Config, with_values
from megajax.core.precision import Precision
from megajax.core.sharding import DATA
from megajax.mesh_shape import MeshShape
from megajax.plan.memory import step_shape
from megajax.training.memory import step_memory
from megajax.training.step import make_trainer


def compile_step(cfg: Config, mesh):
    return make_trainer(cfg, mesh).lower_step().compile()


def _flops(compiled) -> float:
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return float(cost.get("flops", 0.0)) if cost else 0.0


def step_flops(cfg: Config, mesh, remat: str | None = None) -> float:
    """FLOPs one device runs per step (forward, backward and what `remat` recomputes)."""
    t, m = cfg.train, cfg.model
    one_microbatch = {
        "train.microbatches": 1,
        "train.batch_size": t.batch_size // t.microbatches,
        "model.scan_layers": False,
        "model.remat": remat or m.remat,
    }
    f1, f2 = (
        _flops(compile_step(with_values(cfg, {"model.num_layers": n, **one_microbatch}), mesh))
        for n in (1, 2)
    )
    return (f1 + (m.num_layers - 1) * (f2 - f1)) * t.microbatches


def _doubled_rows(cfg: Config) -> Config:
    """cfg with twice the sequences per microbatch."""
    t = cfg.train
    if t.microbatches % 2 == 0:
        return with_values(cfg, {"train.microbatches": t.microbatches // 2})
    return with_values(cfg, {"train.batch_size": 2 * t.batch_size})


def _temp_bytes(cfg: Config, mesh) -> int | None:
    return step_memory(compile_step(cfg, mesh)).get("step_temp_bytes")


def activation_bytes_per_sequence(cfg: Config, mesh, temp_bytes: int) -> dict:
    """Compiled temporary bytes per extra sequence on a device: for the whole step (from this
    step's `temp_bytes` and one with twice the rows per microbatch), and for one layer (the
    same slope differenced between 3 and 2 layers, which leaves out the embedding, the
    logits and one layer's working set in the backward pass: the paper's quantity)."""
    rows = cfg.train.batch_size // cfg.train.microbatches // mesh.shape[DATA]
    bigger = _temp_bytes(_doubled_rows(cfg), mesh)
    if bigger is None:
        return {}
    shallow = {
        (n, r): _temp_bytes(c, mesh)
        for n in (2, 3)
        for r, c in (
            (1, with_values(cfg, {"model.num_layers": n})),
            (2, _doubled_rows(with_values(cfg, {"model.num_layers": n}))),
        )
    }
    per_layer = shallow[3, 2] - shallow[2, 2] - shallow[3, 1] + shallow[2, 1]
    return {
        "activation_bytes_per_sequence": (bigger - temp_bytes) / rows,
        "activation_bytes_per_layer_and_sequence": per_layer / rows,
        "sequences_per_microbatch": rows,
    }


def modelled_bytes_per_layer(cfg: Config, mesh, dtype: str) -> int:
    """The activation-memory model's bytes per layer and sequence (megajax/analytic/), as the
    compiled CPU step keeps them (XLA's attention, no flash kernel) in `dtype`."""
    x = step_shape(cfg, MeshShape.of(mesh), backend="cpu", dtype=dtype)
    return activation_bytes_per_layer(dataclasses.replace(x, rows=1))


def step_figures(cfg: Config, mesh, temp_bytes: int | None) -> dict:
    """Activation bytes per sequence (compiled and modelled) and step FLOPs with recomputation's
    share."""
    # what the run keeps on an accelerator
    dtype = Precision.of(cfg.model, backend="gpu").compute.name
    out = {
        "modelled_activation_dtype": dtype,
        "modelled_bytes_per_layer_and_sequence": modelled_bytes_per_layer(cfg, mesh, dtype),
        "modelled_float32_bytes_per_layer_and_sequence": modelled_bytes_per_layer(
            cfg, mesh, "float32"
        ),
    }
    if temp_bytes is not None:
        out.update(activation_bytes_per_sequence(cfg, mesh, temp_bytes))
    out["step_flops"] = step_flops(cfg, mesh)
    base = out["step_flops"] if cfg.model.remat == "none" else step_flops(cfg, mesh, remat="none")
    out["recompute_overhead"] = out["step_flops"] / base - 1 if base else 0.0
    return out
