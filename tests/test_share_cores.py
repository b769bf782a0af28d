"""Sharing one CPU machine's cores between a streamed trainer and its producer."""

from __future__ import annotations

import socket
import time

import torch

from draftsmith.core.cores import producer_cores
from draftsmith.core.files import write_json_atomic
from draftsmith.dataset.stream import StreamDir
from draftsmith.train.share_cores import ShareCores


def test_the_producer_gets_the_upper_half_of_the_cores():
    assert producer_cores({0, 1}) == {1}
    assert producer_cores({0, 1, 2, 3, 4}) == {2, 3, 4}
    assert producer_cores({3}) is None  # one core: nothing to split


def test_training_takes_the_cores_a_writing_producer_leaves_and_all_while_it_waits(
    tmp_path, monkeypatch
):
    stream = StreamDir(tmp_path)
    share = ShareCores(str(tmp_path))
    share.cores = {0, 1, 2, 3}
    assert share.threads_now() == 4  # no producer yet

    def beat(state: str, host: str = socket.gethostname()) -> None:
        body = {"worker": 0, "host": host, "cores": [2, 3], "time": time.time(), "state": state}
        write_json_atomic(stream.dir / "producer-w0.json", body)

    stream.dir.mkdir()
    beat("writing shard 3")
    assert stream.busy_cores() == {2, 3} and share.threads_now() == 2
    beat("waiting for the trainer")
    assert stream.busy_cores() == set() and share.threads_now() == 4
    beat("writing shard 4", host="another-host")
    assert share.threads_now() == 4  # a producer on another machine takes no core here
    beat("writing shard 4")
    calls: list[int] = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    share.threads = 4  # as while the producer waited
    share.on_train_batch_start(None, None, None, 0)
    assert calls == [2] and share.threads == 2 and share.switches == 1
    share.checked = 0.0  # next check: nothing changed, nothing set
    share.on_train_batch_start(None, None, None, 1)
    assert calls == [2]
