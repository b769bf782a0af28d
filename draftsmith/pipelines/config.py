"""The pipeline's config: one YAML whose sections are stage configs, and command-line
overrides of any key at any depth (``--train.model.lr 3e-4``).

``parse_pipeline`` is what ``draftsmith pipeline`` and ``draftsmith study`` parse with.
"""

from __future__ import annotations

import dataclasses
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from draftsmith.core.config import merge, parse_config, section_overrides, set_dotted
from draftsmith.core.errors import DraftsmithError
from draftsmith.core.readers import read_yaml
from draftsmith.pipelines.commands import PIPELINE

STAGES = PIPELINE


SECTIONS = (*STAGES, "validation")  # the YAML's sections that are stage configs


class PipelineError(DraftsmithError):
    """The pipeline's config cannot work; the message names the option and the fix."""


@dataclass
class PipelineConfig:
    """Run extract -> train -> export -> evaluate for one target, resumably."""

    model: str = "smollm2-135m"
    """The target (directory, hub id or short name); given to extract and eval."""
    output: str = "outputs/pipeline/smollm2"
    """Run directory: every artifact of every stage lives under it (layout in the docs).
    A file, or a non-empty directory no pipeline or study wrote, is refused."""
    overwrite: bool = False
    """Write into `output` even if it is a file or a directory the pipeline did not write."""
    data: str | None = None
    """An extracted dataset to train on instead of running the extract stage (its
    manifest's hash stands in for the stage's content address)."""
    extract: dict[str, Any] = field(default_factory=dict)
    """`draftsmith extract` options (configs/extract/*.yaml); model and output are filled in."""
    train: dict[str, Any] = field(default_factory=dict)
    """`draftsmith train fit` config (configs/train/*.yaml); paths are filled in."""
    validation: dict[str, Any] = field(default_factory=dict)
    """`draftsmith extract` options of a separate validation dataset, merged over the
    extract section (all but `keep_replies`), e.g. {data: sharegpt@heldout, limit: 40}: a
    held-out slice of a broad source answered by the target, so that training's simulated
    acceptance predicts serving. Written to ``<extract dir>/val`` before the training data
    (its seconds count in extract_share) and given to training as ``data.val_data``. Empty:
    training validates on a slice of its own data (train.data.val_fraction)."""
    stream: dict[str, Any] = field(default_factory=dict)
    """Train while extraction writes (train's ``data.stream``: shards, policy,
    producer_timeout), e.g. {shards: 4}: after the validation set, a producer process
    (``draftsmith extract --stream true``) writes the shards the trainer asks for, never
    more than ``shards`` ahead, and training reads them shard by shard as they complete.
    Under time_budget training gets extract_share + train_share, and the producer closes
    the data at extract_share (no new shards; training goes on over those). On a CPU
    machine the producer gets half the cores and training the rest, all of them while the
    producer waits. Empty: offline (extract, then train). docs/scaling.md."""
    export: dict[str, Any] = field(default_factory=dict)
    """`draftsmith export` options: num_speculative_tokens, dtype."""
    eval: dict[str, Any] = field(default_factory=dict)
    """`draftsmith eval` options (configs/eval/*.yaml); model, head and output are filled in."""
    time_budget: str | None = None
    """Wall-clock budget of the whole run, "DD:HH:MM:SS" like trainer.max_time. When set,
    each stage gets a share: extraction stops starting shards at ``extract_share`` of it
    (the data shrinks, whole shards), training runs for ``train_share`` of it plus any
    seconds extraction left unused (fixed whatever the hour: a slow machine gets less
    data, never less training), and the evaluation has the rest: it uses fewer prompts per
    set (never shorter replies) when ``eval_engine_cost`` predicts it would overrun, and
    suffix decoding is skipped when it would. Needs the extract stage (not ``data:``)."""
    extract_share: float = 0.30
    """Share of time_budget extraction may use (engine starts and prompt writing included)."""
    train_share: float = 0.40
    """Share of time_budget training gets at least (trainer.max_time), less TRAIN_STARTUP_S."""
    eval_engine_cost: float = 1.0
    """Under time_budget: one evaluation engine's seconds per prompt, per second a sample
    took to extract in this run (its shards regenerate replies at serving length on an
    engine already running, so they measure this hour's speed without a cold start). When
    the engines would overrun what the budget has left, the optional baseline (suffix)
    runs only if time remains, and each prompt set is cut (``eval.limit``, never below
    EVAL_MIN_PROMPTS); replies keep ``eval.max_tokens``. 0 turns the prediction off.
    Measured: docs/head-quality.md."""
    eval_engine_start_s: float = 30.0
    """Under time_budget: seconds an evaluation engine takes besides its prompts (start,
    warm-up, shutdown), which cutting prompts does not save."""
    stop_after: Literal["extract", "train", "export", "eval"] = "eval"
    """Last stage to run."""
    dry_run: bool = False
    """Parse and resolve every section with its stage's parser, print the plan, run nothing."""


def seconds_of(duration: str) -> float:
    """Seconds of "DD:HH:MM:SS" (leading fields optional: "MM:SS", "HH:MM:SS")."""
    try:
        parts = [float(p) for p in duration.split(":")]
    except ValueError:
        parts = []
    if not 1 <= len(parts) <= 4 or any(p < 0 for p in parts):
        raise PipelineError(f"time_budget={duration!r}: expected DD:HH:MM:SS")
    return sum(p * unit for p, unit in zip(reversed(parts), (1, 60, 3600, 86400), strict=False))


def read_yaml_mapping(path: Path, option: str) -> dict:
    """A YAML file that must hold a mapping (``key: value`` lines); one line otherwise."""
    fix = f"fix {option}: key: value lines, as in configs/pipelines/smollm2.yaml"
    return read_yaml(path, "yaml config", fix)


def parse_pipeline(args: list[str] | None) -> PipelineConfig:
    """Parse like every stage; the four sections are stage configs (class_path loggers and
    strategies included) that pass through verbatim to their stage, which parses them.

    ``--config`` files apply in order, then ``--<stage>.<key> VALUE`` overrides at any
    depth (``--train.model.lr 3e-4``, ``--extract.data prompts.jsonl``)."""
    args = list(sys.argv[1:] if args is None else args)
    args, overrides = section_overrides(args, SECTIONS)
    sections: dict[str, dict] = {name: {} for name in SECTIONS}
    rest, tmp_files = [], []
    i = 0
    while i < len(args):
        arg = args[i]
        path = None
        if arg == "--config" and i + 1 < len(args):
            path, i = args[i + 1], i + 1
        elif arg.startswith("--config="):
            path = arg.split("=", 1)[1]
        if path is None:
            rest.append(arg)
        else:
            if not Path(path).is_file():
                raise PipelineError(f"--config: {path} does not exist")
            raw = read_yaml_mapping(Path(path), "--config")
            for name in SECTIONS:
                if name in raw:
                    sections[name] = merge(sections[name], raw.pop(name) or {})
            with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
                yaml.safe_dump(raw, f)
            tmp_files.append(f.name)
            rest += ["--config", f.name]
        i += 1
    try:
        cfg = parse_config(PipelineConfig, rest, prog="draftsmith pipeline")
    finally:
        for name in tmp_files:
            Path(name).unlink(missing_ok=True)
    for dotted, value in overrides.items():
        set_dotted(sections, dotted, value)
    if not cfg.model:
        raise PipelineError(
            "model: not given; pass --model DIR (a Hugging Face model "
            "directory), a hub id, or smollm2-135m"
        )
    return dataclasses.replace(cfg, **sections)
