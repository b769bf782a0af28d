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

from draftsmith.dataset.manifest import read_manifest
from draftsmith.pipelines.config import (
    STAGES,
    PipelineConfig,
    PipelineError,
    merge,
    seconds_of,
)

DONE = ".done.json"  # a finished stage's marker: {"seconds": ...}
RERUN_STAGE = "delete that stage's directory; the same command then runs the stage again"
TRAIN_STARTUP_S = 30.0  # train-stage seconds outside trainer.max_time: imports, setup, last save
EVAL_MIN_PROMPTS = 10  # per set: a cut evaluation keeps at least this many prompts


def digest(*parts: Any) -> str:
    blob = json.dumps(parts, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:12]


def dataset_address(manifest_path: Path) -> str:
    """Content address of an extracted dataset: its tapped layers and shard checksums.

    Not the manifest's bytes: re-running an up-to-date extraction rewrites the manifest
    (with any config fields a newer draftsmith added), and that must not orphan the runs
    trained on the same shards."""
    manifest = read_manifest(manifest_path, strict=False)
    sums = [shard.get("sha256") for shard in manifest.get("shards", [])]
    if not sums or None in sums:  # no checksums to go by: the manifest is all we have
        return hashlib.sha256(manifest_path.read_bytes()).hexdigest()[:12]
    return digest("data", manifest.get("layer_ids"), sums)


