"""The planner: for a config, a device count and hardware, every way to run it (mesh,
microbatches, recomputation, sequence parallelism, ZeRO-1 / FSDP) with predicted memory per
device, step time by part, tokens/s, TFLOP/s, MFU and scaling efficiency, the fastest plan that
fits first. Nothing is compiled or allocated; `megajax-plan` / `python -m megajax.plan` print it.

    hardware.py  the accelerators (and a user's TOML)      memory.py  bytes per device
    volumes.py   FLOPs and collective volumes               timing.py  step time
    search.py    the plans and their order                  report.py  the table
    paper.py     the paper's scaling study, predicted
"""
from megajax.hardware import BUILTIN, Hardware, load_hardware, pick_hardware
from megajax.plan.search import Plan, plan

__all__ = ["BUILTIN", "Hardware", "Plan", "load_hardware", "pick_hardware", "plan"]
