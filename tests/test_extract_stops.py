"""Extraction stopped, killed, out of disk or corrupted, with the real vLLM CPU build: what
is written stays whole, and a rerun (or `--repair`) completes the dataset without gaps.

Each run is a separate process, as users run it (a killed run must be a real process).
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from extract_runs import CHATS, extract, write_jsonl

from draftsmith.dataset.reader import open_dataset
from draftsmith.extract.verify import verify_dataset

pytestmark = pytest.mark.vllm


# Runs `draftsmith extract ARGS` but, at the second shard's write, reports "2" on the file
# descriptor given first and waits there forever (for the test's SIGKILL).
PAUSE_AT_SECOND_SHARD = """
import os, signal, sys
from draftsmith.dataset import shards as store
fd, real, calls = int(sys.argv[1]), store.write_shard, []
def write_shard(*args, **kwargs):
    calls.append(1)
    if len(calls) == 2:
        os.write(fd, b"2")
        while True:
            signal.pause()
    return real(*args, **kwargs)
store.write_shard = write_shard
from draftsmith.extract.main import main
sys.exit(main(sys.argv[2:]))
"""


def test_repair_extracts_exactly_the_corrupt_shard_again(tmp_path, tiny_model_dir):
    """A byte flipped in one shard: reading it is refused in one line naming the repair
    command; `--output DIR --repair true` alone (the settings come from the manifest) writes
    that shard again, byte for byte as before, and leaves the other untouched."""
    from draftsmith.core.errors import DatasetError
    from draftsmith.extract.main import main

    data = write_jsonl(tmp_path / "chats.jsonl", CHATS)
    out = tmp_path / "ds"
    args = [f"--model={tiny_model_dir}", f"--data=[{data}]", f"--output={out}"]
    assert main([*args, "--samples_per_shard=2"]) == 0
    first, second = out / "shard-00000.safetensors", out / "shard-00001.safetensors"
    before = {f: (f.read_bytes(), f.stat().st_mtime_ns) for f in (first, second)}
    raw = bytearray(before[second][0])
    raw[-3] ^= 0x01  # a bit of the tensor data: the size and the header stay valid
    second.write_bytes(bytes(raw))
    ds = open_dataset(out)
    with pytest.raises(DatasetError, match=f"--output {out} --repair true") as err:
        [ds[i] for i in range(len(ds))]
    assert "\n" not in str(err.value)
    assert main([f"--output={out}", "--repair=true"]) == 0
    assert first.stat().st_mtime_ns == before[first][1]  # the good shard was not rewritten
    assert second.read_bytes() == before[second][0]  # the bad one is as extracted first
    ds = open_dataset(out)
    assert ds.manifest["complete"] and len(ds) == len(CHATS)
    assert all(ds[i]["input_ids"].numel() for i in range(len(ds)))


def shard_files(out: Path) -> dict[int, str]:
    """Finished shards (file and sidecar both present) by index."""
    return {
        int(p.stem.split("-")[1]): p.stem
        for p in out.glob("shard-*.safetensors")
        if p.with_suffix(".json").is_file()
    }


def test_worker_killed_mid_shard_reruns_and_merges_without_gaps(tmp_path, tiny_model_dir):
    """Two workers fill one dataset; worker 1 is SIGKILLed while writing its second shard
    (its first one finished and recorded), re-run, and a merge run completes the dataset:
    every sample once, in order, no stray files, and the states equal transformers'."""
    prompts = [{"prompt": f"Tell me fact number {i} about the sea."} for i in range(8)]
    data = write_jsonl(tmp_path / "prompts.jsonl", prompts)
    out = tmp_path / "out"
    common = [
        f"--model={tiny_model_dir}",
        f"--data=[{data}]",
        f"--output={out}",
        "--regenerate=true",
        "--max_new_tokens=32",
        "--samples_per_shard=2",
        "--dtype=bfloat16",
    ]
    extract([*common, "--workers=2", "--worker=0"])
    assert shard_files(out) == {0: "shard-00000", 2: "shard-00002"}

    # Worker 1 (shards 1 and 3) tells us over a pipe when it reaches its second shard's
    # write; then the whole run is killed, as a crash or an OOM kill would.
    ready, signal_w = os.pipe()
    worker1 = [*common, "--workers=2", "--worker=1"]
    proc = subprocess.Popen(
        [sys.executable, "-c", PAUSE_AT_SECOND_SHARD, str(signal_w), *worker1],
        pass_fds=(signal_w,),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # a kill takes vLLM's engine processes down with it
    )
    os.close(signal_w)
    readable, _, _ = select.select([ready], [], [], 600)
    if not readable:  # the worker pauses forever at its second shard: kill it before reading
        os.killpg(proc.pid, signal.SIGKILL)
        output = proc.communicate()[0].decode()[-3000:]
        pytest.fail(f"worker 1 wrote no second shard in 600 s:\n{output}")
    assert os.read(ready, 1) == b"2"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert not json.loads((out / "manifest.json").read_text())["complete"]
    assert sorted(shard_files(out)) == [0, 1, 2]  # worker 1's first shard is kept
    written = {
        name: (out / f"{name}.safetensors").stat().st_mtime_ns for name in shard_files(out).values()
    }

    extract(worker1)  # writes shard 3 only
    extract(common)  # the merge: every shard is done, so no engine starts
    man = json.loads((out / "manifest.json").read_text())
    assert man["complete"] and man["num_samples"] == 8
    assert sorted(shard_files(out)) == [0, 1, 2, 3]
    assert {n: (out / f"{n}.safetensors").stat().st_mtime_ns for n in written} == written
    assert not list(out.glob("*.tmp"))
    ds = open_dataset(out)
    ids = [ds[i]["id"] for i in range(len(ds))]
    assert len(ids) == 8 == len(set(ids)), ids
    assert [ds[i]["loss_mask"].any().item() for i in range(8)] == [True] * 8
    report = verify_dataset(str(out), 8)
    assert report.ok, report.text()


