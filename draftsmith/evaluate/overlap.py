"""Guard against evaluating on training data: exact and near-duplicate prompt overlap.

An evaluation prompt overlaps the training data when a large share of its token n-grams
(``ngram`` tokens of its user turn, tokenised alone) appears inside ONE training sample
(any of its tokens: prompt or reply, whatever source it came from). Containment rather than
Jaccard, so a prompt pasted into a longer training conversation is caught too; a prompt
shorter than ``ngram`` tokens is one n-gram, so an exact copy of it still counts.

Work is linear in training tokens: n-grams are hashed with numpy, and each training
sample's hashes are matched against the evaluation hashes at once (``np.isin``).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from draftsmith.core.errors import DraftsmithError
from draftsmith.dataset.manifest import read_manifest

_MULT = np.uint64(0x9E3779B97F4A7C15)


class OverlapError(DraftsmithError):
    """Evaluation prompts found in the training data."""


def ngram_hashes(ids: Iterable[int] | np.ndarray, n: int) -> np.ndarray:
    """uint64 hashes of the length-``n`` windows of ``ids`` (one window if shorter)."""
    a = np.asarray(ids, dtype=np.uint64)
    if a.size == 0:
        return a
    n = min(n, a.size)
    windows = np.lib.stride_tricks.sliding_window_view(a, n)  # [len - n + 1, n]
    h = np.full(windows.shape[0], np.uint64(n), dtype=np.uint64)
    with np.errstate(over="ignore"):
        for j in range(n):
            h = (h ^ windows[:, j]) * _MULT
            h ^= h >> np.uint64(29)
    return h


@dataclass
class Match:
    dataset: str
    row: int  # 0-based row of the evaluation set
    eval_id: str
    train_id: str
    containment: float  # share of the prompt's n-grams found in that training sample


def find_overlap(
    eval_prompts: dict[str, list[tuple[str, list[int]]]],
    train_samples: Iterable[tuple[str, Iterable[int]]],
    ngram: int = 8,
    threshold: float = 0.5,
) -> tuple[list[Match], dict[str, list[float]]]:
    """Compare every evaluation prompt with every training sample.

    Args:
        eval_prompts: dataset -> [(id, token ids of the user turn)].
        train_samples: (id, token ids) of each training sample.
        ngram: tokens per n-gram.
        threshold: containment at or above which a prompt overlaps.
    Returns:
        (matches at or above ``threshold``, best one per prompt; per dataset, each prompt's
        highest containment in any one training sample).
    """
    owners: dict[int, list[tuple[str, int]]] = defaultdict(list)  # hash -> prompts holding it
    sizes: dict[tuple[str, int], int] = {}
    for name, prompts in eval_prompts.items():
        for row, (_, ids) in enumerate(prompts):
            grams = np.unique(ngram_hashes(ids, ngram))
            sizes[name, row] = grams.size
            for g in grams.tolist():
                owners[g].append((name, row))
    keys = np.fromiter(owners, dtype=np.uint64, count=len(owners))
    best: dict[tuple[str, int], tuple[float, str]] = {key: (0.0, "") for key in sizes}
    for train_id, ids in train_samples:
        grams = np.unique(ngram_hashes(list(ids), ngram))
        shared = grams[np.isin(grams, keys)]
        hits: dict[tuple[str, int], int] = defaultdict(int)
        for g in shared.tolist():
            for key in owners[g]:
                hits[key] += 1
        for key, n in hits.items():
            share = n / max(sizes[key], 1)
            if share > best[key][0]:
                best[key] = (share, train_id)
    matches = [
        Match(name, row, eval_prompts[name][row][0], train_id, round(share, 4))
        for (name, row), (share, train_id) in best.items()
        if share >= threshold
    ]
    scores = {
        name: [best[name, row][0] for row in range(len(p))] for name, p in eval_prompts.items()
    }
    return matches, scores


def user_turn_ids(tokenizer, chats: dict[str, list[list[dict]]], ids: dict[str, list[str]]):
    """dataset -> [(prompt id, token ids of its last user message, tokenised alone)]."""
    return {
        name: [
            (pid, tokenizer.encode(msgs[-1]["content"], add_special_tokens=False))
            for pid, msgs in zip(ids[name], convs, strict=True)
        ]
        for name, convs in chats.items()
    }


def check_overlap(
    train_data: str,
    eval_prompts: dict[str, list[tuple[str, list[int]]]],
    ngram: int,
    threshold: float,
) -> dict:
    """Raise ``OverlapError`` naming every overlapping prompt; else a summary for results.json."""
    dataset, unchecked = _training_samples(train_data)
    matches, scores = find_overlap(eval_prompts, dataset.token_ids(), ngram, threshold)
    if matches:
        lines = [
            f"  {m.dataset} row {m.row} ({m.eval_id}) ~ training sample {m.train_id}: "
            f"{m.containment:.0%} of its {ngram}-grams"
            for m in matches[:20]
        ]
        more = f"\n  ... and {len(matches) - 20} more" if len(matches) > 20 else ""
        raise OverlapError(
            f"train_data: {len(matches)} evaluation prompt(s) overlap {train_data} "
            f"(containment >= {threshold}); acceptance on them would be measured on training "
            f"data. Remove them from the training sources or evaluate other prompts:\n"
            + "\n".join(lines)
            + more
        )
    return {
        "train_data": train_data,
        "train_samples": len(dataset),
        "train_shards_unchecked": unchecked,
        "ngram": ngram,
        "threshold": threshold,
        "max_containment": {name: round(max(s, default=0.0), 4) for name, s in scores.items()},
    }


def _training_samples(train_data: str):
    """(the training dataset's samples on disk, shards trained but no longer on disk). A
    streamed dataset (``stream/``) is read as far as it was written; under the policies
    ``drop`` and ``recapture`` its shards were deleted after use and cannot be checked."""

    from draftsmith.dataset import HiddenStatesDataset, open_dataset
    from draftsmith.dataset.stream import STREAM_DIR

    root = Path(train_data)
    if not (root / STREAM_DIR).is_dir():
        return open_dataset(train_data), 0
    listed = read_manifest(root / "manifest.json")["shards"]
    present = [info for info in listed if (root / info["file"]).is_file()]
    dataset = HiddenStatesDataset(root, check_shards=False, shard_infos=present)
    return dataset, len(listed) - len(present)
