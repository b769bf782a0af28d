"""Streaming, trainer side: shard order, the disk bound, policies, exactly-once resume, ranks.

The producer here replays a finished dataset shard by shard through the same protocol
(``draftsmith.dataset.stream``) the real one speaks: it writes only what the trainer asks
for, file first and sidecar last. The real producer (vLLM) is in test_pipeline.py.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from helpers import one_thread

from draftsmith.core.files import write_json_atomic
from draftsmith.dataset.stream import StreamDir, shard_file, sidecar_file
from draftsmith.evaluate.overlap import check_overlap
from draftsmith.train.main import main as train_main

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "train" / "tiny.yaml"
PROMPTS = [f"Say something short about item {i}." for i in range(24)]


@pytest.fixture(scope="module")
def source(tmp_path_factory, tiny_model_dir, make_hf_dataset) -> Path:
    """A finished dataset in extract's layout: 6 shards of 4, plan.json and sidecars."""
    out = make_hf_dataset(
        tmp_path_factory.mktemp("src") / "ds", tiny_model_dir, PROMPTS, samples_per_shard=4
    )
    manifest = json.loads((out / "manifest.json").read_text())
    from draftsmith.dataset import open_dataset

    ds = open_dataset(out)
    lengths = iter(ds.lengths)
    for k, info in enumerate(manifest["shards"]):
        tokens = [next(lengths) for _ in info["sample_ids"]]
        write_json_atomic(out / sidecar_file(k), {**info, "sample_tokens": tokens})
    plan = {"fingerprint": {}, "samples_sha256": "", "skipped": {}}
    write_json_atomic(
        out / "plan.json", {**plan, "shards": [i["sample_ids"] for i in manifest["shards"]]}
    )
    return out


class Replay(threading.Thread):
    """A producer that copies the source's shards into ``dest`` as the trainer asks; with
    ``close_after``, it closes the stream after that many shards, as a time limit does."""

    def __init__(
        self, src: Path, dest: Path, die_after: int | None = None, close_after: int | None = None
    ) -> None:
        super().__init__(daemon=True)
        self.src, self.dest, self.die_after = src, dest, die_after
        self.close_after = close_after
        self.closed: set[int] | None = None
        self.stream = StreamDir(dest)
        self.written: list[int] = []
        self.asked: list[tuple[int, int]] = []  # (shard written, the epoch asking for it)
        self.high_water = 0  # most unconsumed shards on disk, counted as each is written
        self.halt = threading.Event()
        dest.mkdir(parents=True, exist_ok=True)
        for name in ("plan.json", "manifest.json"):
            shutil.copy(src / name, dest / name)

    def run(self) -> None:
        while not self.stream.finished() and not self.halt.is_set():
            self.stream.beat(0, state="waiting", tok_s=1000.0)
            if self.close_after is not None and len(set(self.written)) >= self.close_after:
                if self.closed is None:
                    self.closed = set(self.written)
                    self.stream.close(0, 1, sorted(self.closed))
            wanted = self.stream.wanted()
            todo = [k for k in wanted if not (self.dest / shard_file(k)).is_file()
                    and (self.closed is None or k in self.closed)]  # fmt: skip
            if not todo:
                time.sleep(0.05)
                continue
            if self.die_after is not None and len(self.written) >= self.die_after:
                return  # dies for good: no more heartbeats
            k = todo[0]
            # Unconsumed: on disk and still wanted (a shard read in full is deleted just
            # after the trainer stops asking for it; under recapture the list wraps to the
            # next epoch's first shards, so plan position alone cannot tell).
            ahead = {int(p.stem.split("-")[1]) for p in self.dest.glob("shard-*.safetensors")}
            ahead = {i for i in ahead if i in wanted} | {k}
            self.high_water = max(self.high_water, len(ahead))
            shutil.copy(self.src / shard_file(k), self.dest / shard_file(k))
            tmp = self.dest / (sidecar_file(k) + ".tmp")  # the sidecar last, atomically
            shutil.copy(self.src / sidecar_file(k), tmp)
            tmp.replace(self.dest / sidecar_file(k))
            self.written.append(k)
            self.asked.append(
                (k, json.loads((self.stream.dir / "want-r0.json").read_text()).get("epoch"))
            )


