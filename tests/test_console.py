"""The quiet console: libraries and child processes write to the stage's log, say() to the user."""

from __future__ import annotations

import subprocess
import sys

from draftsmith.core.console import VERBOSE_ENV, progress, say, stage_log


def test_stage_log_takes_child_processes_and_warnings_say_reaches_the_terminal(
    tmp_path, capfd, monkeypatch
):
    monkeypatch.delenv(VERBOSE_ENV, raising=False)
    log = tmp_path / "stage" / "extract.log"
    with stage_log(log) as path:
        assert path == log
        print("INFO engine chatter")  # what vLLM's own prints look like
        subprocess.run([sys.executable, "-c", "import sys; print('child out'); "
                        "print('child err', file=sys.stderr)"], check=True)  # fmt: skip
        warn = "import warnings; warnings.warn('a library warning')"
        subprocess.run([sys.executable, "-c", warn], check=True)
        say("extract: 2 of 4 shards")
        bar = progress(4, "extract", unit="sample")
        bar.update(4)
        bar.close()
    say("after the stage")
    out, err = capfd.readouterr()
    text = log.read_text()
    for line in ("INFO engine chatter", "child out", "child err", "a library warning"):
        assert line in text and line not in out + err
    assert "extract: 2 of 4 shards" in out and "after the stage" in out
    assert "4/4" in out + err and "4/4" not in text  # the bar is the user's, not the log's
    assert "extract: 2 of 4 shards" not in text


def test_verbose_shows_everything_live(tmp_path, capfd, monkeypatch):
    monkeypatch.setenv(VERBOSE_ENV, "1")
    with stage_log(tmp_path / "eval.log") as path:
        print("INFO engine chatter")
    assert path is None and not (tmp_path / "eval.log").exists()
    assert "INFO engine chatter" in capfd.readouterr().out


def test_nested_logs_switch_files_and_restore(tmp_path, capfd, monkeypatch):
    monkeypatch.delenv(VERBOSE_ENV, raising=False)
    outer, inner = tmp_path / "pipeline.log", tmp_path / "train.log"
    with stage_log(outer):
        print("outer 1")
        with stage_log(inner):
            print("inner")
            say("still the user's")
        print("outer 2")
    assert outer.read_text().split() == ["outer", "1", "outer", "2"]
    assert inner.read_text().strip() == "inner"
    assert "still the user's" in capfd.readouterr().out
