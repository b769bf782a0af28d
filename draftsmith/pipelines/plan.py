"""Where each stage of a pipeline run lives and what it is given.

A stage's directory is content-addressed, ``<output>/<stage>-<hash>``: the hash covers its
section, the model and the upstream stage's hash, so a stage reruns only when its inputs or
config changed. Under ``time_budget`` the plan also carries each stage's share.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import yaml

from draftsmith.evaluate.checks import check_k
from draftsmith.evaluate.config import EvalConfig
from draftsmith.pipelines.config import (
    STAGES,
    PipelineConfig,
    PipelineError,
    merge,
    seconds_of,
)

DONE = ".done.json"  # a finished stage's marker: {"seconds": ...}
TRAIN_STARTUP_S = 30.0  # train-stage seconds outside trainer.max_time: imports, setup, last save
EVAL_MIN_TOKENS = 64  # per reply: shorter ones would measure the first sentence only


def digest(*parts: Any) -> str:
    blob = json.dumps(parts, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:12]


def dataset_address(manifest_path: Path) -> str:
    """Content address of an extracted dataset: its tapped layers and shard checksums.

    Not the manifest's bytes: re-running an up-to-date extraction rewrites the manifest
    (with any config fields a newer draftsmith added), and that must not orphan the runs
    trained on the same shards."""
    manifest = json.loads(manifest_path.read_text())
    sums = [shard.get("sha256") for shard in manifest.get("shards", [])]
    if not sums or None in sums:  # no checksums to go by: the manifest is all we have
        return hashlib.sha256(manifest_path.read_bytes()).hexdigest()[:12]
    return digest("data", manifest.get("layer_ids"), sums)


class Plan:
    """Stage directories and the arguments each stage's ``main`` receives."""

    def __init__(self, cfg: PipelineConfig) -> None:
        self.cfg, out = cfg, Path(cfg.output)
        if cfg.data and cfg.validation:
            raise PipelineError(
                "validation: extracts a validation set in the extract stage, but data: skips "
                "that stage; set train.data.val_data to a validation dataset instead"
            )
        if cfg.data:
            manifest = Path(cfg.data) / "manifest.json"
            if not manifest.is_file():
                raise PipelineError(f"data: {cfg.data} has no manifest.json; extract first")
            h_extract = dataset_address(manifest)
        else:
            budget = [cfg.time_budget, cfg.extract_share] if cfg.time_budget else []
            h_extract = digest("extract", cfg.model, cfg.extract, *budget)
            if cfg.validation:  # the validation set lives in the extract stage's directory
                h_extract = digest(h_extract, cfg.validation)
        if cfg.time_budget:
            seconds_of(cfg.time_budget)  # a malformed budget fails before anything runs
            if not (0 < cfg.extract_share and 0 < cfg.train_share
                    and cfg.extract_share + cfg.train_share < 1):  # fmt: skip
                raise PipelineError(
                    f"extract_share={cfg.extract_share}, train_share={cfg.train_share}: each "
                    "must be > 0 and together < 1 (the evaluation has the rest)"
                )
            if not (0 <= cfg.eval_fixed_share < 1 and cfg.eval_engine_cost >= 0):
                raise PipelineError(
                    f"eval_fixed_share={cfg.eval_fixed_share}, eval_engine_cost="
                    f"{cfg.eval_engine_cost}: the share must be in [0, 1) (some of an engine's "
                    "seconds follow its replies' length) and the cost >= 0 (0: no prediction)"
                )
            if cfg.data:
                raise PipelineError(
                    "time_budget shares the run between the stages, but data: skips "
                    "extraction; set train.trainer.max_time instead"
                )
        budget = [cfg.time_budget, cfg.train_share] if cfg.time_budget else []
        h_train = digest("train", h_extract, cfg.train, *budget)
        h_export = digest("export", h_train, cfg.export)
        h_eval = digest("eval", h_export, cfg.model, cfg.eval)
        self.hashes = dict(extract=h_extract, train=h_train, export=h_export, eval=h_eval)
        names = dict(extract="extract", train="train", export="head", eval="eval")
        self.dirs = {s: out / f"{names[s]}-{self.hashes[s]}" for s in STAGES}
        if cfg.data:
            self.dirs["extract"] = Path(cfg.data)
        self.train_max_time: str | None = None  # set by run() under time_budget
        self.eval_time_limit: float | None = None  # likewise: what the budget has left
        self.eval_max_tokens: int | None = None  # likewise: eval.max_tokens cut to fit that
        self.validation_seconds = 0.0  # set by run(): the validation set's extraction

    def val_dir(self) -> Path | None:
        """Where the validation dataset lives (None without a ``validation`` section)."""
        if not self.cfg.validation:
            return None
        return self.dirs["extract"] / "val"

    def validation_args(self) -> list[str]:
        """The extract stage's arguments for the validation dataset (writes its stage.yaml)."""
        d = self.val_dir()
        assert d is not None
        d.mkdir(parents=True, exist_ok=True)
        # A mix of kept and regenerated replies is for training; validation measures the
        # target's own replies unless its section says otherwise.
        inherited = {k: v for k, v in self.cfg.extract.items() if k != "keep_replies"}
        section = {**inherited, **self.cfg.validation}
        section.update(model=self.cfg.model, output=str(d))
        (d / "stage.yaml").write_text(yaml.safe_dump(section, sort_keys=False))
        return [f"--config={d / 'stage.yaml'}"]

    def checkpoint(self) -> Path:
        ckpts = self.dirs["train"] / "checkpoints"
        best = ckpts / "best.ckpt"
        return best if best.is_file() else ckpts / "last.ckpt"

    def stage_args(self, stage: str) -> list[str]:
        """The argument list for ``stage``'s main (writes its stage.yaml)."""
        cfg, d = self.cfg, self.dirs[stage]
        d.mkdir(parents=True, exist_ok=True)
        if stage == "extract":
            section = {**cfg.extract, "model": cfg.model, "output": str(d)}
            if cfg.time_budget:
                left = cfg.extract_share * seconds_of(cfg.time_budget) - self.validation_seconds
                section["time_limit"] = max(left, 1.0)
        elif stage == "train":
            section = merge(
                cfg.train,
                {
                    "trainer": {"default_root_dir": str(d)},
                    "data": {"data": str(self.dirs["extract"])},
                    "checkpoint": {"dirpath": str(d / "checkpoints")},
                },
            )
            if self.val_dir() is not None:
                section["data"]["val_data"] = str(self.val_dir())
            section["trainer"]["logger"] = _loggers(section["trainer"].get("logger"), d)
            if self.train_max_time:
                section["trainer"]["max_time"] = self.train_max_time
        elif stage == "export":
            section = {**cfg.export, "checkpoint": str(self.checkpoint()), "output": str(d)}
        else:
            section = {**cfg.eval, "model": cfg.model, "head": str(self.dirs["export"])}
            section.update(output=str(d), train_data=str(self.dirs["extract"]))  # overlap guard
            if self.eval_time_limit:
                section["time_limit"] = self.eval_time_limit
            if self.eval_max_tokens:
                section["max_tokens"] = self.eval_max_tokens
        stage_yaml = d / "stage.yaml"
        stage_yaml.write_text(yaml.safe_dump(section, sort_keys=False))
        if stage == "train":
            args = ["fit", f"--config={stage_yaml}"]
            last = d / "checkpoints" / "last.ckpt"
            return [*args, f"--ckpt_path={last}"] if last.is_file() else args
        return [f"--config={stage_yaml}"]


