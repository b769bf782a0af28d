"""`draftsmith pipeline`: extract -> train -> export -> evaluate from one YAML.

    draftsmith pipeline --config configs/pipelines/smollm2.yaml
    draftsmith pipeline --config configs/pipelines/smollm2.yaml --output outputs/run1
    draftsmith pipeline --config configs/pipelines/smollm2.yaml --dry_run true

Each section is the config of its stage, as in ``configs/<stage>/``: the pipeline writes it
to ``<stage dir>/stage.yaml`` and calls that stage's ``main`` on it, filling in the paths
that chain the stages. Stage directories are content-addressed,
``<output>/<stage>-<hash>``, the hash covering the section, the model and the upstream
stage's hash: a stage reruns only when its inputs or config changed, and a finished stage
(``.done.json``) is skipped. Interrupted stages resume: extract from its finished shards,
train from ``checkpoints/last.ckpt``. Layout of ``<output>``::

    pipeline.json          stage -> directory, hash, status, seconds (updated as it goes)
    extract-<hash>/        the dataset (manifest.json, shards), stage.yaml
    train-<hash>/          checkpoints/{best,last}.ckpt, lightning_logs/, config.yaml
    head-<hash>/           the exported head: config.json, model.safetensors, README.md
    eval-<hash>/           results.json, report.md, plots, generations.jsonl
    summary.md             the acceptance table of the last evaluation
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib
import json
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from draftsmith.config import parse_config
from draftsmith.console import say
from draftsmith.errors import DraftsmithError, exit_code
from draftsmith.files import write_json_atomic
from draftsmith.stages import COMMANDS, PIPELINE

STAGES = PIPELINE
SECTIONS = (*STAGES, "validation")  # the YAML's sections that are stage configs
DONE = ".done.json"
TRAIN_STARTUP_S = 30.0  # train-stage seconds outside trainer.max_time: imports, setup, last save


class PipelineError(DraftsmithError):
    """The pipeline's config cannot work; the message names the option and the fix."""


@dataclass
class PipelineConfig:
    """Run extract -> train -> export -> evaluate for one target, resumably."""

    model: str = "smollm2-135m"
    """The target (directory, hub id or short name); given to extract and eval."""
    output: str = "outputs/pipeline/smollm2"
    """Run directory: every artifact of every stage lives under it (layout in the docs)."""
    data: str | None = None
    """An extracted dataset to train on instead of running the extract stage (its
    manifest's hash stands in for the stage's content address)."""
    extract: dict[str, Any] = field(default_factory=dict)
    """`draftsmith extract` options (configs/extract/*.yaml); model and output are filled in."""
    train: dict[str, Any] = field(default_factory=dict)
    """`draftsmith train fit` config (configs/train/*.yaml); paths are filled in."""
    validation: dict[str, Any] = field(default_factory=dict)
    """`draftsmith extract` options of a separate validation dataset, merged over the
    extract section, e.g. {data: sharegpt@heldout, limit: 40}: a held-out slice of a broad
    source answered by the target, so that training's simulated acceptance predicts
    serving. Written to ``<extract dir>/val`` before the training data (its seconds count
    in extract_share) and given to training as ``data.val_data``. Empty: training validates
    on a slice of its own data (train.data.val_fraction)."""
    export: dict[str, Any] = field(default_factory=dict)
    """`draftsmith export` options: num_speculative_tokens, dtype."""
    eval: dict[str, Any] = field(default_factory=dict)
    """`draftsmith eval` options (configs/eval/*.yaml); model, head and output are filled in."""
    time_budget: str | None = None
    """Wall-clock budget of the whole run, "DD:HH:MM:SS" like trainer.max_time. When set,
    each stage gets a share: extraction stops starting shards at ``extract_share`` of it
    (the data shrinks, whole shards), training runs for ``train_share`` of it plus any
    seconds extraction left unused (fixed whatever the hour: a slow machine gets less
    data, never less training), and the evaluation has the rest; its cost is bounded by
    its prompt count (``eval.limit``). Needs the extract stage (not ``data:``)."""
    extract_share: float = 0.30
    """Share of time_budget extraction may use (engine starts and prompt writing included)."""
    train_share: float = 0.40
    """Share of time_budget training gets at least (trainer.max_time), less TRAIN_STARTUP_S."""
    stop_after: Literal["extract", "train", "export", "eval"] = "eval"
    """Last stage to run."""
    dry_run: bool = False
    """Parse and resolve every section with its stage's parser, print the plan, run nothing."""


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
        section = {**self.cfg.extract, **self.cfg.validation}
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
        stage_yaml = d / "stage.yaml"
        stage_yaml.write_text(yaml.safe_dump(section, sort_keys=False))
        if stage == "train":
            args = ["fit", f"--config={stage_yaml}"]
            last = d / "checkpoints" / "last.ckpt"
            return [*args, f"--ckpt_path={last}"] if last.is_file() else args
        return [f"--config={stage_yaml}"]


