#!/usr/bin/env python
"""The step's figures at a base commit and at this checkout, measured in turn, into the record.

    python bench/record.py --base COMMIT [--rounds 3] [--reps 3] [--write] [--note TEXT]
    python bench/record.py --commits A,B,C,WORKTREE [--rounds 3] [--reps 3]

Each commit's code is exported (`git archive`) into a directory of its own and runs its own
`bench/step_mfu.py` there (float32, one CPU device: the 8-layer, hidden 512, seq 512 GPT of
docs/performance.md), with this interpreter; WORKTREE is this checkout as it is, uncommitted
changes included. The commits run in turn, round after round (A, B, A, B, ...), so that each
sees the same minutes of a shared machine, and each figure is the median over the rounds:

    scanned MFU, unrolled MFU   the train step's model FLOP/s over the float32 matmul peak the
                                same run measures
    scanned / unrolled          the two MFUs' ratio (the same FLOPs: their step times')
    backward / forward          of the scanned stack (2.0 is the matmuls' ideal)
    Llama / GPT                 the Llama shape's MFU over the GPT shape's (scanned; commits
                                before the Llama family print none)

It prints a table; `--write` appends its rows, with the date, the CPU model and the jax
version, to the record table at the end of docs/performance.md. A change to megajax/core,
models or training records its figures against its base before it is called done.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RECORD = ROOT / "docs" / "performance.md"
MARKER = "<!-- bench/record.py appends its rows below this line -->"
WORKTREE = "WORKTREE"
FIGURES = ("scanned MFU", "unrolled MFU", "scanned / unrolled", "backward / forward", "Llama / GPT")


def export(commit: str, into: Path) -> Path:
    """The commit's tree in a directory of its own (WORKTREE: this checkout)."""
    if commit == WORKTREE:
        return ROOT
    where = into / commit
    where.mkdir(parents=True)
    archive = subprocess.run(
        ["git", "archive", commit], cwd=ROOT, capture_output=True, check=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(where)], input=archive, check=True)
    return where


def bench_args(tree: Path) -> list[str]:
    """float32 only, and the options that skip what the record does not read, where that
    commit's bench has them."""
    usage = subprocess.run(
        [sys.executable, "bench/step_mfu.py", "--help"],
        cwd=tree,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    args = ["--dtypes", "float32"]
    if "--rounds" in usage:
        args += ["--rounds", "0"]
    if "--compile-layers" in usage:
        args += ["--compile-layers", ""]
    return args


def figures(out: str) -> dict[str, float]:
    """The record's figures from one bench/step_mfu.py output."""

    def block(stack: str) -> str:
        found = re.search(rf"^float32, {stack} stack:.*?(?=^\S|\Z)", out, re.M | re.S)
        if not found:
            raise SystemExit(f"bench/step_mfu.py printed no float32 {stack} stack:\n{out[-2000:]}")
        return found.group(0)

    scanned, unrolled = block("scanned"), block("unrolled")
    mfu = {name: float(re.search(r"MFU ([\d.]+)", b).group(1)) for name, b in
           (("scanned", scanned), ("unrolled", unrolled))}  # fmt: skip
    row = {
        "scanned MFU": mfu["scanned"],
        "unrolled MFU": mfu["unrolled"],
        "scanned / unrolled": mfu["scanned"] / mfu["unrolled"] if mfu["unrolled"] else math.nan,
        "backward / forward": float(re.search(r"backward/forward ([\d.]+)", scanned).group(1)),
    }
    llama = re.search(r"Llama / GPT MFU, each timed alone: ([\d.]+)", out)
    if llama:
        row["Llama / GPT"] = float(llama.group(1))
    return row


def run_bench(tree: Path, args: list[str]) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run(
        [sys.executable, "bench/step_mfu.py", *args],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
    )
    if done.returncode:
        raise SystemExit(f"bench/step_mfu.py failed in {tree}:\n{done.stderr[-3000:]}")
    return figures(done.stdout)


def cpu_model() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    name = re.search(r"^model name\s*:\s*(.+)$", text, re.M)
    return f"{name.group(1).strip() if name else platform.machine()}, {os.cpu_count()} cores"


def short(commit: str) -> str:
    if commit == WORKTREE:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD"], cwd=ROOT).returncode
        return f"{head}{'+' if dirty else ''}"
    return subprocess.run(
        ["git", "rev-parse", "--short", commit],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()


def table_rows(medians: dict, rounds: int, note: str) -> list[str]:
    import jax

    day = datetime.date.today().isoformat()
    rows = []
    for commit, row in medians.items():
        cells = [f"{row[f]:.3f}" if f in row else "n/a" for f in FIGURES]
        rows.append(
            f"| {day} | {short(commit)} | {cpu_model()} | jax {jax.__version__} | {rounds} | "
            + " | ".join(cells)
            + f" | {note} |"
        )
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--base", help="the commit to compare this checkout with")
    which.add_argument("--commits", help=f"commits to run in turn (comma-separated; {WORKTREE})")
    p.add_argument("--rounds", type=int, default=3, help="runs of each commit, in turn")
    p.add_argument("--reps", type=int, default=3, help="step_mfu's timed calls (best of)")
    p.add_argument("--write", action="store_true", help="append the rows to docs/performance.md")
    p.add_argument("--note", default="", help="the row's note (what changed)")
    a = p.parse_args()
    if a.rounds < 1:
        p.error(f"--rounds must be 1 or more, got {a.rounds}")
    commits = [a.base, WORKTREE] if a.base else a.commits.split(",")
    with tempfile.TemporaryDirectory(prefix="megajax-record-") as tmp:
        trees = {c: export(c, Path(tmp)) for c in commits}
        args = {c: [*bench_args(t), "--reps", str(a.reps)] for c, t in trees.items()}
        runs = {c: [] for c in commits}
        for r in range(a.rounds):
            for c in commits:
                runs[c].append(run_bench(trees[c], args[c]))
                print(f"round {r + 1}, {short(c)}: {runs[c][-1]}", flush=True)
    medians = {
        c: {f: statistics.median(x[f] for x in rs) for f in FIGURES if all(f in x for x in rs)}
        for c, rs in runs.items()
    }
    rows = table_rows(medians, a.rounds, a.note)
    print("\n".join(rows))
    if a.write:
        text = RECORD.read_text()
        if MARKER not in text:
            raise SystemExit(f"{RECORD} has no record table ({MARKER})")
        RECORD.write_text(text.rstrip("\n") + "\n" + "\n".join(rows) + "\n")
        print(f"appended {len(rows)} rows to {RECORD.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
