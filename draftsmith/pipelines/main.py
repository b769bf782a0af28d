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

import dataclasses
import hashlib
import json
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from draftsmith.config import parse_config
from draftsmith.extract.store import write_json_atomic

STAGES = ("extract", "train", "export", "eval")
DONE = ".done.json"
TRAIN_STARTUP_S = 30.0  # train-stage seconds outside trainer.max_time: imports, setup, last save


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
    export: dict[str, Any] = field(default_factory=dict)
    """`draftsmith export` options: num_speculative_tokens, dtype."""
    eval: dict[str, Any] = field(default_factory=dict)
    """`draftsmith eval` options (configs/eval/*.yaml); model, head and output are filled in."""
    time_budget: str | None = None
    """Wall-clock budget of the whole run, "DD:HH:MM:SS" like trainer.max_time. When set,
    the train stage's trainer.max_time becomes what is left of it after extraction, less
    the evaluation's expected seconds (eval_per_extract x the extract stage's seconds) and
    TRAIN_STARTUP_S: a slower machine trains for less instead of overrunning, a faster
    one trains longer. Needs the extract stage (not ``data:``)."""
    eval_per_extract: float = 0.9
    """Expected eval-stage seconds per extract-stage second under time_budget. Both stages
    are vLLM generation on the same machine, so their ratio holds across machine speeds
    for one config; measure it from pipeline.json (the demo: 0.83 to 1.04, configured 1.05)."""
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
        if cfg.data:
            manifest = Path(cfg.data) / "manifest.json"
            if not manifest.is_file():
                raise SystemExit(f"pipeline: data: {cfg.data} has no manifest.json; extract first")
            h_extract = dataset_address(manifest)
        else:
            h_extract = digest("extract", cfg.model, cfg.extract)
        if cfg.time_budget:
            seconds_of(cfg.time_budget)  # a malformed budget fails before anything runs
            if cfg.data:
                raise SystemExit(
                    "pipeline: time_budget needs the extract stage (its seconds estimate the "
                    "evaluation's), but data: is given; set train.trainer.max_time instead"
                )
        budget = [cfg.time_budget, cfg.eval_per_extract] if cfg.time_budget else []
        h_train = digest("train", h_extract, cfg.train, *budget)
        h_export = digest("export", h_train, cfg.export)
        h_eval = digest("eval", h_export, cfg.model, cfg.eval)
        self.hashes = dict(extract=h_extract, train=h_train, export=h_export, eval=h_eval)
        names = dict(extract="extract", train="train", export="head", eval="eval")
        self.dirs = {s: out / f"{names[s]}-{self.hashes[s]}" for s in STAGES}
        if cfg.data:
            self.dirs["extract"] = Path(cfg.data)
        self.train_max_time: str | None = None  # set by run() under time_budget

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
        elif stage == "train":
            section = _merge(
                cfg.train,
                {
                    "trainer": {"default_root_dir": str(d)},
                    "data": {"data": str(self.dirs["extract"])},
                    "checkpoint": {"dirpath": str(d / "checkpoints")},
                },
            )
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
        raise SystemExit(f"pipeline: time_budget={duration!r}: expected DD:HH:MM:SS")
    return sum(p * unit for p, unit in zip(reversed(parts), (1, 60, 3600, 86400), strict=False))


def train_time(cfg: PipelineConfig, extract_seconds: float) -> tuple[str, dict[str, float]]:
    """trainer.max_time under ``cfg.time_budget``, and the accounting behind it."""
    budget = seconds_of(cfg.time_budget or "")
    eval_s = cfg.eval_per_extract * extract_seconds
    left = int(budget - extract_seconds - eval_s - TRAIN_STARTUP_S)
    if left < 60:
        raise SystemExit(
            f"pipeline: time_budget={cfg.time_budget!r}: extraction took "
            f"{extract_seconds:.0f} s and the evaluation should take {eval_s:.0f} s, leaving "
            f"{left} s to train (< 60); raise time_budget or shrink extract.data / eval.limit"
        )
    d, rest = divmod(left, 86400)
    h, rest = divmod(rest, 3600)
    max_time = f"{d:02d}:{h:02d}:{rest // 60:02d}:{rest % 60:02d}"
    accounting = {"budget_s": budget, "extract_s": extract_seconds, "eval_estimate_s": eval_s}
    return max_time, {**accounting, "train_max_time_s": float(left)}


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        out[key] = _merge(out.get(key) or {}, value) if isinstance(value, dict) else value
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


