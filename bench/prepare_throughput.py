#!/usr/bin/env python
"""megajax-prepare's throughput: one process against a pool, on the same corpus.

    python bench/prepare_throughput.py [--copies 12] [--workers 2] [--tokenizer SPEC]

The corpus is WikiText-2 (valid + test) and Tiny Shakespeare from the committed data/, written
`--copies` times as separate files (about 2.7 MB each copy). Each run prepares it into a fresh
directory; the figure is tokens per second of the whole command (planning, checksums,
tokenizing, assembling), the best of `--repeats`. On a 2-core AMD EPYC the pool of 2 was 1.95x one
process (docs/guides/preparing-corpora.md).
"""

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from megajax.prepare import Settings, prepare  # noqa: E402

DATA = ROOT / "data"
SOURCES = [
    DATA / "wikitext-2" / "valid.txt",
    DATA / "wikitext-2" / "test.txt",
    DATA / "tinyshakespeare.txt",
]


def run(inputs, out: Path, tokenizer: str, workers: int) -> tuple[float, int]:
    t0 = time.perf_counter()
    meta = prepare(inputs, out, Settings(tokenizer, 0.01), workers=workers, say=lambda *a: None)
    return (
        time.perf_counter() - t0,
        meta["splits"]["train"]["tokens"] + meta["splits"]["val"]["tokens"],
    )


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--copies", type=int, default=12)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument(
        "--tokenizer", default=f"hf:{ROOT / 'tests/fixtures/hf/megatron_bert/tokenizer.json'}"
    )
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for c in range(a.copies):
            for s in SOURCES:
                (tmp / "in" / f"{c:03d}").mkdir(parents=True, exist_ok=True)
                (tmp / "in" / f"{c:03d}" / s.name).write_bytes(s.read_bytes())
        size = sum(f.stat().st_size for f in (tmp / "in").rglob("*.txt"))
        inputs = [str(tmp / "in" / "*" / "*.txt")]
        best = {}
        for r in range(a.repeats):
            for workers in (1, a.workers):
                seconds, tokens = run(inputs, tmp / f"out_{workers}_{r}", a.tokenizer, workers)
                best[workers] = min(best.get(workers, seconds), seconds)
        print(
            f"corpus: {size / 1e6:.1f} MB in {a.copies * len(SOURCES)} files, {tokens:,} tokens "
            f"({a.tokenizer.split('/')[-1]})"
        )
        for workers, seconds in best.items():
            print(
                f"  {workers} process{'es' if workers > 1 else ''}: {seconds:6.2f} s  "
                f"{tokens / seconds:12,.0f} tokens/s  {size / seconds / 1e6:6.2f} MB/s"
            )
        print(f"speed-up with {a.workers} processes: {best[1] / best[a.workers]:.2f}x")


if __name__ == "__main__":
    main()