# Runs `draftsmith extract ARGS` (argv[3:]) with `core/files.open` patched for the file whose
# name ends with argv[2] ("shard-00001.safetensors.tmp"): after 4096 bytes, in mode "pause"
# it reports on the fd argv[1] and waits (for the test's SIGTERM), in mode "full" every
# write raises ENOSPC, as on a full disk.
INTERRUPT_MID_WRITE = """
import errno, os, signal, sys
from draftsmith.core import files
fd, name, mode = int(sys.argv[1]), sys.argv[2], sys.argv[3]

class Cut:
    def __init__(self, f):
        self.f, self.room = f, 4096
    def write(self, data):
        data = memoryview(data).cast("B")
        if len(data) <= self.room:
            self.room -= len(data)
            return self.f.write(data)
        self.f.write(data[: self.room])
        self.room = 0
        if mode == "full":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        os.write(fd, b"1")
        while True:
            signal.pause()
    def __getattr__(self, attr):
        return getattr(self.f, attr)
    def __enter__(self):
        return self
    def __exit__(self, *exc):
        self.f.close()

def cut_open(path, *args, **kwargs):
    f = open(path, *args, **kwargs)
    return Cut(f) if str(path).endswith(name) else f

files.open = cut_open
from draftsmith.extract.main import main
sys.exit(main(sys.argv[4:]))
"""


