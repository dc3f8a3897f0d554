"""Where a traced step's time went, by kind of operation: matmuls, attention, element-wise,
collectives, optimizer. Reads the trace jax.profiler wrote (train.py --profile, bench/
step_mfu.py --profile) and, to know what each op is, the compiled step's HLO text saved beside it:
its instructions' opcodes, the computations a fusion calls, and the JAX name scopes XLA keeps in
op metadata ("optimizer", "attention_core")."""

from __future__ import annotations

import collections
import gzip
import json
import re
from pathlib import Path

from megajax.tools.hlo import _CALLS, _COMP, _INSTR, _OPNAME
from megajax.tools.hlo import KINDS as COLLECTIVES

KINDS = ("matmuls", "attention", "element-wise", "collectives", "optimizer")
MATMUL_OPS = ("dot", "convolution")
_NUMBERED = re.compile(r"\.\d+$")
# events of the runtime itself, not of the program's ops
_RUNTIME = ("$", "end: ", "ThunkExecutor", "SlinkyThreadPool", "PjitFunction", "CommonPjRt")


def op_kinds(hlo_text: str) -> dict[str, str]:
    """{instruction name: kind} of every instruction in a compiled module."""
    bodies, current = collections.defaultdict(list), None
    for line in hlo_text.splitlines():
        comp = _COMP.match(line)
        if comp:
            current = comp.group(1)
        elif (instr := _INSTR.match(line)) and current is not None:
            bodies[current].append((instr.group(1), instr.group(3), line))

    def has_matmul(comp: str, seen=()) -> bool:
        for _, opcode, line in bodies.get(comp, ()):
            if opcode in MATMUL_OPS or "gemm" in line or "matmul" in line.lower():
                return True
            if any(c not in seen and has_matmul(c, seen + (comp,)) for c in _CALLS.findall(line)):
                return True
        return False

    kinds = {}
    for instrs in bodies.values():
        for name, opcode, line in instrs:
            scope = (_OPNAME.search(line) or [None, ""])[1]
            if opcode.removesuffix("-start").removesuffix("-done") in COLLECTIVES:
                kinds[name] = "collectives"
            elif "optimizer" in scope:
                kinds[name] = "optimizer"
            elif "attention_core" in scope:
                kinds[name] = "attention"
            elif (
                opcode in MATMUL_OPS
                or any(has_matmul(c) for c in _CALLS.findall(line))
                or "gemm" in line
            ):
                kinds[name] = "matmuls"
            else:
                kinds[name] = "element-wise"
    return kinds


def guess_kind(name: str) -> str:
    """An op with no HLO text to look it up in, by its name alone."""
    low = name.lower()
    if any(c in low for c in COLLECTIVES) or "nccl" in low:
        return "collectives"
    if any(w in low for w in ("dot", "gemm", "matmul", "conv", "ynn_fusion")):
        return "matmuls"
    if any(w in low for w in ("flash", "fmha", "attention")):
        return "attention"
    return "element-wise"


def newest(directory: Path, pattern: str) -> Path:
    return max(Path(directory).rglob(pattern), key=lambda f: f.stat().st_mtime)


def op_seconds(trace: Path, module: str | None = None) -> dict[str, float]:
    """Seconds per op name (the HLO instruction, or the kernel's hlo_op on a GPU) in a
    jax.profiler trace, only `module`'s ops if given. Ops on different threads overlap, so
    they add up to more than the wall time."""
    data = json.load(gzip.open(trace))
    events = data["traceEvents"] if isinstance(data, dict) else data
    seconds = collections.Counter()
    for e in events:
        name, args = e.get("name", ""), e.get("args") or {}
        if e.get("ph") != "X" or name.startswith(_RUNTIME):
            continue
        if "hlo_module" not in args and "hlo_op" not in args:
            continue  # host-side Python and runtime work, not a compiled op
        if module and args.get("hlo_module", module) != module:
            continue
        seconds[args.get("hlo_op", name)] += e.get("dur", 0) / 1e6
    return dict(seconds)


def time_by_kind(profile_dir: Path) -> dict[str, float]:
    """Seconds per kind (KINDS) over the traced steps in `profile_dir` (one jax.profiler run's
    directory; with --profile, RunResult.profile)."""
    hlo = Path(profile_dir) / "step.hlo.txt"
    text = hlo.read_text(encoding="utf-8") if hlo.is_file() else ""
    module = re.search(r"^HloModule (\S+?),", text, re.M)
    kinds = op_kinds(text)
    totals = dict.fromkeys(KINDS, 0.0)
    for name, s in op_seconds(
        newest(profile_dir, "*.trace.json.gz"), module.group(1) if module else None
    ).items():
        kind = kinds.get(name) or kinds.get(_NUMBERED.sub("", name))
        if kind is None and kinds:
            continue  # not an instruction of the step (the runtime's own work)
        totals[kind or guess_kind(name)] += s
    return totals


def by_kind_line(totals: dict[str, float], steps: int = 1) -> str:
    total = sum(totals.values()) or 1.0
    return ", ".join(
        f"{k} {v / steps * 1000:.1f} ms ({100 * v / total:.0f}%)"
        for k, v in sorted(totals.items(), key=lambda kv: -kv[1])
    )
