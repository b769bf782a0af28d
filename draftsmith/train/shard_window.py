"""The first shards a shard-order run opens (``data.order: shards``; ``shard_order.py``).

Before training starts the data module needs some data: the draft vocabulary, the
schedule's length and the ``val_fraction`` split come from the first ``fit_shards`` shards.
Offline they are read from the manifest; streaming, the trainer waits for the producer's
plan and for those shards (asking for them), and a stream closed by a producer's time limit
counts only the shards it holds.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from draftsmith.dataset import DatasetError, HiddenStatesDataset, open_dataset
from draftsmith.dataset.manifest import read_manifest
from draftsmith.dataset.stream import StreamDir, StreamOptions, planned_shards, sidecar


def listed_shards(data: str | Path) -> dict[int, dict[str, Any]]:
    """Shard index -> manifest entry, for every shard of a finished dataset."""
    shards = read_manifest(Path(data) / "manifest.json")["shards"]
    return {int(Path(info["file"]).stem.split("-")[1]): info for info in shards}


def open_window(
    data: str,
    fit_shards: int | None,
    stream: StreamOptions | None,
    dtype: torch.dtype,
    check_shards: bool,
) -> tuple[HiddenStatesDataset, list[int], dict[int, dict[str, Any]] | None]:
    """(the first ``fit_shards`` shards as a dataset, every shard index to train, the
    shards' manifest entries offline / None streaming).

    Offline: the shards written (a dataset stopped by its time limit trains the whole
    shards it has). Streaming: every planned shard; this waits for the producer's plan and
    for the window's shards (asking for them), within ``stream.producer_timeout``."""
    root, listed = Path(data), None
    if stream is None:
        open_dataset(data, dtype=dtype, check_shards=False)  # checks the whole dataset once
        listed = {k: v for k, v in listed_shards(data).items() if v["sample_ids"]}
        all_shards = sorted(listed)
        count = len(all_shards) if fit_shards is None else fit_shards
    else:
        stream.check()
        streams = StreamDir(root)
        streams.want(0, [])  # the trainer is here: a waiting producer sees it
        planned = streams.wait_until(
            lambda: planned_shards(root) if (root / "plan.json").is_file() else None,
            "the producer's plan.json", stream.producer_timeout,
        )  # fmt: skip
        all_shards = list(range(len(planned)))
        count = stream.shards if fit_shards is None else fit_shards
        if count > stream.shards:
            raise DatasetError(
                f"data.fit_shards: {count} > data.stream.shards {stream.shards}: the trainer "
                "would wait for more shards than the producer may write; give at most "
                f"{stream.shards}"
            )
    if count < 1 or not all_shards:
        raise DatasetError(f"data.fit_shards: {count}; give at least 1 (dataset {data})")
    window = all_shards[:count]
    if stream is not None:
        cut = streams.closed()  # a resumed run: the producer's time limit cut the data
        window = [k for k in all_shards if cut is None or k in cut][:count]
        streams.want(0, window)
        window = [k for k in window  # a shard the stream was closed without drops out
                  if streams.wait_for(k, stream.producer_timeout,
                                      stop=lambda: streams.want(0, window))]  # fmt: skip
        # The producer writes a shard, its sidecar, then the manifest: wait for the last.
        streams.wait_until(lambda: (root / "manifest.json").is_file() or None,
                           "the producer's manifest.json", stream.producer_timeout)  # fmt: skip
    infos = [listed[k] if listed is not None else sidecar(root, k) for k in window]
    ds = HiddenStatesDataset(root, dtype, check_shards=check_shards, shard_infos=infos)
    return ds, all_shards, listed
