"""The jax device mesh megajax runs on: laid out from a `MeshShape` (megajax/mesh_shape.py,
which parses `--mesh`), a user's own mesh taken as megajax's, the rules a run must meet to fit
on one, and batches padded to split over its data axis."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh

from megajax.config import ConfigError
from megajax.core.sharding import AXES, check_context_mesh, is_megajax_mesh
from megajax.mesh_shape import LAYOUT, MeshShape


def _describe_devices(devices) -> str:
    kinds = sorted({d.platform for d in devices})
    return f"{len(devices)} {'/'.join(kinds)} device{'s' if len(devices) != 1 else ''} available"


def _simulate_hint(spec: str, devices) -> str:
    """On the CPU, how to get the devices a mesh asks for: simulate them."""
    n = MeshShape.devices_asked(spec)
    if any(d.platform != "cpu" for d in devices) or not n:
        return ""
    return (
        f"; simulate {n} on the CPU with --host-devices {n} (train.py, eval.py), or in Python set "
        f"XLA_FLAGS=--xla_force_host_platform_device_count={n} before importing jax"
    )


def mesh_shape(spec: str | MeshShape, devices=None) -> MeshShape:
    """`spec` (a string such as "2x4", or a shape) on `devices` (default: all devices of all
    processes), or ValueError naming the devices there are."""
    devices = list(jax.devices() if devices is None else devices)
    try:
        shape = spec if isinstance(spec, MeshShape) else MeshShape.parse(spec, len(devices))
        if shape.devices != len(devices):
            raise ValueError(f"mesh '{shape}' needs {shape.devices} devices")
    except ValueError as e:
        raise ValueError(
            f"{e}; {_describe_devices(devices)}{_simulate_hint(str(spec), devices)}"
        ) from None
    return shape


def make_mesh(spec: str | MeshShape = "auto", devices=None) -> Mesh:
    """A `Mesh` with axes ("data", "model"), or ("pipe", "data", "model") when the shape has
    more than one pipeline stage, over `devices` (default: all devices of all processes).

    The axes are Auto (GSPMD-style): weights carry PartitionSpecs and XLA inserts the
    collectives; megajax pins them to Megatron's places with sharding constraints.
    """
    devices = list(jax.devices() if devices is None else devices)
    shape = mesh_shape(spec, devices)
    types = (jax.sharding.AxisType.Auto,) * len(shape.axis_names)
    if len(devices) == len(jax.devices()) and devices == list(jax.devices()):
        # jax.make_mesh orders devices so that the model axis gets the fastest links.
        return jax.make_mesh(shape.dims, shape.axis_names, axis_types=types)
    return Mesh(np.asarray(devices).reshape(shape.dims), shape.axis_names, axis_types=types)


def mesh_sizes(mesh) -> dict[str, int]:
    """{"data": D, "model": M}, with "pipe" first when the mesh has pipeline stages: what the
    log, the dry run and eval's results name a mesh by."""
    return MeshShape.of(mesh).sizes()


def as_mesh(mesh) -> Mesh:
    """The mesh every megajax entry point runs on, from a user's: `mesh` itself when megajax
    built it; the same devices laid out (data, model) with Auto axes when it names the axes in
    another order, only one of them, or as Explicit axes (what `jax.make_mesh` makes by
    default: megajax's partition specs are sharding constraints that XLA propagates, which
    Explicit axes forbid); a spec string such as "2x4" is built by `make_mesh`."""
    check_context_mesh()
    if isinstance(mesh, str):
        return make_mesh(mesh)
    if not isinstance(mesh, Mesh):
        raise TypeError(
            f"expected a jax.sharding.Mesh with axes {AXES} or a spec such as '2x4', got "
            f"{type(mesh).__name__}"
        )
    names = tuple(mesh.axis_names)
    if not names or set(names) - set(LAYOUT) or len(set(names)) != len(names):
        raise ConfigError(
            "megajax's mesh axes are 'data' and 'model' (and 'pipe' for pipeline stages, "
            f"'expert' for experts), this mesh has {names}: name them so (or build the mesh "
            "with megajax.make_mesh('2x4'))"
        )
    if is_megajax_mesh(mesh):
        return mesh
    target = MeshShape.of(mesh).axis_names
    order = [names.index(a) for a in LAYOUT if a in names]
    devices = mesh.devices.transpose(order)
    return Mesh(
        devices.reshape([mesh.shape.get(a, 1) for a in target]),
        target,
        axis_types=(jax.sharding.AxisType.Auto,) * len(target),
    )


def single_device_mesh() -> Mesh:
    """A 1x1 mesh on the first device: the reference that multi-device runs must reproduce."""
    return make_mesh("1x1", devices=jax.devices()[:1])


def _shape(mesh) -> MeshShape:
    return mesh if isinstance(mesh, MeshShape) else MeshShape.of(mesh)