def seconds_of(duration: str) -> float:
    """Seconds of "DD:HH:MM:SS" (leading fields optional: "MM:SS", "HH:MM:SS")."""
    try:
        parts = [float(p) for p in duration.split(":")]
    except ValueError:
        parts = []
    if not 1 <= len(parts) <= 4 or any(p < 0 for p in parts):
        raise PipelineError(f"time_budget={duration!r}: expected DD:HH:MM:SS")
    return sum(p * unit for p, unit in zip(reversed(parts), (1, 60, 3600, 86400), strict=False))


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


def merge(base: dict, extra: dict) -> dict:
    """``base`` with ``extra`` merged in at every depth (``extra`` wins)."""
    out = dict(base)
    for key, value in extra.items():
        out[key] = merge(out.get(key) or {}, value) if isinstance(value, dict) else value
    return out


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


def stage_config(stage: str, args: list[str]) -> Any:
    """The stage's typed config parsed from ``args`` (the train stage: ``args`` as they are,
    for its LightningCLI)."""
    command = COMMANDS[stage]
    if command.config is None:
        return args
    with _named(stage):
        return parse_config(command.config_class(), args, prog=f"draftsmith {stage}")


def run_stage(stage: str, args: list[str]) -> int:
    """Run one stage in this process; its errors propagate, prefixed with the stage."""
    config = stage_config(stage, args)
    with _named(stage):
        return importlib.import_module(COMMANDS[stage].module).run_stage(config) or 0


@contextlib.contextmanager
def _named(stage: str):
    """Prefix a stage's DraftsmithError with the stage: the option is in its section."""
    try:
        yield
    except DraftsmithError as err:
        raise PipelineError(f"{stage}: {err}") from err


def dry_run(plan: Plan) -> None:
    """Parse every section with its stage's parser (nothing runs)."""
    for stage in STAGES:
        if stage == "extract" and plan.cfg.data:
            continue
        if stage == "extract" and plan.val_dir() is not None:
            stage_config("extract", plan.validation_args())
        args = plan.stage_args(stage)
        if stage == "train":
            import contextlib
            import io

            with contextlib.redirect_stdout(io.StringIO()):
                try:
                    COMMANDS["train"].main()([*args, "--print_config"])
                except SystemExit as done:
                    if done.code:
                        raise
        else:
            stage_config(stage, args)
        say(f"{stage:8s} ok  -> {plan.dirs[stage]}")


