"""Reading collectives out of a compiled program's HLO text: pure text processing.

Each collective gets its kind, the mesh axis its device groups span, shape, bytes,
forward/backward, and where in the model it comes from (layer, attention/MLP, embedding,
logits, loss, optimizer), from the JAX name stack XLA keeps in op metadata; ops inside loops
(the scanned layer stack, gradient accumulation) are multiplied by their trip counts.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import defaultdict

import numpy as np

from megajax.core.sharding import DATA, EXPERT, MODEL
from megajax.mesh_shape import MeshShape

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
DTYPE_BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "c64": 8,
    "c128": 16,
    "f8e4m3fn": 1,
    "f8e5m2": 1,
}

_COMP = re.compile(r"^(?:ENTRY )?%(\S+) .*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT )?%(\S+) = (.*?) ([a-z][a-z0-9-]*)\((.*)$")
_ARRAY = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]")
_OPNAME = re.compile(r'op_name="([^"]*)"')
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_BODY = re.compile(r"\bbody=%([^\s,]+)")
_CALLS = re.compile(
    r"\b(?:calls|to_apply|branch_computations|true_computation|false_computation)=\{?%([^\s,}]+)"
)
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_GTE = re.compile(r"get-tuple-element\(%([^)\s]+)\), index=(\d+)")


# --- replica groups ---------------------------------------------------------------------


def _iota(spec: str) -> np.ndarray:
    """'[2,4]<=[8]' / '[4,2]<=[2,4]T(1,0)' -> the device-id array they describe."""
    m = re.fullmatch(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", spec.strip())
    if not m:
        raise ValueError(f"cannot parse iota replica groups '{spec}'")
    shape = [int(x) for x in m.group(1).split(",")]
    base = [int(x) for x in m.group(2).split(",")]
    ids = np.arange(math.prod(base)).reshape(base)
    if m.group(3):
        ids = ids.transpose([int(x) for x in m.group(3).split(",")])
    return ids.reshape(shape)


def _device_list(spec: str) -> np.ndarray:
    """device_ids=(...) of the mesh form: an iota like '[2,4]T(1,0)' or a plain list."""
    spec = spec.strip()
    if spec.startswith("["):
        m = re.fullmatch(r"\[([\d,]+)\](?:T\(([\d,]+)\))?", spec)
        base = [int(x) for x in m.group(1).split(",")]
        ids = np.arange(math.prod(base)).reshape(base)
        if m.group(2):
            ids = ids.transpose([int(x) for x in m.group(2).split(",")])
        return ids.reshape(-1)
    return np.array([int(x) for x in spec.split(",")])


def parse_replica_groups(line: str, num_devices: int) -> list[list[int]]:
    """Device groups of a collective, from any HLO spelling:
    explicit lists {{0,1,2,3},{4,5,6,7}}, iota forms [2,4]<=[8] or [4,2]<=[2,4]T(1,0),
    Shardy's mesh form mesh['axis_0'=2,'axis_1'=4] {'axis_1'} (optionally with device_ids=(...);
    a sub-axis 'axis_1':(2)2 is the part of size 2 after a major part of 2), and
    collective-permute's source_target_pairs."""
    m = re.search(r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\((.*?)\))? \{([^}]*)\}", line)
    if m:
        return _mesh_groups(m.group(1), m.group(2), m.group(3))
    m = re.search(r"replica_groups=(\[[\d,]+\]<=\[[\d,]+\](?:T\([\d,]+\))?)", line)
    if m:
        ids = _iota(m.group(1))
        return ids.reshape(-1, ids.shape[-1]).tolist()
    m = re.search(r"(?:replica_groups|source_target_pairs)=\{((?:\{[\d,]*\},?)*)\}", line)
    if m:
        groups = [
            [int(x) for x in g.split(",") if x] for g in re.findall(r"\{([\d,]*)\}", m.group(1))
        ]
        if "source_target_pairs" in line[: m.start() + 25]:
            return groups
        return groups or [list(range(num_devices))]
    return [list(range(num_devices))]


