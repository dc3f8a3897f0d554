"""The accelerators megajax knows (the planner's hardware, and the peak the training log's MFU is
measured against), and the TOML a user adds their own with.

Every figure is per GPU unless it says per node; bandwidths are one direction (what a ring
all-reduce moves data over), in bytes per second. Sources are the vendors' datasheets and, for
the paper's machine, the paper itself (Shoeybi et al. 2019, section 5: "300 GB/sec bandwidth
between GPUs inside a server via NVSwitch and 100 GB/sec of interconnect bandwidth between
servers using 8 InfiniBand adapters per server"; 39 TFLOP/s on one V100 is "30% of peak").

A user file (`--hardware my_gpus.toml`) holds one table per accelerator, keys as below:

    [my-gpu]
    peak_flops = 989e12          # dense bf16/fp16 matrix FLOP/s
    memory_bytes = 80e9
    hbm_bandwidth = 3.35e12
    gpus_per_node = 8
    intra_node_bandwidth = 450e9 # per GPU, one direction (NVLink)
    inter_node_bandwidth = 400e9 # per node, all NICs together, one direction
    stack = "megajax"            # optional: what runs there (below)
    peak_flops_f32 = 67e12       # optional: float32 FLOP/s without tensor cores (the log's MFU
                                 # of a float32 run)

`stack` picks the step-time constants of megajax/plan/timing.py: "megajax" (the default) is
megajax's XLA-compiled step, calibrated on an H200; "megatron-2019" is the paper's Megatron-LM
(PyTorch, eager), calibrated on its DGX-2H figures, which the built-in v100-dgx2h uses so that
the planner reproduces the paper's scaling study; "megatron-2021" is Narayanan et al.'s
Megatron-LM on A100s (megajax/plan/paper2021.py).
"""

from __future__ import annotations

import dataclasses
import math
import re
import tomllib
from pathlib import Path

from megajax.errors import UserError


@dataclasses.dataclass(frozen=True)
class Hardware:
    name: str
    peak_flops: float  # dense 16-bit matrix-unit FLOP/s
    memory_bytes: float
    hbm_bandwidth: float  # bytes/s
    gpus_per_node: int
    intra_node_bandwidth: float  # per GPU, one direction
    inter_node_bandwidth: float  # per node (all NICs), one direction
    # s per ring step (NVLink/NVSwitch; nccl-tests small-message times)
    intra_node_latency: float = 5e-6
    inter_node_latency: float = 10e-6  # s per ring step (InfiniBand)
    source: str = ""
    # whose step runs there: one of STACKS (timing.py's constants)
    stack: str = "megajax"
    peak_flops_f32: float = 0.0  # float32 FLOP/s, CUDA cores (0: unknown)
    # what jax calls the device (device_kind contains one of these): the log's MFU finds it
    device_kinds: tuple[str, ...] = ()


