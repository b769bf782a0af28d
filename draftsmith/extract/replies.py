"""The replies a shard's samples were captured with, kept beside the dataset (``replies/``).

Two kinds are kept, both as token ids and loss masks (about 25 bytes a token in JSON,
against ~4,600 bytes of states for SmolLM2's four layers):

- sampled replies (``temperature > 0``): written by a plain engine before capture, since
  vLLM 0.32's capture method corrupts sampled decoding (see ``answer``);
- a streamed shard's greedy replies, kept at its first capture: when the shard is written
  again (policy ``recapture``, or a deleted shard a resumed trainer asks for) its states
  come from one prefill of those ids instead of answering every prompt again: on one core
  of this CPU, 290-307 s an epoch of the 2-hour recipe against 757 s for its first capture
  (docs/scaling.md); on a GPU, prefill against decoding.
"""

from __future__ import annotations

from pathlib import Path

from draftsmith.conversations.sources import SkipLog
from draftsmith.core.files import write_json_atomic
from draftsmith.core.readers import read_json
from draftsmith.extract.records import Item, Sequence


def path(output: Path, k: int) -> Path:
    """Shard ``k``'s replies ``{"sequences": [{id, input_ids, loss_mask, turn, shared}],
    "skipped"}``: sampled ones (written before capture), or a streamed shard's greedy ones
    (kept at its first capture, so a shard written again is captured by prefill alone)."""
    return output / "replies" / f"shard-{k:05d}.json"


def row(sid: str, ids: list[int], mask: list[int], turn, shared: int) -> dict:
    """One cached sequence: a sample's ids and loss mask, not its states."""
    return {"id": sid, "input_ids": ids, "loss_mask": mask, "turn": turn, "shared": shared}


def row_of(seq: Sequence) -> dict:
    """:func:`row` of a sequence."""
    sample = seq.sample
    return row(sample.id, list(seq.input_ids), list(seq.loss_mask), sample.turn, sample.shared)


def save(file: Path, rows: list[dict], skips: SkipLog) -> None:
    """Write one shard's sequences (see :func:`row`) and the samples its capture skipped."""
    file.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(file, {"sequences": rows, "skipped": skips.to_dict()})


def load(file: Path, by_id: dict[str, Item]) -> tuple[list[Sequence], SkipLog]:
    """The kept sequences of one shard (final: captured by prefill) and its skip log."""
    fix = f"delete {file}; the shard's replies are then generated again"
    data = read_json(file, "kept replies", fix, keys=("sequences", "skipped"))
    skips = SkipLog()
    for skipped in data["skipped"]["rows"]:
        skips.add(skipped["id"], None, skipped["reason"], skipped.get("detail", ""))
    skips.truncated = data["skipped"].get("truncated", 0)
    seqs = [Sequence(_item(by_id, r), r["input_ids"], r["loss_mask"]) for r in data["sequences"]]
    return seqs, skips


def _item(by_id: dict[str, Item], cached: dict) -> Item:
    """The item of one cached sequence (a turn item for a per-turn sample)."""
    item = by_id[cached["id"]]
    if cached.get("turn") is None or item.turn is not None:
        return item
    return item.for_turn(cached["turn"], cached.get("shared", 0))