def _mesh_groups(axes_text: str, device_ids: str | None, reduced_text: str) -> list[list[int]]:
    """Shardy's mesh form: every axis split into (major, sub-axis, minor) where a reduced
    sub-axis names a part of it, the reduced parts moved last, one group per the rest."""
    axes = [(a.split("=")[0].strip("' "), int(a.split("=")[1])) for a in axes_text.split(",")]
    ids = _device_list(device_ids) if device_ids else np.arange(math.prod(n for _, n in axes))
    parts = {}  # axis name -> (major size, reduced size), a whole axis being (1, its size)
    for token in (t.strip() for t in reduced_text.split(",") if t.strip()):
        sub = re.fullmatch(r"'?([^':]+)'?(?::\((\d+)\)(\d+))?", token)
        name = sub.group(1)
        size = dict(axes)[name]
        parts[name] = (int(sub.group(2)), int(sub.group(3))) if sub.group(2) else (1, size)
    shape, reduced = [], []
    for name, size in axes:
        major, part = parts.get(name, (size, 1))
        if name in parts:
            reduced.append(len(shape) + 1)
        shape += [major, part, size // (major * part)]
    ids = ids.reshape(shape)
    kept = [i for i in range(len(shape)) if i not in reduced]
    return (
        ids.transpose(kept + reduced)
        .reshape(-1, math.prod(shape[i] for i in reduced) if reduced else 1)
        .tolist()
    )


def groups_axis(groups, mesh: MeshShape) -> str:
    """Which mesh axes the groups span: 'model', 'data', 'data+model', 'pipe', ... or 'none'."""
    coords = lambda d: np.unravel_index(d, mesh.dims)  # noqa: E731
    varying = set()
    for g in groups:
        c = np.array([coords(d) for d in g])
        for ax, name in enumerate(mesh.axis_names):
            if len(set(c[:, ax])) > 1:
                varying.add(name)
    return "+".join(a for a in mesh.axis_names if a in varying) or "none"


# --- HLO walking ------------------------------------------------------------------------


@dataclasses.dataclass
class Collective:
    kind: str  # all-reduce, all-gather, reduce-scatter, all-to-all, collective-permute
    axis: str  # model, data, data+model, none
    dtype: str
    shape: tuple[int, ...]
    count: int  # executions per step (loop trip counts multiplied in)
    # forward, backward, recompute, optimizer, update (ZeRO's gather of the new weights)
    direction: str
    # embedding, logits, loss, attention, mlp, gradients, params, metrics, optimizer, other
    origin: str
    layer: str  # "0", "1", ... ; "all" for the scanned stack; "" outside layers
    op_name: str
    hlo_name: str
    pairs: int = 0  # a collective-permute's (source, target) device pairs

    @property
    def elements(self) -> int:
        return math.prod(self.shape)

    @property
    def bytes(self) -> int:
        return self.elements * DTYPE_BYTES.get(self.dtype, 4)


def _split_computations(hlo: str) -> dict[str, list[str]]:
    comps, cur = {}, None
    for line in hlo.splitlines():
        m = _COMP.match(line)
        if m:
            cur = m.group(1)
            comps[cur] = []
            if line.startswith("ENTRY"):
                comps["__entry__"] = cur
        elif cur is not None and line.strip() != "}":
            comps[cur].append(line)
    return comps


def _multiplicities(comps, switch: dict | None = None) -> dict[str, int]:
    """How many times each computation runs per step (while bodies times their trip count).

    A conditional counts its first branch (where a program has them, they are rare paths);
    the pipeline's switches (megajax/training/pipeline.py) count each branch as often as the
    schedule runs it: `switch` maps each switch's name scope to (the tick loop's trips, per
    branch the table's entries that run it; for a stage's action summed over the stages)."""
    scopes = sorted(switch or {}, key=len, reverse=True)  # "pipeline_send_back" first
    mult = defaultdict(int)
    entry = comps.get("__entry__")
    stack = [(entry, 1)]
    while stack:
        name, n = stack.pop()
        mult[name] += n
        for line in comps.get(name, []):
            body = _BODY.search(line)
            if body and " while(" in line:
                trip = _TRIP.search(line)
                stack.append((body.group(1), n * (int(trip.group(1)) if trip else 1)))
            branches = _BRANCHES.search(line)
            scope = branches and next((sc for sc in scopes if sc in line), None)
            if scope:
                ticks, runs = switch[scope]
                names = re.findall(r"%([^\s,}]+)", branches.group(1))
                stack += [(b, n * k // ticks) for b, k in zip(names, runs) if k]
                continue
            for callee in _CALLS.findall(line):
                if callee in comps and callee != name:
                    stack.append((callee, n))
    return mult


def _classify(op_name: str, axis: str):
    """(direction, origin, layer) from the JAX name stack that XLA keeps in op metadata.

    Backward ops sit under transpose(...); forward ops that remat recomputes in the backward
    pass sit under checkpoint/rematted_computation.
    """
    layer = ""
    m = re.search(r"layer_(\d+)", op_name)
    if m:
        layer = m.group(1)
    elif "(layers)" in op_name or "/layers/" in op_name:
        layer = "all"
    if "optimizer" in op_name:
        return "optimizer", "optimizer", layer
    # The data-manual step of ZeRO / FSDP (megajax/training/data_parallel.py) names its own.
    if "gradients_reduce_scatter" in op_name or "gradients_all_reduce" in op_name:
        return "backward", "gradients", layer
    if "params_all_gather" in op_name:
        return "update", "params", layer
    if "metrics_all_reduce" in op_name:
        return "forward", "metrics", layer
    if "rematted_computation" in op_name or (
        "pipeline_recompute" in op_name and "transpose(" not in op_name
    ):
        direction = "recompute"
    else:
        direction = "backward" if "transpose(" in op_name else "forward"
    if "fsdp_all_gather" in op_name and direction != "backward":
        return direction, "params", layer
    if "lora_gradient" in op_name and direction == "backward":  # core/lora.py: per_device
        return direction, "adapter_gradients", layer
    if "kv_copies_gradient" in op_name:  # grouped-query attention's copied key/value weights
        return direction, "gradients", layer
    origin = "other"
    for key in ("attention", "mlp", "embedding", "logits", "loss"):
        if key in op_name:
            origin = key
            break
    # over "data", or on an expert mesh over "expert" too (a data axis for all but the experts,
    # whose own all-to-alls are the only other collectives there)
    data_parallel = axis in (DATA, f"{DATA}+{EXPERT}") or (
        axis == EXPERT and "all_to_all" not in op_name
    )
    if data_parallel and direction == "backward":
        origin = "gradients"
    return direction, origin, layer


def parse_collectives(hlo: str, mesh: MeshShape, switch: dict | None = None) -> list[Collective]:
    """Every collective of a compiled program, on a (data, model) or (pipe, data, model) mesh
    (a pipelined step's `switch`: see _multiplicities)."""
    comps = _split_computations(hlo)
    mult = _multiplicities(comps, switch)
    num_devices = mesh.devices
    gte_names = {}
    for lines in comps.values():
        if isinstance(lines, str):
            continue
        for line in lines:
            g = _GTE.search(line)
            if g and (op := _OPNAME.search(line)):
                gte_names[(g.group(1), int(g.group(2)))] = op.group(1)
    out = []
    for comp, lines in comps.items():
        if isinstance(lines, str) or mult.get(comp, 0) == 0:
            continue
        for line in lines:
            m = _INSTR.match(line)
            if not m:
                continue
            name, shape_str, opcode = m.group(1), m.group(2), m.group(3)
            kind = opcode.removesuffix("-start")
            if kind not in KINDS:
                continue
            arrays = [
                (d, tuple(int(x) for x in dims.split(",") if x))
                for d, dims in _ARRAY.findall(shape_str)
            ]
            if opcode == "all-gather-start":
                arrays = arrays[len(arrays) // 2 :]
            elif opcode == "collective-permute-start":
                arrays = arrays[:1]
            elif kind == "all-to-all" and len(set(arrays)) == 1 and len(arrays) > 1:
                # one all-to-all of a buffer, in its tuple form: a chunk for each peer
                arrays = [(arrays[0][0], (len(arrays), *arrays[0][1]))]
            groups = parse_replica_groups(line, num_devices)
            axis = groups_axis(groups, mesh)
            op = _OPNAME.search(line)
            combined = op.group(1) if op else ""
            for i, (dtype, shape) in enumerate(arrays):
                op_name = gte_names.get((name, i), combined) if len(arrays) > 1 else combined
                direction, origin, layer = _classify(op_name, axis)
                out.append(
                    Collective(
                        kind,
                        axis,
                        dtype,
                        shape,
                        mult[comp],
                        direction,
                        origin,
                        layer,
                        op_name,
                        name if len(arrays) == 1 else f"{name}[{i}]",
                        len(groups) if kind == "collective-permute" else 0,
                    )
                )
    return out


def runs_of_scope(hlo: str, scope: str) -> int:
    """How many times per step the conditional under `scope` (a name scope) runs: its loop's trip
    count, as the compiled program has it (the pipeline's tick loop, for "pipeline_stage")."""
    comps = _split_computations(hlo)
    mult = _multiplicities(comps)
    for name, lines in comps.items():
        if not isinstance(lines, str) and any(_BRANCHES.search(x) and scope in x for x in lines):
            return mult.get(name, 0)
    return 0


def program_order(c: Collective):
    """Program order: embedding, layers, logits, loss forward; the reverse backward; then the
    rest."""
    stage = {"embedding": 0, "attention": 1, "mlp": 1, "logits": 2, "loss": 3}.get(c.origin, 4)
    layer = -1 if c.layer in ("", "all") else int(c.layer)
    within = 0 if c.origin == "attention" else 1
    pass_rank = {"forward": 0, "recompute": 1, "backward": 1}.get(c.direction, 2)
    if pass_rank == 1:
        stage, layer, within = -stage, -layer, -within
    return (
        pass_rank,
        c.axis != MODEL,
        c.origin in ("gradients", "params", "metrics", "optimizer"),
        stage,
        layer,
        within,
        c.hlo_name,
    )