STACKS = ("megajax", "megatron-2019", "megatron-2021")
GB, TB, TFLOPS = 1e9, 1e12, 1e12
BUILTIN = {
    h.name: h
    for h in (
        Hardware(
            "v100-dgx2h",
            130 * TFLOPS,
            32 * 2**30,
            900 * GB,
            16,
            150 * GB,
            100 * GB,
            stack="megatron-2019",
            peak_flops_f32=15.7 * TFLOPS,
            device_kinds=("V100",),
            source="the paper's: DGX-2H, V100 SXM3 32GB at 450 W (39 TFLOP/s = 30% of peak: 130), "
            "NVSwitch 300 GB/s per GPU both ways, 8 x 100 Gb/s InfiniBand per node; HBM2 900 GB/s "
            "(NVIDIA V100 datasheet)",
        ),
        Hardware(
            "a100-80g",
            312 * TFLOPS,
            80 * GB,
            2039 * GB,
            8,
            300 * GB,
            200 * GB,
            peak_flops_f32=19.5 * TFLOPS,
            device_kinds=("A100",),
            source="DGX A100: A100 SXM4 80GB, 312 TFLOP/s bf16 dense, HBM2e 2,039 GB/s, NVLink 3 "
            "600 GB/s per GPU both ways, 8 x 200 Gb/s HDR InfiniBand per node (NVIDIA A100 "
            "datasheet)",
        ),
        Hardware(
            "h100-80g",
            989 * TFLOPS,
            80 * GB,
            3350 * GB,
            8,
            450 * GB,
            400 * GB,
            peak_flops_f32=67 * TFLOPS,
            device_kinds=("H100",),
            source="DGX H100: H100 SXM5 80GB, 989 TFLOP/s bf16 dense, HBM3 3.35 TB/s, NVLink 4 "
            "900 GB/s per GPU both ways, 8 x 400 Gb/s NDR InfiniBand per node (NVIDIA H100 "
            "datasheet)",
        ),
        Hardware(
            "t4",
            65 * TFLOPS,
            15 * 2**30,
            320 * GB,
            1,
            16 * GB,
            16 * GB,
            peak_flops_f32=8.1 * TFLOPS,
            device_kinds=("T4",),
            source="one T4 (Colab's free GPU): 65 TFLOP/s fp16 dense (no bf16 tensor cores: "
            "model.compute_dtype float16), 16 GB GDDR6 (15 GiB usable) at 320 GB/s, PCIe 3 x16 16 "
            "GB/s (NVIDIA T4 datasheet)",
        ),
        Hardware(
            "h200",
            989 * TFLOPS,
            141 * GB,
            4800 * GB,
            8,
            450 * GB,
            400 * GB,
            peak_flops_f32=67 * TFLOPS,
            device_kinds=("H200",),
            source="HGX H200: H200 SXM 141GB, 989 TFLOP/s bf16 dense, HBM3e 4.8 TB/s, NVLink 4 "
            "900 GB/s per GPU both ways, 8 x 400 Gb/s NDR InfiniBand per node (NVIDIA H200 "
            "datasheet)",
        ),
        Hardware(
            "l4",
            121 * TFLOPS,
            24 * GB,
            300 * GB,
            1,
            32 * GB,
            32 * GB,
            peak_flops_f32=30.3 * TFLOPS,
            device_kinds=("L4",),
            source="one L4: 121 TFLOP/s bf16 dense, 24 GB GDDR6 at 300 GB/s, PCIe 4 x16 (NVIDIA "
            "L4 datasheet)",
        ),
        Hardware(
            "a10",
            125 * TFLOPS,
            24 * GB,
            600 * GB,
            1,
            32 * GB,
            32 * GB,
            peak_flops_f32=31.2 * TFLOPS,
            device_kinds=("A10",),
            source="one A10: 125 TFLOP/s bf16 dense, 24 GB GDDR6 at 600 GB/s, PCIe 4 x16 (NVIDIA "
            "A10 datasheet)",
        ),
        Hardware(
            "l40s",
            362 * TFLOPS,
            48 * GB,
            864 * GB,
            1,
            32 * GB,
            32 * GB,
            peak_flops_f32=91.6 * TFLOPS,
            device_kinds=("L40S",),
            source="one L40S: 362 TFLOP/s bf16 dense, 48 GB GDDR6 at 864 GB/s, PCIe 4 x16 (NVIDIA "
            "L40S datasheet)",
        ),
    )
}
FIELDS = {f.name: f for f in dataclasses.fields(Hardware)}


