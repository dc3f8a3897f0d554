"""The ("data", "model") device mesh: built from a short user-facing spec string, the rules a
run must meet to fit on it, and batches padded to split over its data axis.

Accepted specs:
  "data=2,model=4"  explicit sizes (either may be omitted; it then takes the remaining devices)
  "data=2,pipe=2,model=2"  with pipeline stages (megajax/training/pipeline.py)
  "2x4"             shorthand for data x model
  "model=8"         model axis of 8, data takes whatever is left
  "auto"            every device on the data axis (pure data parallelism)
"""
from __future__ import annotations

import math
import re

import jax
import numpy as np
from jax.sharding import Mesh

from megajax.config import ConfigError
from megajax.core.sharding import (AXES, DATA, MODEL, PIPE, PIPE_AXES, check_context_mesh,
                                   is_megajax_mesh)



def _describe_devices(devices) -> str:
    kinds = sorted({d.platform for d in devices})
    return f"{len(devices)} {'/'.join(kinds)} device{'s' if len(devices) != 1 else ''} available"


def _devices_needed(spec: str) -> int | None:
    """How many devices a well-formed spec asks for (the product of its sizes; auto: 8 to
    suggest); None when the spec itself is wrong (no device count would do)."""
    sizes = [int(n) for n in re.findall(r"\d+", spec or "")]
    n = math.prod(sizes) if sizes else 8
    try:
        parse_mesh_axes(spec, n)
    except ValueError:
        return None
    return n


def _simulate_hint(spec: str, devices) -> str:
    """On the CPU, how to get the devices a mesh asks for: simulate them."""
    n = _devices_needed(spec)
    if any(d.platform != "cpu" for d in devices) or not n:
        return ""
    return (f"; simulate {n} on the CPU with --host-devices {n} (train.py, eval.py), or in Python "
            f"set XLA_FLAGS=--xla_force_host_platform_device_count={n} before importing jax")


def parse_mesh_axes(spec: str, num_devices: int) -> dict[str, int]:
    """{"pipe": P, "data": D, "model": M} for `spec` on `num_devices` devices, or ValueError (the
    caller names the devices). "pipe" is 1 unless given; of "data" and "model", one left out
    takes the remaining devices (both: "data" does)."""
    s = (spec or "auto").strip().lower().replace(" ", "")
    if s == "auto":
        return {PIPE: 1, DATA: num_devices, MODEL: 1}
    sizes: dict[str, int] = {}
    if "x" in s and "=" not in s:
        parts = s.split("x")
        if len(parts) != 2:
            raise ValueError(f"mesh '{spec}': the shorthand is DATAxMODEL, e.g. 2x4")
        pairs = list(zip(AXES, parts))
    else:
        pairs = []
        for item in filter(None, s.split(",")):
            if "=" not in item:
                raise ValueError(f"mesh '{spec}': expected AXIS=SIZE items such as data=2,model=4")
            pairs.append(tuple(item.split("=", 1)))
    for name, value in pairs:
        if name not in PIPE_AXES:
            raise ValueError(f"mesh '{spec}': unknown axis '{name}' (axes are 'data', 'pipe' "
                             f"and 'model')")
        if name in sizes:
            raise ValueError(f"mesh '{spec}': axis '{name}' given twice")
        try:
            size = int(value)
        except ValueError:
            raise ValueError(
                f"mesh '{spec}': size of '{name}' must be an integer, got '{value}'") from None
        if size <= 0:
            raise ValueError(f"mesh '{spec}': size of '{name}' must be positive, got {size}")
        sizes[name] = size
    if not sizes:
        raise ValueError(f"mesh '{spec}' names no axis")
    sizes.setdefault(PIPE, 1)
    if DATA not in sizes and MODEL not in sizes:
        sizes[MODEL] = 1
    for name, other in ((DATA, MODEL), (MODEL, DATA)):
        if name not in sizes:
            given = sizes[other] * sizes[PIPE]
            if num_devices % given:
                raise ValueError(f"mesh '{spec}': {_named(sizes)} does not divide the number "
                                 f"of devices")
            sizes[name] = num_devices // given
    need = math.prod(sizes.values())
    if need != num_devices:
        raise ValueError(f"mesh '{spec}' needs {need} devices ({_named(sizes)})")
    return {a: sizes[a] for a in PIPE_AXES}


