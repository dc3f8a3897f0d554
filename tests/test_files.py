"""Files survive a kill at any moment: atomic replacement, and logs with a cut-short last line."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import ROOT, handles_signal

from megajax import files
from megajax.files import abandon_staged, read_jsonl, staged_directory, write_atomic
from megajax.runs.metrics import MetricsLog, plot_workdir


def test_write_atomic_replaces_whole_or_not_at_all(tmp_path, monkeypatch):
    path = tmp_path / "config.json"
    write_atomic(path, "old\n")
    write_atomic(path, "new\n")
    assert path.read_text() == "new\n" and oct(path.stat().st_mode & 0o777) == "0o644"

    def killed(src, dst):  # the process dies between writing the temporary file and renaming it
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        write_atomic(path, "half")
    assert path.read_text() == "new\n"
    assert [p.name for p in tmp_path.iterdir()] == ["config.json"]  # no temporary file left behind


def test_write_atomic_writes_into_a_fifo_or_device_and_through_a_link(tmp_path):
    """`eval.py --out /dev/stdout` (or /dev/null): renaming over the path replaced the node
    itself, for root even /dev/null with a regular file. A FIFO stands in for the device here
    (the suite must not touch /dev). A symbolic link is kept and its target replaced."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    reader = subprocess.Popen(
        [sys.executable, "-c", f"print(open({str(fifo)!r}).read(), end='')"],
        stdout=subprocess.PIPE,
        text=True,
    )
    write_atomic(fifo, "through the pipe\n")
    assert reader.communicate(timeout=30)[0] == "through the pipe\n"
    assert fifo.is_fifo()
    (tmp_path / "real.json").write_text("old")
    (tmp_path / "link.json").symlink_to("real.json")
    write_atomic(tmp_path / "link.json", "new")
    assert (tmp_path / "link.json").is_symlink() and (tmp_path / "real.json").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fifo", "link.json", "real.json"]


def test_metrics_with_a_cut_short_last_line_resume_and_plot(tmp_path):
    log = MetricsLog(tmp_path)
    for step in (1, 2, 3):
        log.write({"step": step, "loss": 4.0 - step})
    with log.path.open("a") as f:
        f.write('{"step": 4, "lo')  # killed mid-write
    assert [r["step"] for r in read_jsonl(log.path)] == [1, 2, 3]
    plot_workdir(tmp_path)
    log.truncate_after(2)  # resuming from the checkpoint of step 2
    assert log.path.read_text() == "".join(
        json.dumps({"step": s, "loss": 4.0 - s}) + "\n" for s in (1, 2)
    )
    before = log.path.stat().st_mtime_ns
    log.truncate_after(2)  # nothing to drop: the file is not rewritten
    assert log.path.stat().st_mtime_ns == before
    log.write({"step": 3, "loss": 1.5})
    assert [r["step"] for r in read_jsonl(log.path)] == [1, 2, 3]