def load_hardware(name_or_path: str) -> dict[str, Hardware]:
    """{name: Hardware} of one built-in name, or of every table in a TOML file."""
    if name_or_path in BUILTIN:
        return {name_or_path: BUILTIN[name_or_path]}
    path = Path(name_or_path)
    if path.suffix != ".toml":
        raise UserError(
            f"unknown hardware '{name_or_path}': one of {', '.join(BUILTIN)}, or a .toml file of "
            "your own"
        )
    try:
        tables = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise UserError(f"cannot read hardware file {path}: {e.strerror or e}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"hardware file {path} is not valid TOML: {e}") from None
    return {name: _hardware(name, table, path) for name, table in tables.items()}


def _hardware(name: str, table, path: Path) -> Hardware:
    if not isinstance(table, dict):
        raise UserError(f"hardware file {path}: '{name}' must be a table ([{name}])")
    unknown = sorted(set(table) - set(FIELDS) - {"name"})
    if unknown:
        raise UserError(
            f"hardware file {path}: [{name}] has unknown key(s) {', '.join(unknown)}; known: "
            f"{', '.join(f for f in FIELDS if f != 'name')}"
        )
    required = [
        f.name for f in FIELDS.values() if f.default is dataclasses.MISSING and f.name != "name"
    ]
    missing = [k for k in required if k not in table]
    if missing:
        raise UserError(f"hardware file {path}: [{name}] lacks {', '.join(missing)}")
    values = {}
    for key, value in table.items():
        if key in ("name", "source"):
            continue
        if key == "device_kinds":
            if not isinstance(value, list) or not all(isinstance(k, str) and k for k in value):
                raise UserError(
                    f"hardware file {path}: [{name}] device_kinds must be a list of names, e.g. "
                    f'["H100"], got {value!r}'
                )
            values[key] = tuple(value)
            continue
        if key == "stack":
            if value not in STACKS:
                raise UserError(
                    f"hardware file {path}: [{name}] stack must be one of {', '.join(STACKS)}, got "
                    f"{value!r}"
                )
            values[key] = value
            continue
        values[key] = _checked_number(f"hardware file {path}: [{name}] {key}", key, value)
    return Hardware(name=name, source=str(table.get("source", str(path))), **values)


# Physical bounds of each number, far outside any accelerator built or announced: a value past
# them is a typo or a unit slip (1e-300 FLOP/s; 0.5 GPUs per node), and the planner's arithmetic
# must never see a NaN, an infinity, a zero it divides by, or a count that is not whole.
BOUNDS = {
    "peak_flops": (1e9, 1e18),
    "peak_flops_f32": (0.0, 1e18),
    "memory_bytes": (2**20, 1e15),
    "hbm_bandwidth": (1e6, 1e15),
    "gpus_per_node": (1, 4096),
    "intra_node_bandwidth": (1e6, 1e15),
    "inter_node_bandwidth": (1e6, 1e15),
    "intra_node_latency": (1e-9, 1.0),
    "inter_node_latency": (1e-9, 1.0),
}
COUNTS = ("gpus_per_node",)


def _checked_number(where: str, key: str, value) -> float | int:
    low, high = BOUNDS[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise UserError(f"{where} must be a finite number, got {value!r}")
    if key in COUNTS and value != int(value):
        raise UserError(f"{where} counts whole GPUs, got {value!r}")
    if not low <= value <= high:
        raise UserError(
            f"{where} = {value:g} is outside {low:g}..{high:g}, the range of any real accelerator "
            "(bytes, bytes/s, FLOP/s and seconds, as in the built-in tables)"
        )
    return int(value) if key in COUNTS else float(value)


def pick_hardware(name_or_path: str) -> Hardware:
    """One accelerator: a built-in name, or a TOML file of one table (or `file.toml:name`)."""
    path, _, which = name_or_path.partition(".toml:")
    table = load_hardware(path + ".toml" if which else name_or_path)
    if which:
        if which not in table:
            raise UserError(f"{path}.toml has no [{which}]; it has {', '.join(table)}")
        return table[which]
    if len(table) != 1:
        raise UserError(
            f"{name_or_path} describes {len(table)} accelerators ({', '.join(table)}): pick one "
            f"with {name_or_path}:NAME"
        )
    return next(iter(table.values()))


def for_device(device_kind: str) -> Hardware | None:
    """The built-in accelerator jax's device_kind names ("NVIDIA H100 80GB HBM3" -> h100-80g),
    by whole words: an A100 is not an A10, an L40S not an L4, and an A10G none of them."""
    return next(
        (
            h
            for h in BUILTIN.values()
            if any(re.search(rf"\b{re.escape(k)}\b", device_kind, re.I) for k in h.device_kinds)
        ),
        None,
    )