def train_time(cfg: PipelineConfig, extract_seconds: float) -> tuple[str, dict[str, float]]:
    """trainer.max_time under ``cfg.time_budget``, and the accounting behind it: the
    train share, plus what extraction left of its share, less TRAIN_STARTUP_S."""
    budget = seconds_of(cfg.time_budget or "")
    unused = max(cfg.extract_share * budget - extract_seconds, 0.0)
    left = int(cfg.train_share * budget + unused - TRAIN_STARTUP_S)
    if left < 60:
        raise PipelineError(
            f"time_budget={cfg.time_budget!r} with train_share={cfg.train_share} leaves "
            f"{left} s to train (< 60); raise time_budget or train_share"
        )
    d, rest = divmod(left, 86400)
    h, rest = divmod(rest, 3600)
    max_time = f"{d:02d}:{h:02d}:{rest // 60:02d}:{rest % 60:02d}"
    accounting = {"budget_s": budget, "extract_s": extract_seconds, "extract_unused_s": unused}
    eval_s = budget - extract_seconds - left - TRAIN_STARTUP_S
    return max_time, {**accounting, "train_max_time_s": float(left), "eval_left_s": eval_s}


def _loggers(logger: Any, run_dir: Path) -> Any:
    """Point every configured logger's save_dir into the stage directory."""
    if logger in (None, False, True):
        return logger
    items = logger if isinstance(logger, list) else [logger]
    fixed = []
    for item in items:
        item = dict(item)
        item["init_args"] = {**item.get("init_args", {}), "save_dir": str(run_dir)}
        fixed.append(item)
    return fixed


def eval_engines(section: EvalConfig) -> tuple[int, int]:
    """(engines the evaluation starts, how many of them a time limit may skip), counted by
    the evaluation's own plan."""
    from draftsmith.evaluate.runs import plan_methods, skippable_under_time_limit  # torch

    methods = plan_methods(section, check_k(section.k))
    return len(methods), sum(map(skippable_under_time_limit, methods))


def eval_tokens(
    cfg: PipelineConfig, section: EvalConfig, validation_s: float, left_s: float
) -> tuple[int | None, dict]:
    """eval.max_tokens under ``cfg.time_budget`` for the eval stage's parsed ``section``,
    and the accounting behind it.

    Each engine is predicted to take ``cfg.eval_engine_cost`` x ``validation_s`` (this
    run's validation-set extraction, the same work every run) at the configured
    max_tokens, of which ``cfg.eval_fixed_share`` does not shrink with shorter replies.
    When every engine fits, nothing changes. Otherwise the replies are cut so that the
    engines a time limit cannot skip fit ``left_s`` (suffix then runs only if time is
    left), to EVAL_MIN_TOKENS at least. Replies, not prompts: an engine decodes its
    prompts together, so its seconds follow the number of decoding steps (13 prompts took
    as long as 20). None: keep the configured length (nothing measured to predict from)."""
    asked = section.max_tokens
    if not (validation_s and cfg.eval_engine_cost):
        return None, {}
    engines, optional = eval_engines(section)
    per_engine = cfg.eval_engine_cost * validation_s
    fixed, decode = per_engine * cfg.eval_fixed_share, per_engine * (1 - cfg.eval_fixed_share)
    predicted = engines * per_engine
    required = engines - optional
    fits = asked if predicted <= left_s else int(asked * (left_s / required - fixed) / decode)
    n = min(asked, max(fits, min(EVAL_MIN_TOKENS, asked)))
    accounting = {
        "validation_s": round(validation_s, 1),
        "eval_engines": engines,
        "eval_engines_optional": optional,
        "eval_predicted_s": round(predicted, 1),
        "eval_max_tokens": n,
        "eval_max_tokens_asked": asked,
    }
    return n, accounting
