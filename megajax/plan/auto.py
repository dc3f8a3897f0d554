"""`--mesh auto`: every device on the data axis when the run fits there, as it always was;
otherwise (the model too big for a device, or a batch that does not split over every device)
the fastest mesh (data, pipeline stages, experts, model) that megajax-plan predicts to fit, with the
run's own options. When none does, every device on "data", and the run's own checks say why."""

from __future__ import annotations

import jax

from megajax.config import Config, ConfigError
from megajax.core.mesh import check_fits, mesh_shape
from megajax.errors import UserError
from megajax.hardware import BUILTIN, for_device
from megajax.mesh_shape import AUTO, MeshShape
from megajax.plan.memory import memory_bytes
from megajax.plan.search import evaluate, meshes
from megajax.training import memory

# step times rank the meshes; an accelerator jax does not name (a CPU) is ranked as this one
RANKED_AS = "h100-80g"


def _runs_on(cfg: Config, mesh: MeshShape) -> bool:
    """Whether the run's sizes divide over such a mesh (core/mesh.py's rules, on its sizes)."""
    try:
        check_fits(cfg, mesh)
    except ConfigError:
        return False
    return True


def auto_mesh(
    cfg: Config, devices: int, device_bytes: int | None, backend: str, device_kind: str = ""
) -> tuple[MeshShape, str | None]:
    """(the mesh `--mesh auto` runs, a line saying why when it is not every device on "data",
    else None)."""
    kind = "cpu" if backend == "cpu" else "gpu"
    flat = MeshShape(data=devices)
    if not device_bytes or devices == 1:
        return flat, None
    flat_need = memory_bytes(cfg, flat, kind)["total"] if _runs_on(cfg, flat) else None
    if flat_need is not None and flat_need <= device_bytes:
        return flat, None
    hw = for_device(device_kind) or BUILTIN[RANKED_AS]
    fitting = [
        (evaluate(cfg, mesh, hw).step_seconds, mesh.model, mesh.pipe, mesh)
        for mesh in meshes(cfg, devices)
        if _runs_on(cfg, mesh) and memory_bytes(cfg, mesh, kind)["total"] <= device_bytes
    ]
    if not fitting:
        return flat, None  # the run's own check says what does not fit, and why
    mesh = min(fitting, key=lambda f: f[:3])[3]
    flat_line = (
        "the batch does not split over every device on the data axis"
        if flat_need is None
        else f"every device on the data axis would need about {flat_need / 2**30:,.1f} GiB per "
        f"device, and a device has {device_bytes / 2**30:,.1f} GiB"
    )
    return mesh, (
        f"--mesh auto: {flat_line}; running {mesh}, the fastest mesh megajax-plan predicts to fit "
        "with this run's options"
    )


def resolve_mesh(spec: str | None, run_config, devices=None) -> tuple[MeshShape, str | None]:
    """(the mesh `--mesh SPEC` runs on `devices` (default: all), a line saying why when "auto"
    chose other than every device on "data"): SPEC parsed (ValueError naming the devices), or
    for "auto" `auto_mesh`'s choice for the config `run_config()` returns (train.py: the run's,
    with a pretrained workdir's shape; eval.py: the workdir's). The same in both programs."""
    devices = list(jax.devices() if devices is None else devices)
    if (spec or AUTO).strip().lower() != AUTO:
        return mesh_shape(spec, devices), None
    try:
        cfg = run_config().validate()
    except UserError:
        return MeshShape(data=len(devices)), None  # the run's own checks report it, in order
    return auto_mesh(
        cfg,
        len(devices),
        memory.device_memory_bytes(),
        jax.default_backend(),
        devices[0].device_kind,
    )
