"""The CLI restarts itself once with glibc malloc tunables (megajax/hostenv.py)."""
import os
import subprocess
import sys
from pathlib import Path

from megajax.hostenv import MALLOC_TUNABLES, tuned_env

ROOT = Path(__file__).resolve().parent.parent
WANT = ":".join(f"{k}={v}" for k, v in MALLOC_TUNABLES.items())


def test_tuned_env_adds_only_what_is_missing_and_respects_the_user():
    assert tuned_env({})["GLIBC_TUNABLES"] == WANT
    assert tuned_env({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})["GLIBC_TUNABLES"] == \
        "glibc.malloc.arena_max=2:" + WANT
    # a value the user chose is kept; only the other tunable is added
    mine = "glibc.malloc.mmap_threshold=65536"
    assert tuned_env({"GLIBC_TUNABLES": mine})["GLIBC_TUNABLES"] == \
        mine + ":glibc.malloc.trim_threshold=" + MALLOC_TUNABLES["glibc.malloc.trim_threshold"]
    assert tuned_env({"GLIBC_TUNABLES": WANT}) is None            # already tuned: no restart
    assert tuned_env({"MEGAJAX_MALLOC_TUNING": "0"}) is None      # turned off


def test_entry_point_restarts_once_in_the_same_process():
    code = ("import os, runpy, sys; print('start', os.getpid(), flush=True); "
            f"runpy.run_path({str(ROOT / 'megajax' / 'hostenv.py')!r})['restart_with_malloc_tuning'](); "
            "print('main', os.getpid(), os.environ.get('GLIBC_TUNABLES'), sys.argv[1:])")
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "MEGAJAX_MALLOC_TUNING")}
    out = subprocess.run([sys.executable, "-c", code, "--flag", "x"], env=env, capture_output=True,
                         text=True, check=True).stdout.split("\n")
    starts = [line for line in out if line.startswith("start")]
    mains = [line for line in out if line.startswith("main")]
    assert len(starts) == 2 and len(mains) == 1            # restarted exactly once
    pid = starts[0].split()[1]
    assert starts[1].split()[1] == pid and mains[0].split()[1] == pid
    assert mains[0].split()[2] == WANT and mains[0].endswith("['--flag', 'x']")