def interrupted(
    args: list[str], mode: str, stop: bool, started: Callable[[], None] | None = None
) -> tuple[int, str, str]:
    """Run extraction under INTERRUPT_MID_WRITE (``started()`` once it wrote its log);
    with ``stop``, send SIGTERM to its whole process group (as `timeout` does) once it is
    4096 bytes into shard 1. Returns (exit status, stdout, stderr)."""
    ready, signal_w = os.pipe()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            INTERRUPT_MID_WRITE,
            str(signal_w),
            "shard-00001.safetensors.tmp",
            mode,
            *args,
        ],  # fmt: skip
        pass_fds=(signal_w,),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    os.close(signal_w)
    if started is not None:
        log = Path(next(a for a in args if a.startswith("--output=")).split("=", 1)[1])
        while not (log / "extract.log").is_file() and proc.poll() is None:
            time.sleep(0.1)
        started()
    if stop:
        readable, _, _ = select.select([ready], [], [], 300)
        if not readable:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail(f"no shard 1 in 300 s:\n{proc.communicate()[1][-3000:]}")
        os.killpg(proc.pid, signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    os.close(ready)
    deadline = time.monotonic() + 30  # nothing of the run is left (vLLM included)
    while time.monotonic() < deadline and group_alive(proc.pid):
        time.sleep(0.2)
    left = subprocess.run(["ps", "-o", "pid,stat,cmd", "-g", str(proc.pid)],
                          capture_output=True, text=True).stdout  # fmt: skip
    assert not group_alive(proc.pid), left
    return proc.returncode, out, err


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def same_shards(a: Path, b: Path) -> None:
    """Every planned shard of ``b`` is in ``a``, byte for byte (by sha256), and ``a``
    holds nothing half written."""
    shards = [json.loads(p.read_text()) for p in sorted(b.glob("shard-*.json"))]
    assert shards and [json.loads(p.read_text())["sha256"] for p in sorted(a.glob("shard-*.json"))
                       ] == [s["sha256"] for s in shards]  # fmt: skip
    assert not list(a.rglob("*.tmp"))
    man = json.loads((a / "manifest.json").read_text())
    assert man["complete"] and [s["sha256"] for s in man["shards"]] == [s["sha256"] for s in shards]


@pytest.fixture(scope="module")
def whole_run(tmp_path_factory, tiny_model_dir) -> tuple[list[str], Path]:
    """The settings of the interruption tests (3 conversations, a shard each) and the
    dataset an uninterrupted run writes with them."""
    tmp = tmp_path_factory.mktemp("whole")
    data = write_jsonl(tmp / "chats.jsonl", CHATS)
    common = [f"--model={tiny_model_dir}", f"--data=[{data}]", "--samples_per_shard=1",
              "--dtype=float32"]  # fmt: skip
    extract([*common, f"--output={tmp / 'ds'}"])
    return common, tmp / "ds"


@pytest.mark.parametrize("mode", ["sigterm", "full disk"])
def test_a_stopped_extraction_keeps_whole_shards_and_the_rerun_completes(tmp_path, whole_run, mode):
    """SIGTERM mid-write of shard 1 (to the whole process group), or a full disk there:
    one line (exit 143 saying how many shards were written, or exit 2 naming the path and
    the free space), no traceback, shard 0 kept, nothing of shard 1 left, no process left;
    the same command run again completes the dataset byte for byte as an uninterrupted run."""
    common, whole = whole_run
    out = tmp_path / "ds"
    args = [*common, f"--output={out}"]
    code, stdout, stderr = interrupted(
        args, "pause" if mode == "sigterm" else "full", mode == "sigterm"
    )
    lines = stderr.strip().splitlines()
    if mode == "sigterm":
        assert code == 143, stderr[-3000:]
        assert lines == [
            f"draftsmith extract: stopped by SIGTERM; 1 of 3 shards written to {out}; run the "
            "same command again to go on"
        ]
    else:
        assert code == 2, stderr[-3000:]
        shard = out / "shard-00001.safetensors"
        assert len(lines) == 1 and lines[0].startswith(
            f"draftsmith extract: error: could not write shard {shard}: No space left on device"
        ), lines
        assert "GiB free on" in lines[0]
    log = (out / "extract.log").read_text()
    assert "Traceback" not in stdout + stderr + log
    assert shard_files(out) == {0: "shard-00000"} and not list(out.glob("shard-00001*"))
    assert not list(out.rglob("*.tmp"))
    extract(args)
    same_shards(out, whole)


def test_a_stopped_producer_leaves_the_stream_open_and_a_new_one_completes_it(tmp_path, whole_run):
    """A streamed run's producer gets SIGTERM mid-write of shard 1: one line, exit 143, the
    stream not failed (the trainer waits for another producer), nothing half written; a
    producer started again writes what is still wanted, the same shards as offline."""
    from draftsmith.dataset.stream import StreamDir

    common, whole = whole_run
    out = tmp_path / "ds"
    args = [*common, f"--output={out}", "--stream=true"]
    stream = StreamDir(out)
    # what a trainer asks for, once the producer made its output directory
    code, _, stderr = interrupted(args, "pause", True, lambda: stream.want(0, [0, 1, 2]))
    assert code == 143, stderr[-3000:]
    assert stderr.strip().splitlines() == [
        f"draftsmith extract: stopped by SIGTERM; 1 of 3 shards written to {out}; run the "
        "same command again to go on"
    ]
    assert stream.failure() is None and stream.producers()[0]["state"] == "stopped by SIGTERM"
    assert shard_files(out) == {0: "shard-00000"} and not list(out.rglob("*.tmp"))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    producer = subprocess.Popen(
        [sys.executable, "-m", "draftsmith.extract", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 300
        while len(shard_files(out)) < 3 and time.monotonic() < deadline:
            stream.want(0, [0, 1, 2])  # the trainer's heartbeat
            time.sleep(0.2)
    finally:
        stream.finish()
        output = producer.communicate(timeout=120)[0]
    assert producer.returncode == 0, output[-3000:]
    same_shards(out, whole)
