"""The code's layout is ruff's (`ruff format`, line length 100) and it passes `ruff check`'s rules,
as pyproject.toml configures both: every Python file and notebook git tracks."""

import subprocess
import sys

import pytest
from conftest import ROOT


def tracked_code() -> list[str]:
    files = subprocess.run(
        ["git", "ls-files", "*.py", "*.ipynb"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    assert files
    return files


@pytest.mark.parametrize("command", [["format", "--check"], ["check"]], ids=" ".join)
def test_ruff_passes(command):
    run = subprocess.run(
        [sys.executable, "-m", "ruff", *command, "--no-cache", *tracked_code()],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
