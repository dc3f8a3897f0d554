"""The documentation tells the truth: the site builds with mkdocs --strict (a broken link or a
page missing from the navigation fails), the generated reference pages are current, and every
command block (```sh) and Python block of README.md and docs/ runs, in order, page by page, in
a directory of its own beside a checkout's files. A block that cannot run here says why in a
`<!-- not run: REASON -->` line just above it (it needs a GPU, a cluster or a download)."""

import dataclasses
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT
from helpers import cli, env, in_process_ok

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^```(\w*)\s*$")
NOT_RUN = re.compile(r"^<!-- not run: (.+?) -->$")
RUNNABLE = ("sh", "python")
# what a page's commands see of the checkout, from a directory of their own
CHECKOUT = (
    "train.py",
    "eval.py",
    "configs",
    "data",
    "tests",
    "megajax",
    "bench",
    "notebooks",
    "scripts",
    "requirements.txt",
    "requirements-test.txt",
    "pyproject.toml",
    "mkdocs.yml",
    "docs",
    "README.md",
    ".ci",
)


def blocks(page: Path):
    """(language, code, reason it is not run or None, line) of each fenced block."""
    lines, i = page.read_text(encoding="utf-8").splitlines(), 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start, lang = i, m.group(1)
        i += 1
        while not lines[i].startswith("```"):
            i += 1
        marker = NOT_RUN.match(lines[start - 1]) if start else None
        yield lang, "\n".join(lines[start + 1 : i]), marker and marker.group(1), start + 1
        i += 1


def runnable_pages():
    return [p for p in PAGES if any(lang in RUNNABLE and not why for lang, _, why, _ in blocks(p))]


def test_every_block_not_run_says_why_and_every_command_block_is_marked():
    for page in PAGES:
        for lang, code, why, line in blocks(page):
            where = f"{page.relative_to(ROOT)}:{line}"
            assert lang, f"{where}: a fence names its language (sh, python, text, toml, ...)"
            assert why is None or (lang in RUNNABLE and why != "REVIEW"), where
            if lang == "text" and "[-h]" not in code:  # commands are in sh blocks (not usage)
                assert not re.match(
                    r"\s*(python3? \S+\.py |python3? -m |megajax-[a-z]+ |\$ )", code
                ), where


def sandbox(tmp_path: Path) -> Path:
    for name in CHECKOUT:
        (tmp_path / name).symlink_to(ROOT / name)
    bin_dir = tmp_path / ".bin"
    bin_dir.mkdir()
    for name in ("python", "python3"):  # the suite's interpreter (a link would leave its venv)
        (bin_dir / name).write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
        (bin_dir / name).chmod(0o755)
    return bin_dir


def page_id(page: Path) -> str:
    return str(page.relative_to(ROOT))


@pytest.mark.full
@pytest.mark.parametrize(
    "page", [p for p in runnable_pages() if "guides" not in p.parts], ids=page_id
)
def test_page_commands_run(page, tmp_path):
    """The guides' pages run in tests/test_docs_guides.py (the other pytest worker)."""
    run_page(page, tmp_path)


# A line that is only a megajax program and its arguments (no pipe, redirection, variable,
# environment or background job): `python train.py ...`, `python eval.py ...`, `python -m
# megajax TOOL ...`.
PROGRAMS = {
    ("train.py",): "train",
    ("eval.py",): "eval",
    **{
        ("-m", "megajax", tool): tool
        for tool in ("train", "eval", "plan", "convert", "prepare", "plot")
    },
}


def programs(code: str) -> list[tuple[str, list[str]]] | None:
    """The block's lines as (tool, arguments), if every line is a megajax program alone."""
    calls = []
    for line in code.replace("\\\n", " ").splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split, lexer.commenters = True, "#"
        words = list(lexer)
        if not words:
            continue
        operators = any(set(w) <= set("|&;<>()") for w in words)
        start = next((n for n in (2, 4) if tuple(words[1:n]) in PROGRAMS), None)
        if words[0] not in ("python", "python3") or start is None or operators or "$" in line:
            return None
        calls.append((PROGRAMS[tuple(words[1:start])], words[start:]))
    return calls


def run_page(page: Path, tmp_path: Path):
    """Each block in order: one whose lines are megajax programs alone runs them in this process
    (helpers.cli: what the user's process runs, without an interpreter start each), any other
    in bash or Python of its own."""
    bin_dir = sandbox(tmp_path)
    e = dict(
        env(),
        PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        WANDB_MODE="offline",
        MPLBACKEND="Agg",
    )
    for lang, code, why, line in blocks(page):
        if lang not in RUNNABLE or why:
            continue
        calls = programs(code) if lang == "sh" else None
        if calls and all(in_process_ok(args) for _, args in calls):
            for tool, args in calls:
                p = cli(
                    tool,
                    *args,
                    cwd=tmp_path,
                    environ={"WANDB_MODE": "offline", "MPLBACKEND": "Agg"},
                )
                if p.returncode != 0:
                    break
        else:
            cmd = (
                ["bash", "-e", "-o", "pipefail", "-c", code]
                if lang == "sh"
                else [sys.executable, "-c", code]
            )
            p = subprocess.run(
                cmd, cwd=tmp_path, env=e, capture_output=True, text=True, timeout=600
            )
        assert p.returncode == 0, (
            f"{page.relative_to(ROOT)}:{line} failed ({p.returncode}):\n"
            f"{code}\n"
            "--- stdout\n"
            f"{p.stdout[-3000:]}\n"
            "--- stderr\n"
            f"{p.stderr[-3000:]}"
        )


def test_reference_pages_are_current():
    from megajax.cli.reference import main

    assert main(["--check"]) == 0, "run: python -m megajax.cli.reference"


def test_site_builds_strict(tmp_path):
    p = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-4000:]
    assert (tmp_path / "site" / "reference" / "config" / "index.html").is_file()


def test_readme_is_short():
    assert len((ROOT / "README.md").read_text(encoding="utf-8").splitlines()) <= 250


def test_every_config_field_has_one_whole_description():
    """What the config reference says of each field comes from its comment in the dataclass:
    there for every field, and whole (no sentence cut off into the next field's: balanced
    brackets, no dangling separator)."""
    from megajax.cli.reference import SECTIONS, field_comments

    for _, cls in SECTIONS:
        comments = field_comments(cls)
        for f in dataclasses.fields(cls):
            text = comments.get(f.name, "")
            where = f"{cls.__name__}.{f.name}: {text!r}"
            assert text, where
            assert text.count("(") == text.count(")") and text.count("[") == text.count("]"), where
            assert not text.rstrip().endswith((",", "|", "(", ";", ":")), where