def check_fits(cfg, mesh, *, batch: bool = True):
    """Every divisibility rule of a run on `mesh` (a jax Mesh or a MeshShape), in one place;
    ConfigError names the first broken one. Megatron's: hidden, heads and ffn split over "model"
    (the vocabulary is padded for it: ModelConfig.vocab_rows). With `batch` (training), the
    global batch and each microbatch split over "data"."""
    check_model_fits(cfg.model, mesh)
    if not batch:
        return
    check_pipeline_fits(cfg, mesh)
    m, t, dp = cfg.model, cfg.train, _shape(mesh).batch_shards
    axis = "data axis" if _shape(mesh).expert == 1 else "data and expert axes"
    # never near: GPT-3 trained on 3.2M tokens a batch
    if t.batch_size * (m.seq_len + 1) >= 2**31:
        raise ConfigError(
            f"a batch of {t.batch_size} x {m.seq_len + 1} tokens is more than the 2^31 the step "
            "counts in int32: lower train.batch_size or model.seq_len"
        )
    if t.batch_size % dp:
        raise ConfigError(f"global batch {t.batch_size} is not divisible by the {axis} ({dp})")
    if (t.batch_size // t.microbatches) % dp:
        raise ConfigError(
            f"microbatch of {t.batch_size // t.microbatches} rows (batch {t.batch_size} / "
            f"{t.microbatches} microbatches) is not divisible by the {axis} ({dp})"
        )


def check_model_fits(m, mesh):
    """Megatron's rules for a model (a ModelConfig) on `mesh`: hidden, heads and ffn split over
    "model" (and the sequence, with sequence parallelism). The vocabulary is padded for the
    model axis (ModelConfig.vocab_rows)."""
    tp, ep = _shape(mesh).model, _shape(mesh).expert
    if ep > 1 and not m.num_experts:
        raise ConfigError(
            f"the mesh's expert axis (expert={ep}) splits a mixture of experts' experts: this "
            "model is dense (model.num_experts = 0)"
        )
    if m.num_experts % ep:
        raise ConfigError(
            f"model.num_experts={m.num_experts} is not divisible by the expert axis ({ep})"
        )
    widths = [("hidden", m.hidden), ("num_heads", m.num_heads), ("ffn_hidden", m.ffn)]
    if m.num_experts:  # each expert's MLP and the shared experts split as the dense MLP is
        widths += [("moe_ffn_hidden", m.moe_ffn), ("moe_shared_ffn_hidden", m.moe_shared_ffn)]
    for what, size in widths:
        if size % tp:
            raise ConfigError(f"model {what}={size} is not divisible by the model axis ({tp})")
    if m.kv_heads % tp and tp % m.kv_heads:  # grouped-query: split, or each device holding one
        raise ConfigError(
            f"model num_kv_heads={m.kv_heads} and the model axis ({tp}) must divide one another: "
            "the key/value heads are split over it, or each device holds the one its query heads "
            "read"
        )
    if m.sequence_parallel and m.seq_len % tp:
        raise ConfigError(
            f"model.seq_len={m.seq_len} is not divisible by the model axis ({tp}), which sequence "
            "parallelism splits the sequence over"
        )


def check_pipeline_fits(cfg, mesh):
    """A pipeline's rules: stages (times chunks) divide the layers, and what it runs with."""
    pp, t = _shape(mesh).pipe, cfg.train
    if pp == 1:
        return
    chunks = pp * t.pipeline_chunks
    if cfg.model.num_layers % chunks:
        raise ConfigError(
            f"model.num_layers={cfg.model.num_layers} is not divisible by the pipeline's {pp} "
            "stages" + (f" x {t.pipeline_chunks} chunks" if t.pipeline_chunks > 1 else "")
        )
    if t.pipeline_schedule == "interleaved" and t.microbatches % pp:
        raise ConfigError(
            f"the interleaved schedule needs train.microbatches ({t.microbatches}) to be a "
            f"multiple of the pipeline stages ({pp})"
        )
    for refused, why in (
        (not cfg.model.scan_layers, "model.scan_layers = false"),
        (t.layer_programs, "train.layer_programs"),
    ):
        if refused:
            raise ConfigError(f"a pipeline (mesh axis pipe={pp}) does not run with {why} yet")


def padded_rows(n: int, mesh: MeshShape) -> np.ndarray:
    """Row indices 0..n-1, then the last row repeated until the count divides the data axis:
    every batch megajax builds for inference splits evenly over "data"; callers drop the copies."""
    return np.minimum(np.arange(n + -n % mesh.batch_shards), n - 1)


def padded_batches(n: int, batch_size: int, mesh: MeshShape):
    """(row indices, 0/1 real-row weights) of equal batches covering n rows: the batch size
    rounded down to a multiple of the data axis (at least one row per shard), the last batch
    padded with copies of the final row. No larger than the rows need: a batch size of a million
    over a hundred rows is one batch of a hundred-odd rows, not a million-row allocation."""
    dp = mesh.batch_shards
    batch_size = max(dp, min(batch_size - batch_size % dp, n + -n % dp))
    for start in range(0, n, batch_size):
        rows = np.arange(start, start + batch_size)
        yield np.minimum(rows, n - 1), (rows < n).astype(np.float32)
