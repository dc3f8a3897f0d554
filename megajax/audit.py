"""Collective audit: compile a train step, read its HLO, and account for every collective.

Megatron's claim is that a tensor-parallel transformer layer needs exactly two all-reduces
over the model axis in the forward pass and two in the backward pass. `audit()` checks it
from the program XLA actually compiled: it lists each collective with its kind, the mesh
axis its device groups span, shape, bytes, forward/backward, and where in the model it
comes from (layer, attention/MLP, embedding, logits, loss, optimizer), multiplying ops
inside loops (the scanned layer stack, gradient accumulation) by their trip counts.
"""
from __future__ import annotations

import dataclasses
import math
import re
from collections import Counter, defaultdict

import numpy as np

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
               "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
               "f8e4m3fn": 1, "f8e5m2": 1}

_COMP = re.compile(r"^(?:ENTRY )?%(\S+) .*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT )?%(\S+) = (.*?) ([a-z][a-z0-9-]*)\((.*)$")
_ARRAY = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]")
_OPNAME = re.compile(r'op_name="([^"]*)"')
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_BODY = re.compile(r"\bbody=%([^\s,]+)")
_CALLS = re.compile(r"\b(?:calls|to_apply|branch_computations|true_computation|false_computation)=\{?%([^\s,}]+)")
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
    Shardy's mesh form mesh['axis_0'=2,'axis_1'=4] {'axis_1'} (optionally with device_ids=(...)),
    and collective-permute's source_target_pairs."""
    m = re.search(r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\((.*?)\))? \{([^}]*)\}", line)
    if m:
        axes = [(a.split("=")[0].strip("' "), int(a.split("=")[1])) for a in m.group(1).split(",")]
        names, sizes = [a for a, _ in axes], [s for _, s in axes]
        ids = _device_list(m.group(2)) if m.group(2) else np.arange(math.prod(sizes))
        ids = ids.reshape(sizes)
        reduced = [names.index(a.strip("' ")) for a in m.group(3).split(",") if a.strip()]
        kept = [i for i in range(len(names)) if i not in reduced]
        ids = ids.transpose(kept + reduced).reshape(-1, math.prod(sizes[i] for i in reduced) if reduced else 1)
        return ids.tolist()
    m = re.search(r"replica_groups=(\[[\d,]+\]<=\[[\d,]+\](?:T\([\d,]+\))?)", line)
    if m:
        ids = _iota(m.group(1))
        return ids.reshape(-1, ids.shape[-1]).tolist()
    m = re.search(r"(?:replica_groups|source_target_pairs)=\{((?:\{[\d,]*\},?)*)\}", line)
    if m:
        groups = [[int(x) for x in g.split(",") if x] for g in re.findall(r"\{([\d,]*)\}", m.group(1))]
        if "source_target_pairs" in line[:m.start() + 25]:
            return groups
        return groups or [list(range(num_devices))]
    return [list(range(num_devices))]


def groups_axis(groups, mesh_shape: tuple[int, int], axis_names=("data", "model")) -> str:
    """Which mesh axes the groups span: 'model', 'data', 'data+model' or 'none'."""
    coords = lambda d: np.unravel_index(d, mesh_shape)  # noqa: E731
    varying = set()
    for g in groups:
        c = np.array([coords(d) for d in g])
        for ax in range(len(mesh_shape)):
            if len(set(c[:, ax])) > 1:
                varying.add(axis_names[ax])
    return "+".join(a for a in axis_names if a in varying) or "none"


# --- HLO walking ------------------------------------------------------------------------

@dataclasses.dataclass
class Collective:
    kind: str              # all-reduce, all-gather, reduce-scatter, all-to-all, collective-permute
    axis: str              # model, data, data+model, none
    dtype: str
    shape: tuple[int, ...]
    count: int             # executions per step (loop trip counts multiplied in)
    direction: str         # forward, backward, optimizer
    origin: str            # embedding, logits, loss, attention, mlp, gradients, optimizer, other
    layer: str             # "0", "1", ... ; "all" for the scanned stack; "" outside layers
    op_name: str
    hlo_name: str

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


def _multiplicities(comps) -> dict[str, int]:
    """How many times each computation runs per step (while bodies times their trip count)."""
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
    if "rematted_computation" in op_name:
        direction = "recompute"
    else:
        direction = "backward" if "transpose(" in op_name else "forward"
    origin = "other"
    for key in ("attention", "mlp", "embedding", "logits", "loss"):
        if key in op_name:
            origin = key
            break
    if axis == "data" and direction == "backward":
        origin = "gradients"
    return direction, origin, layer


