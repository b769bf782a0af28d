"""Write: one shard's captured samples to disk, the shard file first, then its sidecar.

The shard file (``dataset/shards.py``) appears whole or not at all; the sidecar written
after it (``shard-NNNNN.json``) records what the shard holds and what the pass counted
(samples skipped, conversations truncated, per-turn samples and the tokens they repeat),
and marks the shard done for a resumed run (``manifest.shard_done``). The manifest is
rebuilt from the sidecars afterwards.
"""

from __future__ import annotations

import time
from pathlib import Path

from draftsmith.conversations.sources import SkipLog
from draftsmith.core.files import write_json_atomic
from draftsmith.dataset.manifest import shard_name, sidecar_path
from draftsmith.dataset.shards import ShardInfo, write_shard
from draftsmith.extract.records import Captured


def write_entry(
    output: Path,
    k: int,
    samples: list[Captured],
    dtype: str,
    skips: SkipLog,
    captured_by: str,
    started: float,
) -> ShardInfo:
    """Write shard `k` of `samples` (hidden states stored as `dtype`) and its sidecar;
    `captured_by` says how the states came (``generation``: the target answered in the
    capturing pass; ``prefill``: every sequence was final before it); `started` is the
    shard's start on the monotonic clock."""
    counts = {
        "sample_tokens": [len(s.input_ids) for s in samples],  # packing, unread
        # Per-turn samples repeat their conversation's prefix: what is new in each.
        "turn_samples": sum(s.turn is not None for s in samples),
        "samples_by_turn": _by_turn(samples),
    }
    repeated = sum(s.shared for s in samples)
    info = write_shard(output / shard_name(k), [s.row() for s in samples], dtype)
    write_json_atomic(
        sidecar_path(output, k),
        {
            **info.to_dict(),
            **counts,
            "unique_tokens": info.tokens - repeated,
            "seconds": round(time.monotonic() - started, 3),
            "captured_by": captured_by,
            "skipped": skips.to_dict()["rows"],
            "truncated": skips.truncated,  # conversations cut to the rounds that fit
        },
    )
    return info


def _by_turn(samples: list[Captured]) -> dict[str, int]:
    """How many per-turn samples hold the k-th assistant turn, by k."""
    counts: dict[str, int] = {}
    for sample in samples:
        if sample.turn is not None:
            counts[str(sample.turn)] = counts.get(str(sample.turn), 0) + 1
    return counts