def stage_main(stage: str):
    """The ``main`` of a stage module (imported late: vLLM and Lightning are heavy)."""
    if stage == "extract":
        from draftsmith.extract.main import main
    elif stage == "train":
        from draftsmith.train.main import main
    elif stage == "export":
        from draftsmith.train.checkpoint import main
    else:
        from draftsmith.evaluate.main import main
    return main


def dry_run(plan: Plan) -> None:
    """Parse every section with its stage's parser (nothing runs)."""
    from draftsmith.evaluate.config import EvalConfig
    from draftsmith.extract.config import ExtractConfig
    from draftsmith.train.checkpoint import ExportConfig

    parsers = {"extract": ExtractConfig, "export": ExportConfig, "eval": EvalConfig}
    for stage in STAGES:
        if stage == "extract" and plan.cfg.data:
            continue
        args = plan.stage_args(stage)
        if stage == "train":
            import contextlib
            import io

            with contextlib.redirect_stdout(io.StringIO()):
                try:
                    stage_main("train")([*args, "--print_config"])
                except SystemExit as done:
                    if done.code:
                        raise
        else:
            parse_config(parsers[stage], args, prog=f"draftsmith {stage}")
        print(f"{stage:8s} ok  -> {plan.dirs[stage]}")


def run(cfg: PipelineConfig) -> dict[str, Any]:
    """Run (or resume) the pipeline; return the state written to pipeline.json."""
    plan = Plan(cfg)
    out = Path(cfg.output)
    out.mkdir(parents=True, exist_ok=True)
    state_file = out / "pipeline.json"
    state: dict[str, Any] = {"config": cfg.__dict__, "stages": {}}
    last = STAGES.index(cfg.stop_after)
    for stage in STAGES[: last + 1]:
        d = plan.dirs[stage]
        entry = {"dir": str(d), "hash": plan.hashes[stage]}
        if stage == "extract" and cfg.data:
            state["stages"][stage] = {**entry, "status": "given", "seconds": 0.0}
            print(f"pipeline: extract skipped: training on {d}")
            continue
        if (d / DONE).is_file():
            done = json.loads((d / DONE).read_text())
            state["stages"][stage] = {**entry, "status": "skipped", "seconds": done["seconds"]}
            print(f"pipeline: {stage} is up to date ({d})")
            write_json_atomic(state_file, state)
            continue
        if stage == "train" and cfg.time_budget:
            extract_s = state["stages"]["extract"]["seconds"]
            plan.train_max_time, state["budget"] = train_time(cfg, extract_s)
            print(f"pipeline: time_budget {cfg.time_budget}: train for {plan.train_max_time}")
        print(f"pipeline: {stage} -> {d}")
        started = time.monotonic()
        code = stage_main(stage)(plan.stage_args(stage))
        seconds = round(time.monotonic() - started, 1)
        status = "done" if not code else f"failed (exit {code})"
        state["stages"][stage] = {**entry, "status": status, "seconds": seconds}
        write_json_atomic(state_file, state)
        if code:
            raise SystemExit(f"pipeline: {stage} failed with exit code {code}; see above")
        write_json_atomic(d / DONE, {"seconds": seconds})
    if last == STAGES.index("eval"):
        report = plan.dirs["eval"] / "report.md"
        (out / "summary.md").write_text(report.read_text() if report.is_file() else "")
    return state


def summary(state: dict[str, Any]) -> str:
    rows = [f"{'stage':8s} {'status':10s} {'seconds':>8s}  directory"]
    for stage, e in state["stages"].items():
        rows.append(f"{stage:8s} {e['status']:10s} {e['seconds']:8.1f}  {e['dir']}")
    return "\n".join(rows)


def parse_pipeline(args: list[str] | None) -> PipelineConfig:
    """Parse like every stage, except that the four sections pass through verbatim: they
    are stage configs (class_path loggers and strategies included), parsed by the stage."""
    args = list(sys.argv[1:] if args is None else args)
    sections: dict[str, dict] = {name: {} for name in STAGES}
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
            raw = yaml.safe_load(Path(path).read_text()) or {}
            for name in STAGES:
                if name in raw:
                    sections[name] = _merge(sections[name], raw.pop(name) or {})
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
    return dataclasses.replace(cfg, **sections)


def main(args: list[str] | None = None) -> int:
    cfg = parse_pipeline(args)
    if cfg.dry_run:
        dry_run(Plan(cfg))
        return 0
    state = run(cfg)
    print(summary(state))
    results = Path(state["stages"].get("eval", {}).get("dir", "")) / "results.json"
    if results.is_file():
        from draftsmith.evaluate.report import summary_table

        print(summary_table(json.loads(results.read_text())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