class Plan:
    """Stage directories and the arguments each stage's ``main`` receives."""

    def __init__(self, cfg: PipelineConfig) -> None:
        self.cfg, out = cfg, Path(cfg.output)
        self.layers_of = kind_picking_layers(cfg)
        self._layer_ids: list[int] | None = None
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
            if self.layers_of:  # the kind's own taps (MTP: layer N alone)
                h_extract = digest(h_extract, {"layer_ids_of": self.layers_of})
            if cfg.validation:  # the validation set lives in the extract stage's directory
                h_extract = digest(h_extract, cfg.validation)
            if cfg.stream:  # a streamed dataset may end without its shards (drop, recapture)
                h_extract = digest(h_extract, {"stream": cfg.stream})
        if cfg.time_budget:
            seconds_of(cfg.time_budget)  # a malformed budget fails before anything runs
            if not (0 < cfg.extract_share and 0 < cfg.train_share
                    and cfg.extract_share + cfg.train_share < 1):  # fmt: skip
                raise PipelineError(
                    f"extract_share={cfg.extract_share}, train_share={cfg.train_share}: each "
                    "must be > 0 and together < 1 (the evaluation has the rest)"
                )
            if not (cfg.eval_engine_start_s >= 0 and cfg.eval_engine_cost >= 0):
                raise PipelineError(
                    f"eval_engine_start_s={cfg.eval_engine_start_s}, eval_engine_cost="
                    f"{cfg.eval_engine_cost}: both must be >= 0 (cost 0: no prediction)"
                )
            if cfg.data:
                raise PipelineError(
                    "time_budget shares the run between the stages, but data: skips "
                    "extraction; set train.trainer.max_time instead"
                )
        if cfg.stream and cfg.data:
            raise PipelineError(
                f"stream: {cfg.stream} trains while extraction writes, but data: {cfg.data} "
                "skips extraction; drop one of them"
            )
        budget = [cfg.time_budget, cfg.train_share] if cfg.time_budget else []
        streamed = [{"stream": cfg.stream}] if cfg.stream else []
        h_train = digest("train", h_extract, cfg.train, *budget, *streamed)
        h_export = digest("export", h_train, cfg.export)
        h_eval = digest("eval", h_export, cfg.model, cfg.eval)
        self.hashes = dict(extract=h_extract, train=h_train, export=h_export, eval=h_eval)
        names = dict(extract="extract", train="train", export="head", eval="eval")
        self.dirs = {s: out / f"{names[s]}-{self.hashes[s]}" for s in STAGES}
        self.given = {"extract"} if cfg.data else set()  # stages whose output is given
        if cfg.data:
            self.dirs["extract"] = Path(cfg.data)
        self.train_max_time: str | None = None  # set by run() under time_budget
        self.eval_time_limit: float | None = None  # likewise: what the budget has left
        self.eval_limit: int | None = None  # likewise: prompts per set cut to fit that
        self.validation_seconds = 0.0  # set by run(): the validation set's extraction

    def val_dir(self) -> Path | None:
        """Where the validation dataset lives (None without a ``validation`` section)."""
        if not self.cfg.validation:
            return None
        return self.dirs["extract"] / "val"

    def validation_section(self) -> dict[str, Any]:
        """The extract stage's section for the validation dataset."""
        d = self.val_dir()
        assert d is not None
        # A mix of kept and regenerated replies is for training; validation measures the
        # target's own replies unless its section says otherwise.
        inherited = {k: v for k, v in self.cfg.extract.items() if k != "keep_replies"}
        section = {**inherited, **self.kind_layer_ids(), **self.cfg.validation}
        section.update(model=self.cfg.model, output=str(d))
        return section

    def kind_layer_ids(self) -> dict[str, list[int]]:
        """``{"layer_ids": ids}`` the kind taps when it picks its own (``layers_of``; read from
        the target's depth once), else ``{}``: extraction's default."""
        if not self.layers_of:
            return {}
        if self._layer_ids is None:
            from draftsmith import drafters
            from draftsmith.core.targets import read_target

            n = read_target(self.cfg.model).num_hidden_layers
            self._layer_ids = drafters.get(self.layers_of).extract_layer_ids(n)
        return {"layer_ids": list(self._layer_ids or [])}

    def checkpoint(self) -> Path:
        ckpts = self.dirs["train"] / "checkpoints"
        best = ckpts / "best.ckpt"
        return best if best.is_file() else ckpts / "last.ckpt"

    def runs(self, stage: str) -> bool:
        """Whether this run runs ``stage`` (extraction is skipped when ``data`` is given)."""
        return stage not in self.given

    def section(self, stage: str) -> dict[str, Any]:
        """``stage``'s config section with the paths and budget that chain the stages
        filled in, as known now."""
        return getattr(self, f"_{stage}_section")()

    def _extract_section(self) -> dict[str, Any]:
        cfg = self.cfg
        section = {**cfg.extract, **self.kind_layer_ids(), "model": cfg.model,
                   "output": str(self.dirs["extract"])}  # fmt: skip
        if cfg.time_budget:  # streamed: the producer closes the data there, training goes on
            left = cfg.extract_share * seconds_of(cfg.time_budget) - self.validation_seconds
            section["time_limit"] = max(left, 0.01)  # at least one shard: training needs data
        return section

    def _train_section(self) -> dict[str, Any]:
        """The train stage's ``fit`` section."""
        cfg, d = self.cfg, self.dirs["train"]
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
        if cfg.stream:
            section["data"]["stream"] = dict(cfg.stream)
        section["trainer"]["logger"] = _loggers(section["trainer"].get("logger"), d)
        if self.train_max_time:
            section["trainer"]["max_time"] = self.train_max_time
        last = d / "checkpoints" / "last.ckpt"
        if last.is_file():  # resume an interrupted run
            section["ckpt_path"] = str(last)
        return section

    def _export_section(self) -> dict[str, Any]:
        return {**self.cfg.export, "checkpoint": str(self.checkpoint()),
                "output": str(self.dirs["export"])}  # fmt: skip

    def _eval_section(self) -> dict[str, Any]:
        cfg = self.cfg
        section = {**cfg.eval, "model": cfg.model, "head": str(self.dirs["export"])}
        section.update(output=str(self.dirs["eval"]), train_data=str(self.dirs["extract"]))
        if self.eval_time_limit:  # the overlap guard reads train_data
            section["time_limit"] = self.eval_time_limit
        if self.eval_limit:
            section["limit"] = self.eval_limit
        return section

    def set_eval_limit(self, limit: int | None) -> None:
        """Cut the evaluation to ``limit`` prompts per set; its address includes the cut,
        so a rerun on another hour never reuses an evaluation of another size."""
        self.eval_limit = limit
        if limit is not None:
            self.hashes["eval"] = digest("eval", self.hashes["export"], self.cfg.model,
                                         self.cfg.eval, {"limit": limit})  # fmt: skip
            self.dirs["eval"] = Path(self.cfg.output) / f"eval-{self.hashes['eval']}"


