"""Refresh tests/durations.json: the seconds each test of the full tier took on this machine,
which tests/conftest.py reads to hand pytest-xdist's two workers the longest files first (so
that no long file is left to run alone at the end) and docs/testing.md's table comes from.

    python scripts/test_durations.py               # runs the full tier (about 20 minutes)
    python scripts/test_durations.py REPORT.xml    # from the JUnit report of a run already made
    python scripts/test_durations.py --slowest 20  # the table of the slowest tests, as Markdown
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DURATIONS = ROOT / "tests" / "durations.json"


def durations_of(report: Path) -> dict[str, float]:
    """{pytest node id: seconds (setup, call and teardown)} of a JUnit XML report."""
    seconds = {}
    for case in ET.parse(report).iter("testcase"):
        module = case.get("classname", "").replace(".", "/")
        seconds[f"{module}.py::{case.get('name')}"] = round(float(case.get("time", 0)), 1)
    return dict(sorted(seconds.items()))


def slowest_table(seconds: dict[str, float], n: int) -> str:
    rows = sorted(seconds.items(), key=lambda kv: -kv[1])[:n]
    return "\n".join(
        ["| seconds | test |", "| ---: | --- |", *(f"| {s:.1f} | `{test}` |" for test, s in rows)]
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("report", nargs="?", type=Path, help="a JUnit XML report of a full run")
    p.add_argument(
        "--slowest",
        type=int,
        metavar="N",
        help="print the N slowest tests of tests/durations.json as a Markdown table",
    )
    args = p.parse_args(argv)
    if args.slowest:
        print(slowest_table(json.loads(DURATIONS.read_text()), args.slowest))
        return 0
    report = args.report
    if report is None:
        report = Path(tempfile.mkdtemp()) / "full.xml"
        status = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "--full", "tests", f"--junitxml={report}"],
            cwd=ROOT,
        ).returncode
        if status != 0:
            print(
                f"error: the full tier failed (status {status}); durations not written",
                file=sys.stderr,
            )
            return status
    seconds = durations_of(report)
    DURATIONS.write_text(json.dumps(seconds, indent=0) + "\n")
    print(
        f"wrote {DURATIONS.relative_to(ROOT)}: {len(seconds)} tests, "
        f"{sum(seconds.values()) / 60:.1f} test-minutes"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
