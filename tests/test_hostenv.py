"""The CLI restarts itself once with glibc malloc tunables (megajax/host/env.py)."""

import os
import platform
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from megajax.host.env import MALLOC_TUNABLES, tuned_env

ROOT = Path(__file__).resolve().parent.parent
WANT = ":".join(f"{k}={v}" for k, v in MALLOC_TUNABLES.items())


def test_tuned_env_adds_only_what_is_missing_and_respects_the_user():
    assert tuned_env({})["GLIBC_TUNABLES"] == WANT
    assert (
        tuned_env({"GLIBC_TUNABLES": "glibc.rtld.nns=2"})["GLIBC_TUNABLES"]
        == "glibc.rtld.nns=2:" + WANT
    )
    # a value the user chose is kept; only the other tunables are added
    mine = "glibc.malloc.mmap_threshold=65536"
    assert tuned_env({"GLIBC_TUNABLES": mine})["GLIBC_TUNABLES"] == mine + ":" + ":".join(
        f"{k}={v}" for k, v in MALLOC_TUNABLES.items() if k != "glibc.malloc.mmap_threshold"
    )
    assert tuned_env({"GLIBC_TUNABLES": WANT}) is None  # already tuned: no restart
    assert tuned_env({"MEGAJAX_MALLOC_TUNING": "0"}) is None  # turned off


def test_entry_point_restarts_once_in_the_same_process():
    env_py = str(ROOT / "megajax" / "host" / "env.py")
    code = (
        "import os, runpy, sys; print('start', os.getpid(), flush=True); "
        f"runpy.run_path({env_py!r})['restart_with_malloc_tuning'](); print('main', os.getpid(), "
        "os.environ.get('GLIBC_TUNABLES'), sys.argv[1:])"
    )
    env = {
        k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "MEGAJAX_MALLOC_TUNING")
    }
    out = subprocess.run(
        [sys.executable, "-c", code, "--flag", "x"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split("\n")
    starts = [line for line in out if line.startswith("start")]
    mains = [line for line in out if line.startswith("main")]
    assert len(starts) == 2 and len(mains) == 1  # restarted exactly once
    pid = starts[0].split()[1]
    assert starts[1].split()[1] == pid and mains[0].split()[1] == pid
    assert mains[0].split()[2] == WANT and mains[0].endswith("['--flag', 'x']")


FAULTS_PER_CALL = """
import resource, jax, jax.numpy as jnp
# a 64 MiB output, allocated by one of XLA's worker threads
x = jnp.ones((64, 512, 512))
f = jax.jit(lambda x: x + 1)
for _ in range(3):
    jax.block_until_ready(f(x))
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    jax.block_until_ready(f(x))
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 5)
"""


def transparent_huge_pages() -> str:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "unavailable"
    return text[text.index("[") + 1 : text.index("]")]


def glibc_version() -> tuple[int, ...]:
    return tuple(int(x) for x in platform.libc_ver()[1].split("."))


@pytest.mark.skipif(
    sys.platform != "linux"
    or platform.libc_ver()[0] != "glibc"
    or glibc_version() < (2, 35)
    or transparent_huge_pages() not in ("madvise", "always"),
    reason="needs glibc 2.35+ (glibc.malloc.hugetlb) and transparent huge pages",
)
def test_tuned_process_maps_large_blocks_with_huge_pages():
    """A 64 MiB output that one of XLA's worker threads allocates is mapped fresh on every call
    (a thread arena maps any block of 64 MiB or more); with the tunables it comes in 2 MiB pages:
    32 faults a call instead of 16,384 (4 KiB pages). Compaction may fail for a few pages of a
    busy machine's memory, hence the bound at a quarter."""
    pages = 64 * 2**20 // resource.getpagesize()
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    tuned = float(
        subprocess.run(
            [sys.executable, "-c", FAULTS_PER_CALL],
            env=tuned_env(env),
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()[-1]
    )
    assert tuned < pages / 4, f"{tuned:.0f} page faults per call of a {pages}-page output"