def _named(sizes: dict) -> str:
    return " x ".join(f"{a}={sizes[a]}" for a in PIPE_AXES if a in sizes
                      and (a != PIPE or sizes[a] > 1))


def parse_mesh_spec(spec: str, num_devices: int) -> tuple[int, ...]:
    """(data, model) sizes for `spec` on `num_devices` devices, (pipe, data, model) when it has
    pipeline stages; or ValueError."""
    sizes = parse_mesh_axes(spec, num_devices)
    axes = PIPE_AXES if sizes[PIPE] > 1 else AXES
    return tuple(sizes[a] for a in axes)


def make_mesh(spec: str = "auto", devices=None) -> Mesh:
    """A `Mesh` with axes ("data", "model"), or ("pipe", "data", "model") when the spec names
    more than one pipeline stage, over `devices` (default: all devices of all processes).

    The axes are Auto (GSPMD-style): weights carry PartitionSpecs and XLA inserts the
    collectives; megajax pins them to Megatron's places with sharding constraints.
    """
    devices = list(jax.devices() if devices is None else devices)
    try:
        shape = parse_mesh_spec(spec, len(devices))
    except ValueError as e:
        raise ValueError(f"{e}; {_describe_devices(devices)}{_simulate_hint(spec, devices)}") \
            from None
    names = PIPE_AXES if len(shape) == 3 else AXES
    types = (jax.sharding.AxisType.Auto,) * len(names)
    if len(devices) == len(jax.devices()) and devices == list(jax.devices()):
        # jax.make_mesh orders devices so that the model axis gets the fastest links.
        return jax.make_mesh(shape, names, axis_types=types)
    return Mesh(np.asarray(devices).reshape(shape), names, axis_types=types)


def mesh_sizes(mesh) -> dict[str, int]:
    """{"data": D, "model": M}, with "pipe" first when the mesh has pipeline stages: what the
    log, the dry run and eval's results name a mesh by."""
    return {a: mesh.shape[a] for a in PIPE_AXES if a in mesh.shape}


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
        raise TypeError(f"expected a jax.sharding.Mesh with axes {AXES} or a spec such as '2x4', "
                        f"got {type(mesh).__name__}")
    names = tuple(mesh.axis_names)
    if not names or set(names) - set(PIPE_AXES) or len(set(names)) != len(names):
        raise ConfigError(
            f"megajax's mesh axes are 'data' and 'model' (and 'pipe' for pipeline stages), this "
            f"mesh has {names}: name them so (or build the mesh with megajax.make_mesh('2x4'))")
    if is_megajax_mesh(mesh):
        return mesh
    target = PIPE_AXES if mesh.shape.get(PIPE, 1) > 1 else AXES
    order = [names.index(a) for a in PIPE_AXES if a in names]
    devices = mesh.devices.transpose(order)
    return Mesh(devices.reshape([mesh.shape.get(a, 1) for a in target]), target,
                axis_types=(jax.sharding.AxisType.Auto,) * len(target))


def single_device_mesh() -> Mesh:
    """A 1x1 mesh on the first device: the reference that multi-device runs must reproduce."""
    return make_mesh("1x1", devices=jax.devices()[:1])


