"""Preemption and a full disk in the train stage: SIGTERM saves the step reached and ends in
one line (exit 143), a full disk ends in one line (exit 2) and leaves no half checkpoint,
and either way resuming trains the head an uninterrupted run trains, tensor for tensor."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import one_thread

from draftsmith.core import files
from draftsmith.core.signals import EXIT_SIGTERM
from draftsmith.train.main import main as train_main

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "train" / "tiny.yaml"
COMMON = ["--trainer.max_epochs=2", "--data.batch_size=1", "--data.num_workers=1"]


def fit_args(data: Path, out: Path, *extra: str) -> list[str]:
    return [
        "fit",
        f"--config={TINY}",
        f"--data.data={data}",
        f"--trainer.default_root_dir={out}",
        f"--checkpoint.dirpath={out / 'ckpt'}",
        *COMMON,
        *extra,
    ]


def fit(*args: str) -> int:
    with one_thread():
        return train_main(list(args))


def load(ckpt: Path) -> dict:
    return torch.load(ckpt, map_location="cpu", weights_only=False)


def assert_same_head(a: Path, b: Path) -> None:
    heads = [{k: v for k, v in load(c)["state_dict"].items() if k.startswith("head.")}
             for c in (a, b)]  # fmt: skip
    assert heads[0].keys() == heads[1].keys() and heads[0]
    for key in heads[0]:
        torch.testing.assert_close(heads[0][key], heads[1][key], rtol=0, atol=0, msg=key)


@pytest.fixture(scope="module")
def whole(tmp_path_factory, tiny_dataset) -> Path:
    """The uninterrupted run's last checkpoint (2 epochs, a loader worker)."""
    out = tmp_path_factory.mktemp("whole")
    assert fit(*fit_args(tiny_dataset, out)) == 0
    return out / "ckpt" / "last.ckpt"


def sigterm_run(data: Path, out: Path, *callback: str) -> subprocess.CompletedProcess:
    """`draftsmith train fit` in its own process group, which ``helpers.SigtermAtStep``
    sends SIGTERM to (as `timeout` does: the loader's worker gets it too)."""
    args = fit_args(data, out, "--trainer.callbacks+=helpers.SigtermAtStep", *callback)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "tests"), "OMP_NUM_THREADS": "1"}
    core = min(os.sched_getaffinity(0))
    return subprocess.run(
        [sys.executable, "-m", "draftsmith.cli", "train", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        start_new_session=True,
        preexec_fn=lambda: os.sched_setaffinity(0, {core}),  # one thread, as in `fit`
    )


@pytest.mark.parametrize("where", ["train", "validation"])
def test_sigterm_saves_the_step_reached_and_resumes_to_the_same_head(
    tmp_path, tiny_dataset, whole, where
):
    """SIGTERM after a training step mid-epoch 1, or in epoch 0's validation: one line
    naming last.ckpt (which `--ckpt_path last` finds), exit 143, no traceback anywhere
    (the loader's worker got the signal too); the resumed run ends with the whole run's head."""
    per_epoch = load(whole)["global_step"] // 2
    assert per_epoch >= 3
    step = per_epoch + 2 if where == "train" else 1
    out = tmp_path / "stopped"
    extra = [f"--trainer.callbacks.step={step}"]
    if where == "validation":
        extra.append("--trainer.callbacks.in_validation=true")
    proc = sigterm_run(tiny_dataset, out, *extra)
    last = out / "ckpt" / "last.ckpt"
    reached = step if where == "train" else per_epoch  # validation runs after epoch 0
    assert proc.returncode == EXIT_SIGTERM, proc.stderr[-3000:]
    assert proc.stderr.splitlines() == [
        f"draftsmith train: stopped by SIGTERM at step {reached}; checkpoint saved to {last}; "
        f"resume with --ckpt_path {last}"
    ]
    log = (out / "train.log").read_text()
    assert "Traceback" not in proc.stdout + log and "DataLoader worker" not in log
    assert load(last)["global_step"] == reached and not list(last.parent.glob("*.tmp"))
    assert fit(*fit_args(tiny_dataset, out, "--ckpt_path=last")) == 0
    assert_same_head(last, whole)


class FullDisk:
    """``open`` for ``core/files``: the ``n``-th file opened whose name ends with ``name``
    takes ``room`` bytes, then every write raises ENOSPC, as a full disk does."""

    def __init__(self, name: str, n: int = 1, room: int = 4096) -> None:
        self.name, self.n, self.room, self.opened = name, n, room, 0

    def __call__(self, path, mode="r", *args, **kwargs):
        f = open(path, mode, *args, **kwargs)  # noqa: SIM115 (the caller closes it)
        if not str(path).endswith(self.name):
            return f
        self.opened += 1
        return _Filling(f, self.room) if self.opened == self.n else f


class _Filling:
    def __init__(self, f, room: int) -> None:
        self.f, self.room = f, room

    def write(self, data) -> int:
        data = memoryview(data).cast("B")
        if len(data) > self.room:
            self.f.write(data[: self.room])
            self.room = 0
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= len(data)
        return self.f.write(data)

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.f.close()


def test_a_full_disk_at_a_checkpoint_ends_in_one_line_and_leaves_the_last_whole(
    tmp_path, tiny_dataset, whole, monkeypatch, capfd
):
    """With a checkpoint every step, the disk fills 4 KiB into the 5th last.ckpt (written
    every step once the monitored metric exists, i.e. from epoch 1 on: step per_epoch + 5):
    one line naming the path and the free space, exit 2; the step before's
    last.ckpt is still there, whole, and no .tmp; resuming from it with `--ckpt_path last`
    trains the whole run's head."""
    per_epoch = load(whole)["global_step"] // 2
    every = "--checkpoint.every_n_train_steps=1"
    out = tmp_path / "full"
    full = FullDisk("last.ckpt.tmp", n=5)
    monkeypatch.setattr(files, "open", full, raising=False)
    assert fit(*fit_args(tiny_dataset, out, every)) == 2
    err = own_lines(capfd.readouterr().err)
    last = out / "ckpt" / "last.ckpt"
    assert len(err) == 1 and f"could not write checkpoint {last}" in err[0], err
    assert "No space left on device" in err[0] and "GiB free on" in err[0]
    assert not list(last.parent.glob("*.tmp"))
    assert load(last)["global_step"] == per_epoch + 4  # the step before's, whole
    monkeypatch.undo()
    assert fit(*fit_args(tiny_dataset, out, every, "--ckpt_path=last")) == 0
    assert_same_head(last, whole)


def own_lines(stderr: str) -> list[str]:
    """stderr without the logging module's "--- Logging error ---" blocks: a handler an
    earlier test in this process left on a stream pytest has since closed reports itself
    there (never the command's own output)."""
    out, skipping = [], False
    for line in stderr.strip().splitlines():
        if line == "--- Logging error ---":
            skipping = True
        elif skipping and line.startswith("Arguments: "):
            skipping = False
        elif not skipping:
            out.append(line)
    return out