def test_megajax_plot_refuses_an_output_it_cannot_write_in_one_line(tmp_path, capsys):
    from megajax.cli.plot import plot_main

    MetricsLog(tmp_path).write({"step": 1, "loss": 3.0})
    for out in (tmp_path, tmp_path / "absent" / "x.png"):  # before: a traceback after drawing
        assert plot_main([str(tmp_path), "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert (
            err.startswith(f"error: {out}: give the picture's file name") and err.count("\n") == 1
        )
    assert plot_main([str(tmp_path), "--out", str(tmp_path / "curve.png")]) == 0
    assert (tmp_path / "curve.png").stat().st_size > 0
    # From a checkout (no console script): a workdir without metrics is one line (before, with
    # python -m megajax.runs.metrics: a traceback).
    p = subprocess.run(
        [sys.executable, "-m", "megajax.cli.plot", str(tmp_path / "absent")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert (
        p.returncode == 2 and p.stderr == f"error: no metrics.jsonl in {tmp_path / 'absent'}\n"
    ), p.stderr
    p = subprocess.Popen(
        [sys.executable, "-m", "megajax.cli.plot", str(tmp_path), "--out", str(tmp_path / "s.png")],
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    while p.poll() is None and not handles_signal(p.pid, signal.SIGTERM):
        time.sleep(0.01)
    p.send_signal(signal.SIGTERM)  # one line, and the picture whole or not at all
    assert p.wait(timeout=120) == 128 + signal.SIGTERM and p.stderr.read().startswith(
        "stopped by SIGTERM: the picture"
    )
    # no temporary left
    assert {x.name for x in tmp_path.iterdir()} <= {"metrics.jsonl", "curve.png", "s.png"}
    assert not (tmp_path / "s.png").exists() or (tmp_path / "s.png").read_bytes().startswith(
        b"\x89PNG"
    )


def test_megajax_plot_writes_the_format_its_name_asks_for_and_refuses_a_log_without_losses(
    tmp_path, capsys
):
    from megajax.cli.plot import plot_main

    log = MetricsLog(tmp_path)
    log.path.write_text("")  # a run that has logged nothing yet
    # before: an empty picture and matplotlib's warning
    assert plot_main([str(tmp_path)]) == 2
    assert (
        capsys.readouterr().err
        == f"error: {log.path} holds no loss yet: a run logs one every train.log_every steps\n"
    )
    log.path.write_bytes(bytes(range(256)) * 4 + b"\n")  # nothing that parses
    assert plot_main([str(tmp_path)]) == 2 and "holds no loss yet" in capsys.readouterr().err
    log.write({"step": 1, "val_loss": 3.0})  # a validation loss alone is a curve
    magic = {
        "curve.pdf": b"%PDF",
        "curve.SVG": b"<?xml",
        "curve": b"\x89PNG",
        "curve.jpg": b"\xff\xd8",
    }
    for name, start in magic.items():  # before: a PNG whatever the name said
        assert plot_main([str(tmp_path), "--out", str(tmp_path / name)]) == 0
        assert (tmp_path / name).read_bytes().startswith(start), name
    capsys.readouterr()
    assert plot_main([str(tmp_path), "--out", str(tmp_path / "curve.v2")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        f"error: {tmp_path / 'curve.v2'}: matplotlib writes no '.v2' picture; end the name in "
    )
    assert ".pdf" in err and err.count("\n") == 1 and not (tmp_path / "curve.v2").exists()


def test_a_signal_removes_a_half_staged_directory_and_never_denies_a_written_one(
    tmp_path, monkeypatch
):
    """abandon_staged is what megajax-convert's signal handler calls before it ends the process
    without unwinding: at every moment, what it says was written is what exists."""
    monkeypatch.setattr(files, "_STAGED", {})
    monkeypatch.setattr(files, "_WRITTEN", [])
    half = staged_directory(tmp_path / "half")
    tmp = half.__enter__()  # the signal arrives while the block writes
    (tmp / "config.json").write_text("{}")
    assert abandon_staged() == [] and list(tmp_path.iterdir()) == []
    renamed = staged_directory(tmp_path / "renamed")
    tmp = renamed.__enter__()
    (tmp / "config.json").write_text("{}")
    # ... an instant after the rename, before the block ends
    os.replace(tmp, tmp_path / "renamed")
    assert abandon_staged() == [tmp_path / "renamed"]
    with staged_directory(tmp_path / "done") as tmp:
        (tmp / "config.json").write_text("{}")
    assert sorted(abandon_staged()) == [tmp_path / "done", tmp_path / "renamed"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["done", "renamed"]


def test_staged_copies_of_dead_processes_are_removed(tmp_path):
    """A SIGKILL leaves a staged copy behind; the next staging of the same output removes those
    of processes of this host that are gone, and no other."""
    dead = _a_finished_pid()
    left = {
        name: tmp_path / f".out.{name}.partial"
        for name in (
            f"{files._HOST}-{dead}-0a0b",
            f"{files._HOST}-{os.getpid()}-0c0d",
            f"otherhost-{dead}-0e0f",
        )
    }
    for d in left.values():
        (d / "units").mkdir(parents=True)
    with staged_directory(tmp_path / "out") as tmp:
        (tmp / "config.json").write_text("{}")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [left[n].name for n in list(left)[1:]] + ["out"]
    )


def _a_finished_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid
