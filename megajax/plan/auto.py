"""`--mesh auto`: every device on the data axis when the run fits there, as it always was;
otherwise (the model too big for a device, or a batch that does not split over every device)
the fastest mesh (data, pipeline stages, model) that megajax-plan predicts to fit, with the
run's own options. When none does, every device on "data", and the run's own checks say why."""
from __future__ import annotations

import types

from megajax.config import Config, ConfigError
from megajax.core.mesh import check_fits
from megajax.core.sharding import DATA, MODEL, PIPE
from megajax.hardware import BUILTIN, for_device
from megajax.plan.memory import memory_bytes
from megajax.plan.search import evaluate, model_sizes, stage_counts

# step times rank the meshes; an accelerator jax does not name (a CPU) is ranked as this one
RANKED_AS = "h100-80g"


def _runs_on(cfg: Config, dp: int, tp: int, pp: int) -> bool:
    """Whether the run's sizes divide over such a mesh (core/mesh.py's rules, on its sizes)."""
    try:
        check_fits(cfg, types.SimpleNamespace(shape={DATA: dp, MODEL: tp, PIPE: pp}))
    except ConfigError:
        return False
    return True


def auto_mesh(cfg: Config, devices: int, device_bytes: int | None, backend: str,
              device_kind: str = "") -> tuple[str, str | None]:
    """(the mesh spec `--mesh auto` runs, a line saying why when it is not every device on
    "data", else None)."""
    kind = "cpu" if backend == "cpu" else "gpu"

    def need(dp, tp, pp):
        return memory_bytes(cfg, dp, tp, kind, pp)["total"]
    if not device_bytes or devices == 1:
        return "auto", None
    flat = need(devices, 1, 1) if _runs_on(cfg, devices, 1, 1) else None
    if flat is not None and flat <= device_bytes:
        return "auto", None
    hw = for_device(device_kind) or BUILTIN[RANKED_AS]
    fitting = [(evaluate(cfg, devices // tp // pp, tp, hw, pp=pp).step_seconds, tp, pp)
               for tp in model_sizes(cfg, devices) for pp in stage_counts(cfg, devices, tp)
               if _runs_on(cfg, devices // tp // pp, tp, pp)
               and need(devices // tp // pp, tp, pp) <= device_bytes]
    if not fitting:
        return "auto", None       # the run's own check says what does not fit, and why
    _, tp, pp = min(fitting)
    dp = devices // tp // pp
    spec = f"data={dp},pipe={pp},model={tp}" if pp > 1 else f"data={dp},model={tp}"
    flat_line = ("the batch does not split over every device on the data axis"
                 if flat is None else
                 f"every device on the data axis would need about {flat / 2**30:,.1f} GiB per "
                 f"device, and a device has {device_bytes / 2**30:,.1f} GiB")
    return spec, (f"--mesh auto: {flat_line}; running {spec}, the fastest mesh megajax-plan "
                  f"predicts to fit with this run's options")
