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


def test_the_training_bar_ends_where_the_time_cap_does(monkeypatch):
    """100 steps in 50 s with 60 s left: the cap ends at step 220, not at the 5,600 planned;
    a plan shorter than that stays the end."""
    from draftsmith.train import progress

    monkeypatch.setattr(progress.time, "monotonic", lambda: 1050.0)
    start = (1000.0, 0)
    assert progress.capped_total(5600, 100, 60.0, start) == 220
    assert progress.capped_total(150, 100, 60.0, start) == 150
    assert progress.capped_total(None, 100, 60.0, start) == 220
    assert progress.capped_total(5600, 0, 60.0, start) == 5600  # no rate yet