def kind_picking_layers(cfg: PipelineConfig) -> str | None:
    """The training kind whose own layer ids the extraction taps
    (``Drafter.extract_layer_ids``: MTP reads layer N alone), when the pipeline extracts and
    ``extract.layer_ids`` is not given; else None (an unknown kind: the train stage says so)."""
    if cfg.data or (cfg.extract or {}).get("layer_ids") is not None:
        return None
    from draftsmith import drafters

    kind = str(((cfg.train or {}).get("model") or {}).get("kind", "eagle3"))
    if kind not in drafters.names() or drafters.get(kind).extract_layer_ids(1) is None:
        return None
    return kind


def record(directory: Path, section: dict[str, Any]) -> None:
    """Write a stage's section to ``<dir>/stage.yaml``: for the record, never read back."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "stage.yaml").write_text(yaml.safe_dump(section, sort_keys=False))


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


def shard_seconds_per_sample(dataset: Path) -> tuple[float, int] | None:
    """(seconds per sample, max_new_tokens) of the dataset's extraction: the median over its
    shards of capture seconds per sample. Each shard regenerates replies with the engine
    already running, so it measures serving-length decoding on this machine without an
    engine start. None when no shard recorded its seconds."""
    manifest = dataset / "manifest.json"
    if not manifest.is_file():
        return None
    data = read_manifest(manifest, strict=False)
    rates = sorted(
        shard["seconds"] / shard["samples"]
        for shard in data.get("shards", [])
        if shard.get("seconds") and shard.get("samples")
    )
    if not rates:
        return None
    return rates[len(rates) // 2], int(data.get("config", {}).get("max_new_tokens") or 0)


def eval_prompts(
    cfg: PipelineConfig, section: Any, engine_counts: tuple[int, int], per_sample_s: float,
    left_s: float, prompts_per_set: list[int], extract_tokens: int = 0,
) -> tuple[int | None, dict]:  # fmt: skip
    """The evaluation's prompts per set under ``cfg.time_budget``, and the accounting.

    Replies stay at ``eval.max_tokens`` (serving length): methods are compared on replies
    as long as users get. Each engine is predicted to take ``cfg.eval_engine_start_s`` plus
    ``cfg.eval_engine_cost`` x ``per_sample_s`` per prompt, ``per_sample_s`` being this
    run's extraction seconds per sample (:func:`shard_seconds_per_sample`, scaled by
    ``eval.max_tokens / extract_tokens``), once per temperature of ``eval.temperatures``.
    When every engine fits ``left_s``, nothing
    changes. Otherwise each set is cut to the prompts with which every engine fits, suffix
    decoding's included (the baseline a user most needs to see), never below
    EVAL_MIN_PROMPTS. None: keep every prompt."""
    if not (per_sample_s and cfg.eval_engine_cost and prompts_per_set):
        return None, {}
    if extract_tokens:
        per_sample_s *= section.max_tokens / extract_tokens
    engines, optional = engine_counts  # the eval stage's own count (its `engines` hook)
    # Each engine decodes every prompt once per temperature.
    per_prompt = cfg.eval_engine_cost * per_sample_s * len(section.temperatures)
    asked = max(prompts_per_set)
    predicted = engines * (cfg.eval_engine_start_s + per_prompt * sum(prompts_per_set))
    if predicted <= left_s:
        fits = asked
    else:
        budget = left_s / engines - cfg.eval_engine_start_s  # decoding seconds per engine
        fits = int(budget / (per_prompt * len(prompts_per_set)))
    limit = min(asked, max(fits, EVAL_MIN_PROMPTS))
    accounting = {
        "eval_seconds_per_prompt": round(per_prompt, 2),
        "eval_engines": engines,
        "eval_engines_optional": optional,
        "eval_predicted_s": round(predicted, 1),
        "eval_prompts_per_set": [min(n, limit) for n in prompts_per_set],
        "eval_prompts_asked": prompts_per_set,
        "eval_max_tokens": section.max_tokens,
    }
    return (limit if limit < asked else None), accounting