def parse_collectives(hlo: str, mesh_shape: tuple[int, int]) -> list[Collective]:
    comps = _split_computations(hlo)
    mult = _multiplicities(comps)
    num_devices = math.prod(mesh_shape)
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
            arrays = [(d, tuple(int(x) for x in dims.split(",") if x)) for d, dims in _ARRAY.findall(shape_str)]
            if opcode == "all-gather-start":
                arrays = arrays[len(arrays) // 2:]
            elif opcode == "collective-permute-start":
                arrays = arrays[:1]
            groups = parse_replica_groups(line, num_devices)
            axis = groups_axis(groups, mesh_shape)
            op = _OPNAME.search(line)
            combined = op.group(1) if op else ""
            for i, (dtype, shape) in enumerate(arrays):
                op_name = gte_names.get((name, i), combined) if len(arrays) > 1 else combined
                direction, origin, layer = _classify(op_name, axis)
                out.append(Collective(kind, axis, dtype, shape, mult[comp], direction, origin, layer,
                                      op_name, name if len(arrays) == 1 else f"{name}[{i}]"))
    return out


# --- the audit --------------------------------------------------------------------------

@dataclasses.dataclass
class AuditResult:
    collectives: list[Collective]
    num_layers: int
    mesh_shape: tuple[int, int]
    batch_local: int          # rows per data shard per microbatch
    seq_len: int
    hidden: int
    microbatches: int
    scanned: bool
    remat: bool
    head_rows: int = 0        # positions per sequence through the tied output layer and loss (GPT: seq_len)

    def select(self, **kw) -> list[Collective]:
        return [c for c in self.collectives if all(getattr(c, k) == v for k, v in kw.items())]

    def model_axis_layer_counts(self) -> dict[str, Counter]:
        """{layer: Counter((origin, direction) -> executions per microbatch)} of model-axis all-reduces."""
        per = defaultdict(Counter)
        for c in self.select(kind="all-reduce", axis="model"):
            if c.origin in ("attention", "mlp"):
                if c.layer == "all":  # one scanned body, executed once per layer
                    for i in range(self.num_layers):
                        per[str(i)][(c.origin, c.direction)] += c.count // (self.num_layers * self.microbatches)
                else:
                    per[c.layer][(c.origin, c.direction)] += c.count // self.microbatches
        return dict(per)

    @property
    def analytic_min_elements(self) -> int:
        """Megatron's minimum per step and device: 4 L b s h for the layers, the embedding's forward
        all-reduce (b s h), and for the r positions per sequence that reach the tied output layer
        (GPT: all s; BERT: the masked ones; fine-tuning: none) its backward all-reduce (b r h)
        and the fused loss (3 b r). Without remat; remat adds the recomputed forward on top."""
        bsh = self.batch_local * self.seq_len * self.hidden
        br = self.batch_local * self.head_rows
        return self.microbatches * (4 * self.num_layers * bsh + bsh + br * self.hidden + 3 * br)

    @property
    def model_axis_elements(self) -> int:
        return sum(c.elements * c.count for c in self.collectives if "model" in c.axis)

    @property
    def ratio(self) -> float:
        return self.model_axis_elements / self.analytic_min_elements if self.mesh_shape[1] > 1 else 0.0

    def summary(self) -> dict:
        by = Counter()
        for c in self.collectives:
            by[(c.kind, c.axis, c.origin, c.direction)] += c.count
        return {
            "mesh": {"data": self.mesh_shape[0], "model": self.mesh_shape[1]},
            "per_layer_model_all_reduces": {k: {f"{o}/{d}": n for (o, d), n in v.items()}
                                            for k, v in sorted(self.model_axis_layer_counts().items(),
                                                               key=lambda kv: int(kv[0]))},
            "counts": {"/".join(k): n for k, n in sorted(by.items())},
            "model_axis_elements": self.model_axis_elements,
            "analytic_min_elements": self.analytic_min_elements,
            "ratio_to_megatron_min": round(self.ratio, 4),
            "non_all_reduce_on_model_axis": sum(c.count for c in self.collectives
                                                if "model" in c.axis and c.kind != "all-reduce"),
        }

    def table(self) -> str:
        """One row per activation collective; gradient and optimizer tensors summed per layer."""
        rows, grouped = [], {}
        for c in sorted(self.collectives, key=_order):
            if c.origin in ("gradients", "optimizer"):
                key = (c.kind, c.axis, c.direction, c.origin, c.layer or "-")
                n, el, by, cnt = grouped.get(key, (0, 0, 0, c.count))
                grouped[key] = (n + 1, el + c.elements, by + c.bytes, cnt)
                continue
            rows.append((c.kind, c.axis, c.direction, c.origin, c.layer or "-",
                         f"{c.dtype}{list(c.shape)}", f"{c.elements:,}", f"{c.bytes:,}", f"x{c.count}"))
        for key, (n, el, by, cnt) in grouped.items():
            rows.append(key + (f"{n} tensors", f"{el:,}", f"{by:,}", f"x{cnt}"))
        head = ("kind", "axis", "pass", "origin", "layer", "shape", "elements", "bytes", "count")
        widths = [max(len(str(r[i])) for r in rows + [head]) for i in range(len(head))]
        fmt = lambda r: "  ".join(str(v).ljust(w) for v, w in zip(r, widths))  # noqa: E731
        lines = [fmt(head), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows]
        per = self.model_axis_layer_counts()
        count = lambda d: sorted({sum(n for (o, dd), n in c.items() if dd == d) for c in per.values()})  # noqa: E731
        recompute = f", recomputed by remat {count('recompute')}" if self.remat else ""
        lines += ["",
                  f"model-axis all-reduces per layer{' and microbatch' if self.microbatches > 1 else ''}: forward {count('forward')}, backward {count('backward')}"
                  f"{recompute} ({self.num_layers} layers{', scanned' if self.scanned else ''})",
                  f"model-axis elements per step and device: {self.model_axis_elements:,} "
                  f"= {self.ratio:.3f} x Megatron's analytic minimum {self.analytic_min_elements:,}"]
        if self.remat:
            extra = self.microbatches * self.num_layers * self.batch_local * self.seq_len * self.hidden
            lines.append(f"with remat's one recomputed all-reduce per layer ({extra:,} elements) the minimum is "
                         f"{self.analytic_min_elements + extra:,}: ratio "
                         f"{self.model_axis_elements / (self.analytic_min_elements + extra):.3f}")
        return "\n".join(lines)

    def print(self):
        print(self.table())


def _order(c: Collective):
    """Program order: embedding, layers, logits, loss forward; the reverse backward; then the rest."""
    stage = {"embedding": 0, "attention": 1, "mlp": 1, "logits": 2, "loss": 3}.get(c.origin, 4)
    layer = -1 if c.layer in ("", "all") else int(c.layer)
    within = 0 if c.origin == "attention" else 1
    pass_rank = {"forward": 0, "recompute": 1, "backward": 1}.get(c.direction, 2)
    if pass_rank == 1:
        stage, layer, within = -stage, -layer, -within
    return (pass_rank, c.axis != "model", c.origin in ("gradients", "optimizer"), stage, layer, within, c.hlo_name)


def audit(cfg, mesh, verbose: bool = False) -> AuditResult:
    """Compile `cfg`'s train step on `mesh` (abstractly: no weights allocated) and audit it."""
    from megajax.train_step import make_trainer

    trainer = make_trainer(cfg, mesh)
    hlo = trainer.lower_step().compile().as_text()
    return audit_hlo(hlo, cfg, (mesh.shape["data"], mesh.shape["model"]), verbose=verbose)


def audit_hlo(hlo: str, cfg, mesh_shape, verbose: bool = False) -> AuditResult:
    from megajax.bert import mlm_predictions

    m, t = cfg.model, cfg.train
    # sequences per data shard and microbatch (each RACE option is a sequence of its own)
    rows = t.batch_size // t.microbatches // mesh_shape[0] * (m.tokens_per_example // m.seq_len)
    if m.kind == "gpt":
        head_rows = m.seq_len
    elif m.task == "pretrain":
        head_rows = mlm_predictions(m.seq_len, cfg.data.mask_prob)
    else:
        head_rows = 0
    result = AuditResult(parse_collectives(hlo, tuple(mesh_shape)), m.num_layers, tuple(mesh_shape),
                         rows, m.seq_len, m.hidden, t.microbatches, m.scan_layers, m.remat, head_rows)
    if verbose:
        result.print()
    return result