def check_fits(cfg, mesh, *, batch: bool = True):
    """Every divisibility rule of a run on `mesh`, in one place; ConfigError names the first
    broken one. Megatron's: hidden, heads and ffn split over "model" (the vocabulary is padded
    for it: ModelConfig.vocab_rows). With `batch` (training), the global batch and each
    microbatch split over "data"."""
    check_model_fits(cfg.model, mesh)
    if not batch:
        return
    check_pipeline_fits(cfg, mesh)
    m, t, dp = cfg.model, cfg.train, mesh.shape[DATA]
    # never near: GPT-3 trained on 3.2M tokens a batch
    if t.batch_size * (m.seq_len + 1) >= 2**31:
        raise ConfigError(
            f"a batch of {t.batch_size} x {m.seq_len + 1} tokens is more than the 2^31 the step "
            f"counts "
            f"in int32: lower train.batch_size or model.seq_len")
    if t.batch_size % dp:
        raise ConfigError(f"global batch {t.batch_size} is not divisible by the data axis ({dp})")
    if (t.batch_size // t.microbatches) % dp:
        raise ConfigError(
            f"microbatch of {t.batch_size // t.microbatches} rows (batch {t.batch_size} / "
            f"{t.microbatches} microbatches) is not divisible by the data axis ({dp})")


def check_model_fits(m, mesh):
    """Megatron's rules for a model (a ModelConfig) on `mesh`: hidden, heads and ffn split over
    "model" (and the sequence, with sequence parallelism). The vocabulary is padded for the
    model axis (ModelConfig.vocab_rows)."""
    tp = mesh.shape[MODEL]
    for what, size in (("hidden", m.hidden), ("num_heads", m.num_heads), ("ffn_hidden", m.ffn)):
        if size % tp:
            raise ConfigError(f"model {what}={size} is not divisible by the model axis ({tp})")
    if m.kv_heads % tp and tp % m.kv_heads:   # grouped-query: split, or each device holding one
        raise ConfigError(
            f"model num_kv_heads={m.kv_heads} and the model axis ({tp}) must divide one "
            f"another: the key/value heads are split over it, or each device holds the one "
            f"its query heads read")
    if m.sequence_parallel and m.seq_len % tp:
        raise ConfigError(
            f"model.seq_len={m.seq_len} is not divisible by the model axis ({tp}), which "
            f"sequence parallelism splits the sequence over")


def check_pipeline_fits(cfg, mesh):
    """A pipeline's rules: stages (times chunks) divide the layers, and what it runs with."""
    pp, t = mesh.shape.get(PIPE, 1), cfg.train
    if pp == 1:
        return
    chunks = pp * t.pipeline_chunks
    if cfg.model.num_layers % chunks:
        raise ConfigError(
            f"model.num_layers={cfg.model.num_layers} is not divisible by the pipeline's "
            f"{pp} stages" + (f" x {t.pipeline_chunks} chunks" if t.pipeline_chunks > 1 else ""))
    if t.pipeline_schedule == "interleaved" and t.microbatches % pp:
        raise ConfigError(
            f"the interleaved schedule needs train.microbatches ({t.microbatches}) to be a "
            f"multiple of the pipeline stages ({pp})")
    for refused, why in ((not cfg.model.scan_layers, "model.scan_layers = false"),
                         (t.layer_programs, "train.layer_programs")):
        if refused:
            raise ConfigError(f"a pipeline (mesh axis pipe={pp}) does not run with {why} yet")


def padded_rows(n: int, dp: int) -> np.ndarray:
    """Row indices 0..n-1, then the last row repeated until the count divides the data axis:
    every batch megajax builds for inference splits evenly over "data"; callers drop the copies."""
    return np.minimum(np.arange(n + -n % dp), n - 1)


def padded_batches(n: int, batch_size: int, dp: int):
    """(row indices, 0/1 real-row weights) of equal batches covering n rows: the batch size
    rounded down to a multiple of the data axis (at least one row per shard), the last batch
    padded with copies of the final row. No larger than the rows need: a batch size of a million
    over a hundred rows is one batch of a hundred-odd rows, not a million-row allocation."""
    batch_size = max(dp, min(batch_size - batch_size % dp, n + -n % dp))
    for start in range(0, n, batch_size):
        rows = np.arange(start, start + batch_size)
        yield np.minimum(rows, n - 1), (rows < n).astype(np.float32)