def fit(data: Path, out: Path, *extra: str) -> int:
    return train_main(
        [
            "fit",
            f"--config={TINY}",
            f"--data.data={data}",
            f"--trainer.default_root_dir={out}",
            f"--checkpoint.dirpath={out / 'ckpt'}",
            "--data.batch_size=1",
            "--data.order=shards",
            "--data.fit_shards=2",
            *extra,
        ]
    )


def head(out: Path) -> dict[str, torch.Tensor]:
    state = torch.load(out / "ckpt" / "last.ckpt", map_location="cpu", weights_only=False)
    return {k: v for k, v in state["state_dict"].items() if k.startswith("head.")}


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0, msg=key)


@pytest.fixture(scope="module")
def offline(source, tmp_path_factory) -> Path:
    """The reference: shard order on the finished dataset, two epochs."""
    out = tmp_path_factory.mktemp("offline")
    assert fit(source, out) == 0
    return out


def test_streamed_run_trains_the_offline_head_within_the_bound(source, offline, tmp_path):
    dest = tmp_path / "ds"
    producer = Replay(source, dest)
    producer.start()  # the loader in a worker process: the same head, the same position
    assert fit(dest, tmp_path / "run", "--data.stream.shards=2", "--data.num_workers=1") == 0
    producer.join(timeout=10)
    assert_same(head(tmp_path / "run"), head(offline))
    assert producer.high_water <= 2
    assert sorted(producer.written) == list(range(6))  # keep: the first epoch captured all
    summary = check_overlap(str(dest), {"set": [("p0", list(range(8)))]}, 4, 0.5)
    assert summary["train_samples"] == 24 and summary["train_shards_unchecked"] == 0
    ckpt = torch.load(tmp_path / "run" / "ckpt" / "last.ckpt", weights_only=False)
    position = ckpt["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]
    assert position["epoch"] == 1 and position["shards_done"] == list(range(6))


def test_a_closed_stream_trains_the_shards_written_as_offline(
    source, tmp_path, tiny_model_dir, make_hf_dataset
):
    """A producer's time limit closes the stream at the shards written: training goes on
    over those (recapture writes only those again), as over an offline dataset of them."""
    short = make_hf_dataset(tmp_path / "short", tiny_model_dir, PROMPTS[:12], samples_per_shard=4)
    steps = "--trainer.max_steps=1000"  # one LR schedule for both: the stream planned 6 shards
    assert fit(short, tmp_path / "offline", steps) == 0
    dest = tmp_path / "ds"
    producer = Replay(source, dest, close_after=3)
    producer.start()
    assert fit(dest, tmp_path / "run", "--data.stream.shards=2", steps,
               "--data.stream.policy=recapture", "--data.num_workers=1") == 0  # fmt: skip
    producer.join(timeout=10)
    assert_same(head(tmp_path / "run"), head(tmp_path / "offline"))
    assert set(producer.written) == {0, 1, 2}
    assert producer.written.count(2) == 2  # epoch 2 wrote it again; 0 and 1 hold validation
    ckpt = torch.load(tmp_path / "run" / "ckpt" / "last.ckpt", weights_only=False)
    position = ckpt["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]
    assert position["shards_done"] == [0, 1, 2]


def test_recapture_deletes_after_use_and_extracts_again(source, offline, tmp_path):
    dest = tmp_path / "ds"
    producer = Replay(source, dest)
    producer.start()
    assert fit(dest, tmp_path / "run", "--data.stream.shards=2",
               "--data.stream.policy=recapture") == 0  # fmt: skip
    producer.join(timeout=10)
    assert_same(head(tmp_path / "run"), head(offline))
    assert producer.high_water <= 2
    # Validation samples sit in the first two shards: those are kept, the rest written twice.
    assert sorted(producer.written) == [0, 1, 2, 2, 3, 3, 4, 4, 5, 5]
    assert not (dest / shard_file(5)).exists() and (dest / sidecar_file(5)).exists()


def test_recapture_asks_for_the_next_epochs_first_shards_while_the_epoch_ends(source, tmp_path):
    """The producer captures epoch 1's first shard again beside epoch 0's last, within the
    bound, and nothing is captured after the last epoch."""
    dest = tmp_path / "ds"
    producer = Replay(source, dest)
    producer.start()
    assert fit(dest, tmp_path / "run", "--data.stream.shards=2", "--data.val_fraction=0",
               "--data.stream.policy=recapture") == 0  # fmt: skip
    producer.join(timeout=10)
    assert sorted(producer.written) == sorted(list(range(6)) * 2)  # 2 epochs, no third
    # Epoch 1's first shard was asked for, and written again, while epoch 0 still read.
    assert [epoch for k, epoch in producer.asked if k == 0][1] == 0, producer.asked
    assert producer.high_water <= 2


def test_drop_trains_each_shard_once(source, tmp_path):
    dest = tmp_path / "ds"
    producer = Replay(source, dest)
    producer.start()
    assert fit(dest, tmp_path / "run", "--data.stream.shards=2",
               "--data.stream.policy=drop", "--data.val_fraction=0") == 0  # fmt: skip
    producer.join(timeout=10)
    ckpt = torch.load(tmp_path / "run" / "ckpt" / "last.ckpt", weights_only=False)
    assert ckpt["epoch"] == 0 or ckpt["epoch"] == 1  # ended after the first pass
    assert sorted(producer.written) == list(range(6))
    assert not any(dest.glob("shard-*.safetensors"))
    # The evaluation's overlap guard reads what is left, and says what it could not check.
    summary = check_overlap(str(dest), {"set": [("p0", list(range(8)))]}, 4, 0.5)
    assert summary["train_samples"] == 0 and summary["train_shards_unchecked"] == 6


def test_sigkilled_trainer_resumes_to_the_uninterrupted_head(source, offline, tmp_path):
    """The trainer is SIGKILLed mid-epoch while it streams; the resumed run trains the
    offline head (nothing trained twice, nothing skipped)."""
    dest, out, marker = tmp_path / "ds", tmp_path / "run", tmp_path / "step"
    producer = Replay(source, dest)
    producer.start()
    # A checkpoint every step (none monitored: the first validation comes after epoch 0).
    every = ["--checkpoint.every_n_train_steps=1", "--checkpoint.monitor=null",
             "--data.stream.shards=2"]  # fmt: skip
    args = [
        "fit", f"--config={TINY}", f"--data.data={dest}", f"--trainer.default_root_dir={out}",
        f"--checkpoint.dirpath={out / 'ckpt'}", "--data.batch_size=1", "--data.order=shards",
        "--data.fit_shards=2", *every, "--trainer.callbacks+=helpers.StepMarker",
        f"--trainer.callbacks.path={marker}",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT / "tests")}
    run = subprocess.Popen([sys.executable, "-m", "draftsmith.train", *args], cwd=ROOT, env=env)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and run.poll() is None:
        if marker.is_file() and marker.read_text().strip() and int(marker.read_text()) >= 5:
            run.send_signal(signal.SIGKILL)
            break
        time.sleep(0.02)
    assert run.wait(timeout=60) == -signal.SIGKILL
    ckpt = torch.load(out / "ckpt" / "last.ckpt", weights_only=False)
    assert ckpt["epoch"] == 0 and 4 <= ckpt["global_step"] < 12  # mid-epoch 0, streaming
    StreamDir(dest).reset()
    assert fit(dest, out, *every, f"--ckpt_path={out / 'ckpt' / 'last.ckpt'}") == 0
    producer.join(timeout=10)
    assert_same(head(out), head(offline))


def test_a_producer_that_dies_ends_the_run_in_one_line(source, tmp_path, capfd):
    dest = tmp_path / "ds"
    producer = Replay(source, dest, die_after=3)
    producer.start()
    code = fit(dest, tmp_path / "run", "--data.stream.shards=2",
               "--data.stream.producer_timeout=2")  # fmt: skip
    err = capfd.readouterr().err.strip().splitlines()
    assert code != 0
    assert "shard 3 never came" in err[-1] and "producer w0" in err[-1]


def test_two_ranks_consume_disjoint_shards(source, tmp_path):
    dest = tmp_path / "ds"
    producer = Replay(source, dest)
    producer.start()
    out = tmp_path / "ddp"
    args = [
        "fit", f"--config={TINY}", f"--data.data={dest}", f"--trainer.default_root_dir={out}",
        f"--checkpoint.dirpath={out / 'ckpt'}", "--data.batch_size=1", "--data.fit_shards=2",
        "--data.stream.shards=2", "--trainer.max_epochs=1", "--trainer.strategy=ddp",
        "--trainer.devices=2",
    ]  # fmt: skip
    run = subprocess.run([sys.executable, "-m", "draftsmith.train", *args], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    producer.join(timeout=10)
    assert run.returncode == 0, run.stderr[-3000:]
    ckpt = torch.load(out / "ckpt" / "last.ckpt", weights_only=False)
    position = ckpt["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]
    assert position["shards_done"] == [0, 2, 4]  # rank 0's; rank 1 took 1, 3, 5
    assert sorted(producer.written) == list(range(6))  # each shard written once


def test_the_wait_for_the_first_shards_counts_in_max_time():
    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import Timer

    from draftsmith.train.main import charge_wait

    capped = Trainer(max_time="00:00:10:00", logger=False, enable_progress_bar=False)
    assert "waited 120 s" in charge_wait(capped, 120.0)
    timer = next(c for c in capped.callbacks if isinstance(c, Timer))
    assert timer.time_remaining() == pytest.approx(480.0, abs=1.0)
    assert charge_wait(Trainer(logger=False, enable_progress_bar=False), 120.0) is None


def test_a_producers_time_limit_closes_the_stream_after_whole_shards(source, tmp_path, monkeypatch):
    """The real producer loop (``extract/producer.py``) with a stand-in for vLLM."""
    from types import SimpleNamespace

    from draftsmith.extract import producer

    monkeypatch.setattr(producer.manifest, "build_manifest", lambda *args: {})
    dest = tmp_path / "ds"
    dest.mkdir()
    shutil.copy(source / "plan.json", dest / "plan.json")
    planned = json.loads((source / "plan.json").read_text())["shards"]

    class Job:  # what extract's ShardJob gives the loop
        cfg = SimpleNamespace(worker=0, workers=1, trainer_timeout=30.0, time_limit=0.01)
        output, shards, target, layer_ids, config = dest, planned, None, None, None
        engine = SimpleNamespace(get=lambda: None, close=lambda: None)
        written: list[int] = []

        def extract(self, k: int) -> int:
            time.sleep(0.05)  # longer than the limit: the limit falls after the first shard
            shutil.copy(source / shard_file(k), dest / shard_file(k))
            shutil.copy(source / sidecar_file(k), dest / sidecar_file(k))
            self.written.append(k)
            return 100

    stream, job = StreamDir(dest), Job()
    stream.want(0, [0, 1, 2])

    def serve() -> None:
        with producer.Pulse(stream, 0) as pulse:
            producer.serve(job, pulse)

    loop = threading.Thread(target=serve, daemon=True)
    loop.start()
    deadline = time.monotonic() + 20
    try:
        while stream.closed() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert stream.closed() == {0}  # past the limit after its first shard: none starts
        (dest / shard_file(0)).unlink()  # recapture: a closed shard is written again
        stream.want(0, [0, 1, 2])
        while job.written.count(0) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        stream.finish()
        loop.join(timeout=10)
    assert not loop.is_alive() and job.written == [0, 0]


def test_a_producer_beats_while_it_prepares_and_a_raise_fails_the_stream(tmp_path):
    """Writing prompts or one long shard can outlast the trainer's producer_timeout: the
    heartbeat comes from a thread, and stops with the producer; an error at any point
    (here, before the first shard) stops the trainer naming it."""
    from draftsmith.core.errors import DatasetError
    from draftsmith.extract.producer import Pulse

    stream = StreamDir(tmp_path)
    with pytest.raises(DatasetError), Pulse(stream, 0, period=0.02) as pulse:
        pulse.set(state="writing 768 prompts")
        first = stream.producers()[0]
        time.sleep(0.3)  # no word from the producer's own code
        now = stream.producers()[0]
        assert now["time"] > first["time"] and now["state"] == "writing 768 prompts"
        raise DatasetError("data: p.jsonl row 3: no user turn")
    assert stream.failure() == "producer w0: data: p.jsonl row 3: no user turn"
    last = stream.producers()[0]["time"]
    time.sleep(0.1)
    assert stream.producers()[0]["time"] == last  # the beat stopped with the producer
    with pytest.raises(DatasetError, match="the producer stopped: producer w0: data: p.jsonl"):
        stream.wait_for(0, timeout=5.0)


def assert_same_batches(a: list[dict], b: list[dict]) -> None:
    """Same batches (the pool slot a worker filled, where it used one, aside)."""
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        x, y = ({k: v for k, v in d.items() if k != "pool_slot"} for d in (x, y))
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def test_streamed_batches_are_the_same_with_any_number_of_workers(source, tmp_path):
    """0 to 3 loader workers read a stream (policy drop): the offline batches in the same
    order, each shard asked for and written once, in plan order, within the bound, and
    deleted only once every worker is done with it."""
    from draftsmith.dataset.stream import StreamOptions
    from draftsmith.train.data import StatesDataModule

    kw = dict(row_tokens=96, batch_size=3, val_fraction=0.0, order="shards", fit_shards=2)
    offline = StatesDataModule(str(source), num_workers=0, **kw)
    plan = offline._shard_plan()
    # 2 batches a shard (3 rows, then 1): of 3 workers, 2 read each shard, 1 passes it by
    assert [plan.batches(k, plan.info(k)) for k in plan.shards] == [2] * 6
    reference = list(offline.train_dataloader())
    for workers in (0, 1, 2, 3):
        dest = tmp_path / f"w{workers}"
        producer = Replay(source, dest)
        producer.start()
        try:
            stream = StreamOptions(shards=2, policy="drop")
            dm = StatesDataModule(str(dest), num_workers=workers, stream=stream, **kw)
            got = list(dm.train_dataloader())
        finally:
            StreamDir(dest).finish()
            producer.join(timeout=10)
        assert_same_batches(got, reference)
        assert producer.written == list(range(6)) and producer.high_water <= 2, workers
        assert not any(dest.glob("shard-*.safetensors"))


@pytest.fixture(scope="module")
def one_worker(source, tmp_path_factory) -> Path:
    """Shard order on the finished dataset with 1 loader worker and 1 compute thread."""
    out = tmp_path_factory.mktemp("one-worker")
    with one_thread():
        assert fit(source, out, "--data.num_workers=1") == 0
    return out


def test_two_loader_workers_train_the_one_worker_head(source, one_worker, tmp_path):
    """Offline shard order with 2 workers: the head of 1 worker and of none, to the bit
    (only the reading moves; the training process and its one thread stay)."""
    with one_thread():
        assert fit(source, tmp_path / "two", "--data.num_workers=2") == 0
        assert fit(source, tmp_path / "none", "--data.num_workers=0") == 0
    assert_same(head(tmp_path / "two"), head(one_worker))
    assert_same(head(tmp_path / "none"), head(one_worker))


def test_two_loader_workers_resumed_mid_epoch_train_the_uninterrupted_head(
    source, one_worker, tmp_path
):
    """A crash in epoch 0 with 2 loader workers, a resume from the step before: the rest of
    epoch 0, then the whole of epoch 1 (the skip applies to the resumed pass only)."""
    out = tmp_path / "run"
    every = ["--checkpoint.every_n_train_steps=1", "--checkpoint.monitor=null",
             "--data.num_workers=2"]  # fmt: skip
    crash = ["--trainer.callbacks+=helpers.CrashAtStep", "--trainer.callbacks.step=3"]
    with one_thread():
        with pytest.raises(RuntimeError, match="simulated crash"):
            fit(source, out, *every, *crash)
        ckpt = torch.load(out / "ckpt" / "last.ckpt", weights_only=False)
        assert ckpt["epoch"] == 0 and ckpt["global_step"] == 2
        assert fit(source, out, *every, f"--ckpt_path={out / 'ckpt' / 'last.ckpt'}") == 0
    assert_same(head(out), head(one_worker))
