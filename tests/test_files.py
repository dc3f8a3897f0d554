"""Files survive a kill at any moment: atomic replacement, and logs with a cut-short last line."""
import json
import os

import pytest

from megajax.files import read_jsonl, write_atomic
from megajax.training.metrics import MetricsLog, plot_workdir


def test_write_atomic_replaces_whole_or_not_at_all(tmp_path, monkeypatch):
    path = tmp_path / "config.json"
    write_atomic(path, "old\n")
    write_atomic(path, "new\n")
    assert path.read_text() == "new\n" and oct(path.stat().st_mode & 0o777) == "0o644"

    def killed(src, dst):   # the process dies between writing the temporary file and renaming it
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        write_atomic(path, "half")
    assert path.read_text() == "new\n"
    assert [p.name for p in tmp_path.iterdir()] == ["config.json"]   # no temporary file left behind


def test_metrics_with_a_cut_short_last_line_resume_and_plot(tmp_path):
    log = MetricsLog(tmp_path)
    for step in (1, 2, 3):
        log.write({"step": step, "loss": 4.0 - step})
    with log.path.open("a") as f:
        f.write('{"step": 4, "lo')                 # killed mid-write
    assert [r["step"] for r in read_jsonl(log.path)] == [1, 2, 3]
    plot_workdir(tmp_path)
    log.truncate_after(2)                          # resuming from the checkpoint of step 2
    assert log.path.read_text() == "".join(json.dumps({"step": s, "loss": 4.0 - s}) + "\n" for s in (1, 2))
    before = log.path.stat().st_mtime_ns
    log.truncate_after(2)                          # nothing to drop: the file is not rewritten
    assert log.path.stat().st_mtime_ns == before
    log.write({"step": 3, "loss": 1.5})
    assert [r["step"] for r in read_jsonl(log.path)] == [1, 2, 3]


def test_megajax_plot_refuses_an_output_it_cannot_write_in_one_line(tmp_path, capsys):
    from megajax.cli import plot_main

    MetricsLog(tmp_path).write({"step": 1, "loss": 3.0})
    for out in (tmp_path, tmp_path / "absent" / "x.png"):      # before: a traceback after drawing
        assert plot_main([str(tmp_path), "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {out}: give the picture's file name") and err.count("\n") == 1
    assert plot_main([str(tmp_path), "--out", str(tmp_path / "curve.png")]) == 0
    assert (tmp_path / "curve.png").stat().st_size > 0
