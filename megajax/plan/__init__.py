"""The planner: for a config, a device count and hardware, every way to run it (mesh,
microbatches, recomputation, sequence parallelism, ZeRO-1 / FSDP) with predicted memory per
device, step time by part, tokens/s, TFLOP/s, MFU and scaling efficiency, the fastest plan that
fits first. Nothing is compiled or allocated; `megajax-plan` / `python -m megajax.plan` print it.

    memory.py     bytes per device                     volumes.py   FLOPs and collective volumes
    timing.py     step time                            search.py    the plans and their order
    report.py     the table                            auto.py      what --mesh auto runs
    paper.py      the 2019 paper's scaling study       paper2021.py the 2021 paper's Table 1
    measured.py   the GPU runs the stack is fitted on
(the accelerators, and a user's TOML of one: megajax/hardware.py)
"""

from megajax.hardware import BUILTIN, Hardware, load_hardware, pick_hardware
from megajax.plan.search import Plan, plan

__all__ = ["BUILTIN", "Hardware", "Plan", "load_hardware", "pick_hardware", "plan"]
