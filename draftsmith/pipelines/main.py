"""`draftsmith pipeline`: extract -> train -> export -> evaluate from one YAML.

    draftsmith pipeline --config configs/pipelines/smollm2.yaml
    draftsmith pipeline --config configs/pipelines/smollm2.yaml --output outputs/run1
    draftsmith pipeline --config configs/pipelines/smollm2.yaml --dry_run true

Each section is the config of its stage, as in ``configs/<stage>/``: the pipeline fills in
the paths that chain the stages, parses the section once with the stage's own parser and
hands the stage that typed config in memory (``<stage dir>/stage.yaml`` is written for the
record, never read back). Stage directories are content-addressed,
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
import importlib
import io
import logging
import sys
import time
from pathlib import Path
from typing import Any

from draftsmith.core.config import parse_section
from draftsmith.core.console import say, stage_log
from draftsmith.core.cores import producer_cores
from draftsmith.core.engine import shared_engines
from draftsmith.core.errors import DraftsmithError, exit_code
from draftsmith.core.files import write_json_atomic
from draftsmith.core.outputs import PIPELINE_OWN, check_output
from draftsmith.core.readers import read_json
from draftsmith.pipelines.commands import COMMANDS
from draftsmith.pipelines.config import (
    STAGES,
    PipelineConfig,
    PipelineError,
    parse_pipeline,
    seconds_of,
)
from draftsmith.pipelines.producer import Producer
from draftsmith.pipelines.stage_dirs import (
    DONE,
    RERUN_STAGE,
    Plan,
    eval_prompts,
    record,
    shard_seconds_per_sample,
    train_time,
)


def stage_config(stage: str, section: dict[str, Any]) -> Any:
    """The stage's typed config, parsed once from its section in memory (the train stage's
    section goes as it is to its LightningCLI, which parses it when the stage runs)."""
    command = COMMANDS[stage]
    if command.config is None:
        return section
    with _named(stage):
        config = parse_section(command.config_class(), section, prog=f"draftsmith {stage}")
        if stage == "eval":  # what vLLM would refuse, refused before hours of work
            from draftsmith.evaluate.main import check_ranges

            check_ranges(config)
        elif stage == "extract":
            from draftsmith.extract.main import check_config

            check_config(config)
        return config


def run_stage(stage: str, config: Any) -> int:
    """Run one stage in this process on its parsed config; its errors propagate, prefixed
    with the stage."""
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
    """Parse every section with its stage's parser and check it against the target's
    config where it can be read (nothing runs, nothing is written)."""
    from draftsmith.pipelines.checks import check_against_target

    for line in check_against_target(plan.cfg):  # the target's facts first: the cheapest
        say(line)
    for stage in STAGES:
        if stage == "extract" and plan.cfg.data:
            continue
        if stage == "extract" and plan.val_dir() is not None:
            stage_config("extract", plan.validation_section())
        section = plan.section(stage)
        if stage == "train":
            from draftsmith.train.main import run_stage as train_stage

            with _named(stage), _quiet_lightning():
                train_stage(fit(section), dry_run=True)
        else:
            stage_config(stage, section)
        say(f"{stage:8s} ok  -> {plan.dirs[stage]}")


@contextlib.contextmanager
def _quiet_lightning():
    """Keep Lightning's seeding and banner lines out of a dry run's output."""
    loggers = [logging.getLogger(name) for name in ("lightning.fabric", "lightning.pytorch")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.WARNING)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def run(cfg: PipelineConfig) -> dict[str, Any]:
    """Run (or resume) the pipeline; return the state written to pipeline.json."""
    from draftsmith.core.targets import read_target
    from draftsmith.pipelines.checks import check_refusals

    check_refusals(cfg, read_target(cfg.model))  # tappable, kind, baselines: before any engine
    plan = Plan(cfg)
    out = check_output(cfg.output, "output", PIPELINE_OWN, overwrite=cfg.overwrite)
    last = STAGES.index(cfg.stop_after)
    configs: dict[str, Any] = {}  # each stage's config, parsed once
    for stage in ("extract", "export", "eval"):  # bad options fail before hours of work
        if not (stage == "extract" and cfg.data) and STAGES.index(stage) <= last:
            configs[stage] = stage_config(stage, plan.section(stage))
    if plan.val_dir() is not None and not cfg.data:
        configs["validation"] = stage_config("extract", plan.validation_section())
    out.mkdir(parents=True, exist_ok=True)
    state_file = out / "pipeline.json"
    state: dict[str, Any] = {"config": cfg.__dict__, "stages": {}}
    run_started = time.monotonic()
    producer: Producer | None = None
    for stage in STAGES[: last + 1]:
        if stage == "eval" and cfg.time_budget:  # fewer prompts when the hour is slow
            used = time.monotonic() - run_started
            left = max(seconds_of(cfg.time_budget) - used, 60.0)
            plan.eval_time_limit = round(left)
            _cut_evaluation(plan, configs["eval"], left, state)
            configs["eval"] = dataclasses.replace(
                configs["eval"], time_limit=plan.eval_time_limit,
                limit=plan.eval_limit or configs["eval"].limit, output=str(plan.dirs["eval"]),
            )  # fmt: skip
        d = plan.dirs[stage]
        entry = {"dir": str(d), "hash": plan.hashes[stage]}
        if stage == "extract" and cfg.data:
            state["stages"][stage] = {**entry, "status": "given", "seconds": 0.0}
            say(f"pipeline: extract skipped: training on {d}")
            continue
        if stage == "extract" and cfg.stream and not (plan.dirs["train"] / DONE).is_file():
            producer = _start_streaming(plan, configs, state, entry)
            write_json_atomic(state_file, state)
            continue
        if (d / DONE).is_file():
            done = read_json(d / DONE, "stage record", RERUN_STAGE, keys=("seconds",))
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
        # The validation set and the data share one engine; it shuts down (and logs that)
        # into the stage's log, like everything else the stage's libraries print.
        try:
            with stage_log(d / f"{stage}.log"), shared_engines():
                if stage == "extract" and "validation" in configs:
                    _validation_set(plan, configs)
                config = _late_fields(stage, plan, configs)
                record(d, plan.section(stage))
                code = run_stage(stage, config)
        finally:
            if stage == "train" and producer is not None:  # training over: so is producing
                _end_streaming(plan, producer, state)
                producer = None
        seconds = round(time.monotonic() - started, 1)
        status = "done" if not code else f"failed (exit {code})"
        state["stages"][stage] = {**entry, "status": status, "seconds": seconds}
        write_json_atomic(state_file, state)
        if code:
            raise PipelineError(f"{stage} failed (exit {code}); its log: {d / (stage + '.log')}")
        write_json_atomic(d / DONE, {"seconds": seconds})
        say(f"pipeline: {stage} done in {seconds:.0f} s{_budget_left(cfg, run_started)}")
    if producer is not None:  # stop_after: extract on a streamed run
        _end_streaming(plan, producer, state)
        write_json_atomic(state_file, state)
    if last == STAGES.index("eval"):
        report = plan.dirs["eval"] / "report.md"
        (out / "summary.md").write_text(report.read_text() if report.is_file() else "")
    return state


def _validation_set(plan: Plan, configs: dict[str, Any]) -> None:
    started = time.monotonic()
    say(f"pipeline: validation set -> {plan.val_dir()}")
    record(plan.val_dir(), plan.validation_section())
    run_stage("extract", configs["validation"])
    plan.validation_seconds = time.monotonic() - started


def _start_streaming(plan: Plan, configs: dict[str, Any], state: dict, entry: dict) -> Producer:
    """The extract stage of a streamed run: the validation set now, then a producer that
    writes the training data as the train stage asks for it (``producer.py``)."""
    d = plan.dirs["extract"]
    say(f"pipeline: extract -> {d} (streamed: at most {plan.cfg.stream.get('shards', 4)} "
        "shards ahead of training)")  # fmt: skip
    if "validation" in configs:
        with stage_log(d / "extract.log"), shared_engines():
            _validation_set(plan, configs)
    record(d, plan.section("extract"))
    import torch

    producer = Producer(d)  # on a CPU machine, on half its cores (train/share_cores.py)
    producer.start(None if torch.cuda.is_available() else producer_cores())
    seconds = round(plan.validation_seconds, 1)  # the producer's own time overlaps training
    state["stages"]["extract"] = {**entry, "status": "streaming", "seconds": seconds}
    return producer


def _end_streaming(plan: Plan, producer: Producer, state: dict) -> None:
    seconds = producer.stop()
    d = plan.dirs["extract"]
    entry = state["stages"]["extract"]
    entry.update(status="streamed", producer_seconds=seconds)
    code = producer.proc.returncode if producer.proc else None
    if code == 0:  # the dataset is as training left it (policy: shards kept or dropped)
        write_json_atomic(d / DONE, {"seconds": entry["seconds"], "streamed": True})
    else:
        entry["status"] = f"streamed (producer exit {code}; log {d / 'producer.log'})"


def _late_fields(stage: str, plan: Plan, configs: dict[str, Any]) -> Any:
    """A stage's parsed config with what is known only now: extraction's time left after
    the validation set, the checkpoint training chose. The train stage's section is built
    now (its max_time and resume point are known now) and parsed by its LightningCLI."""
    if stage == "train":
        return fit(plan.section("train"))
    config = configs[stage]
    if stage == "extract" and config.time_limit is not None:
        return dataclasses.replace(config, time_limit=plan.section("extract")["time_limit"])
    if stage == "export":
        return dataclasses.replace(config, checkpoint=str(plan.checkpoint()))
    return config


def fit(section: dict[str, Any]) -> dict[str, Any]:
    """The train stage's LightningCLI input for its ``fit`` section, in memory."""
    return {"subcommand": "fit", "fit": section}


