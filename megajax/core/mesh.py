"""The ("data", "model") device mesh: built from a short user-facing spec string, the rules a
run must meet to fit on it, and batches padded to split over its data axis.

Accepted specs:
  "data=2,model=4"  explicit sizes (either may be omitted; it then takes the remaining devices)
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
from megajax.core.sharding import AXES, DATA, MODEL, check_context_mesh, is_megajax_mesh

AUTO_AXES = (jax.sharding.AxisType.Auto,) * 2   # weights carry specs, XLA propagates them (GSPMD)


def _describe_devices(devices) -> str:
    kinds = sorted({d.platform for d in devices})
    return f"{len(devices)} {'/'.join(kinds)} device{'s' if len(devices) != 1 else ''} available"


def _simulate_hint(spec: str, devices) -> str:
    """On the CPU, how to get the devices a mesh asks for: simulate them."""
    if any(d.platform != "cpu" for d in devices):
        return ""
    sizes = [int(n) for n in re.findall(r"\d+", spec or "")]
    n = math.prod(sizes) if sizes else 8
    return (f"; simulate {n} on the CPU with --host-devices {n} (train.py, eval.py), or in Python "
            f"set XLA_FLAGS=--xla_force_host_platform_device_count={n} before importing jax")


def parse_mesh_spec(spec: str, num_devices: int) -> tuple[int, int]:
    """Return (data, model) sizes for `spec` on `num_devices` devices, or raise ValueError (the
    caller names the devices)."""
    s = (spec or "auto").strip().lower().replace(" ", "")
    if s == "auto":
        return num_devices, 1
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
        if name not in AXES:
            raise ValueError(f"mesh '{spec}': unknown axis '{name}' (axes are 'data' and 'model')")
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
    for name, other in ((DATA, MODEL), (MODEL, DATA)):
        if name not in sizes:
            if num_devices % sizes[other]:
                raise ValueError(
                    f"mesh '{spec}': {other}={sizes[other]} does not divide the number of devices")
            sizes[name] = num_devices // sizes[other]
    if sizes[DATA] * sizes[MODEL] != num_devices:
        raise ValueError(
            f"mesh '{spec}' needs {sizes[DATA] * sizes[MODEL]} devices "
            f"(data={sizes[DATA]} x model={sizes[MODEL]})")
    return sizes[DATA], sizes[MODEL]


def make_mesh(spec: str = "auto", devices=None) -> Mesh:
    """A `Mesh` with axes ("data", "model") over `devices` (default: all devices of all processes).

    The axes are Auto (GSPMD-style): weights carry PartitionSpecs and XLA inserts the
    collectives; megajax pins them to Megatron's places with sharding constraints.
    """
    devices = list(jax.devices() if devices is None else devices)
    try:
        data, model = parse_mesh_spec(spec, len(devices))
    except ValueError as e:
        raise ValueError(f"{e}; {_describe_devices(devices)}{_simulate_hint(spec, devices)}") \
            from None
    if len(devices) == len(jax.devices()) and devices == list(jax.devices()):
        # jax.make_mesh orders devices so that the model axis gets the fastest links.
        return jax.make_mesh((data, model), AXES, axis_types=AUTO_AXES)
    return Mesh(np.asarray(devices).reshape(data, model), AXES, axis_types=AUTO_AXES)


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
    if not names or set(names) - set(AXES) or len(set(names)) != len(names):
        raise ConfigError(
            f"megajax's mesh axes are 'data' and 'model', this mesh has {names}: name them so "
            f"(or build the mesh with megajax.make_mesh('2x4'))")
    if is_megajax_mesh(mesh):
        return mesh
    devices = mesh.devices.transpose([names.index(a) for a in AXES if a in names])
    return Mesh(devices.reshape([mesh.shape.get(a, 1) for a in AXES]), AXES, axis_types=AUTO_AXES)


def single_device_mesh() -> Mesh:
    """A 1x1 mesh on the first device: the reference that multi-device runs must reproduce."""
    return make_mesh("1x1", devices=jax.devices()[:1])


def check_fits(cfg, mesh, *, batch: bool = True):
    """Every divisibility rule of a run on `mesh`, in one place; ConfigError names the first
    broken one. Megatron's: hidden, heads, ffn and the padded vocabulary split over "model".
    With `batch` (training), the global batch and each microbatch split over "data"."""
    check_model_fits(cfg.model, mesh)
    if not batch:
        return
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
    """Megatron's rules for a model (a ModelConfig) on `mesh`: hidden, heads, ffn and the
    padded vocabulary split over "model" (and the sequence, with sequence parallelism)."""
    tp = mesh.shape[MODEL]
    for what, size in (("hidden", m.hidden), ("num_heads", m.num_heads),
                       ("ffn_hidden", m.ffn), ("padded vocab", m.padded_vocab)):
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