def run(cfg: PipelineConfig) -> dict[str, Any]:
    """Run (or resume) the pipeline; return the state written to pipeline.json."""
    plan = Plan(cfg)
    out = Path(cfg.output)
    out.mkdir(parents=True, exist_ok=True)
    state_file = out / "pipeline.json"
    state: dict[str, Any] = {"config": cfg.__dict__, "stages": {}}
    last = STAGES.index(cfg.stop_after)
    for stage in ("extract", "export", "eval"):  # bad options fail before hours of work
        if not (stage == "extract" and cfg.data) and STAGES.index(stage) <= last:
            stage_config(stage, plan.stage_args(stage))
    run_started = time.monotonic()
    for stage in STAGES[: last + 1]:
        d = plan.dirs[stage]
        entry = {"dir": str(d), "hash": plan.hashes[stage]}
        if stage == "extract" and cfg.data:
            state["stages"][stage] = {**entry, "status": "given", "seconds": 0.0}
            say(f"pipeline: extract skipped: training on {d}")
            continue
        if (d / DONE).is_file():
            done = json.loads((d / DONE).read_text())
            state["stages"][stage] = {**entry, "status": "skipped", "seconds": done["seconds"]}
            say(f"pipeline: {stage} is up to date ({d})")
            write_json_atomic(state_file, state)
            continue
        if stage == "train" and cfg.time_budget:
            extract_s = state["stages"]["extract"]["seconds"]
            plan.train_max_time, state["budget"] = train_time(cfg, extract_s)
            say(f"pipeline: time_budget {cfg.time_budget}: train for {plan.train_max_time}")
        say(f"pipeline: {stage} -> {d}")
        started = time.monotonic()
        if stage == "extract" and plan.val_dir() is not None:
            say(f"pipeline: validation set -> {plan.val_dir()}")
            run_stage("extract", plan.validation_args())
            plan.validation_seconds = time.monotonic() - started
        code = run_stage(stage, plan.stage_args(stage))
        seconds = round(time.monotonic() - started, 1)
        status = "done" if not code else f"failed (exit {code})"
        state["stages"][stage] = {**entry, "status": status, "seconds": seconds}
        write_json_atomic(state_file, state)
        if code:
            raise PipelineError(f"{stage} failed (exit {code}); its log: {d / (stage + '.log')}")
        write_json_atomic(d / DONE, {"seconds": seconds})
        say(f"pipeline: {stage} done in {seconds:.0f} s{_budget_left(cfg, run_started)}")
    if last == STAGES.index("eval"):
        report = plan.dirs["eval"] / "report.md"
        (out / "summary.md").write_text(report.read_text() if report.is_file() else "")
    return state


def _budget_left(cfg: PipelineConfig, started: float) -> str:
    if not cfg.time_budget:
        return ""
    used, budget = time.monotonic() - started, seconds_of(cfg.time_budget)
    return f"; {used / 60:.1f} of {budget / 60:.0f} budget minutes used"


def summary(state: dict[str, Any]) -> str:
    rows = [f"{'stage':8s} {'status':10s} {'seconds':>8s}  directory"]
    for stage, e in state["stages"].items():
        rows.append(f"{stage:8s} {e['status']:10s} {e['seconds']:8.1f}  {e['dir']}")
    return "\n".join(rows)


def section_overrides(args: list[str]) -> tuple[list[str], dict[str, Any]]:
    """Split ``--<stage>.<key...> VALUE`` (or ``=VALUE``) out of ``args``.

    Returns the other arguments and ``{"train.model.lr": 0.001, ...}``; values are read as
    YAML, so ``'[a.jsonl, b.jsonl]'`` is a list and ``3e-4`` a number."""
    rest: list[str] = []
    overrides: dict[str, Any] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        key, sep, value = arg[2:].partition("=") if arg.startswith("--") else ("", "", "")
        if key.split(".", 1)[0] in SECTIONS and "." in key:
            if not sep:
                if i + 1 >= len(args):
                    raise PipelineError(f"--{key}: no value given; write --{key} VALUE")
                value, i = args[i + 1], i + 1
            overrides[key] = yaml.safe_load(value) if value.strip() else value
        else:
            rest.append(arg)
        i += 1
    return rest, overrides


def set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    """Set ``tree["a"]["b"]["c"] = value`` for ``"a.b.c"``, creating the levels between."""
    *path, last = dotted.split(".")
    node = tree
    for key in path:
        if not isinstance(node.get(key), dict):
            node[key] = {}
        node = node[key]
    node[last] = value


def parse_pipeline(args: list[str] | None) -> PipelineConfig:
    """Parse like every stage; the four sections are stage configs (class_path loggers and
    strategies included) that pass through verbatim to their stage, which parses them.

    ``--config`` files apply in order, then ``--<stage>.<key> VALUE`` overrides at any
    depth (``--train.model.lr 3e-4``, ``--extract.data prompts.jsonl``)."""
    args = list(sys.argv[1:] if args is None else args)
    args, overrides = section_overrides(args)
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
            raw = yaml.safe_load(Path(path).read_text()) or {}
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


def main(args: list[str] | None = None) -> int:
    return exit_code("draftsmith pipeline", lambda: _main(args))


def _main(args: list[str] | None) -> int:
    cfg = parse_pipeline(args)
    if cfg.dry_run:
        dry_run(Plan(cfg))
        return 0
    state = run(cfg)
    say(summary(state))
    results = Path(state["stages"].get("eval", {}).get("dir", "")) / "results.json"
    if results.is_file():
        from draftsmith.evaluate.report import summary_table

        say(summary_table(json.loads(results.read_text())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