def _cut_evaluation(plan: Plan, section: Any, left: float, state: dict[str, Any]) -> None:
    """Decide the evaluation's prompts per set from this run's extraction speed."""
    measured = shard_seconds_per_sample(plan.dirs["extract"])
    if measured is None:
        return
    per_sample, extract_tokens = measured
    counts = prompt_counts(section)
    limit, accounting = eval_prompts(plan.cfg, section, per_sample, left, counts, extract_tokens)
    plan.set_eval_limit(limit)
    state.setdefault("budget", {}).update(accounting, eval_left_s=round(left))
    predicted = accounting["eval_predicted_s"]
    if limit is None:
        say(f"pipeline: time_budget: {left:.0f} s left; {accounting['eval_engines']} engines "
            f"at {section.max_tokens} tokens per reply: about {predicted:.0f} s")  # fmt: skip
        return
    optional = accounting["eval_engines_optional"]
    rest = ", suffix only if time is left" if optional else ""
    say(f"pipeline: time_budget: {left:.0f} s left; {accounting['eval_engines']} engines on "
        f"{sum(counts)} prompts would take about {predicted:.0f} s: {limit} prompts per set, "
        f"replies kept at {section.max_tokens} tokens{rest}")  # fmt: skip


def prompt_counts(section: Any) -> list[int]:
    """Prompts each of the evaluation's sets holds, after its ``limit``."""
    from draftsmith.conversations.sources import SkipLog, load_many

    counts = []
    for spec in section.datasets:
        n = len(load_many([spec], require_assistant=False, skips=SkipLog(), limit=section.limit))
        counts.append(n)
    return counts


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


def main(args: list[str] | None = None) -> int:
    return exit_code("draftsmith pipeline", lambda: _main(args))


def _main(args: list[str] | None) -> int:
    cfg = parse_pipeline(args)
    if cfg.dry_run:
        dry_run(Plan(cfg))
        return 0
    state = run(cfg)
    say(summary(state))
    evaluation = state["stages"].get("eval", {})
    results = Path(evaluation.get("dir", "")) / "results.json"
    if results.is_file():
        from draftsmith.evaluate.report import summary_table

        if evaluation["status"] == "skipped":  # a run that evaluated printed its table above
            say(summary_table(read_json(results, "stage record", RERUN_STAGE, keys=("runs",))))
        plots = ", ".join(sorted(p.name for p in results.parent.glob("*.png")))
        say(f"report: {results.parent / 'report.md'} (plots: {plots or 'none'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
