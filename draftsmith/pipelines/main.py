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
import importlib
import json
import sys
import time
from pathlib import Path
from typing import Any

from draftsmith.config import parse_config
from draftsmith.console import say, stage_log
from draftsmith.engine import shared_engines
from draftsmith.errors import DraftsmithError, exit_code
from draftsmith.files import write_json_atomic
from draftsmith.pipelines.config import (
    STAGES,
    PipelineConfig,
    PipelineError,
    parse_pipeline,
    seconds_of,
)
from draftsmith.pipelines.plan import DONE, Plan, eval_tokens, train_time
from draftsmith.stages import COMMANDS


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
        if stage == "eval" and cfg.time_budget:  # baselines that would overrun are skipped
            used = time.monotonic() - run_started
            left = max(seconds_of(cfg.time_budget) - used, 60.0)
            plan.eval_time_limit = round(left)
            section = stage_config("eval", plan.stage_args("eval"))
            plan.eval_max_tokens, accounting = eval_tokens(
                cfg, section, plan.validation_seconds, left
            )
            state.setdefault("budget", {}).update(accounting)
            if plan.eval_max_tokens and plan.eval_max_tokens < accounting["eval_max_tokens_asked"]:
                optional = accounting["eval_engines_optional"]
                rest = ", suffix only if time is left" if optional else ""
                say(f"pipeline: time_budget: {left:.0f} s left; {accounting['eval_engines']} "
                    f"engines at {accounting['eval_max_tokens_asked']} tokens per reply would "
                    f"take about {accounting['eval_predicted_s']:.0f} s: replies cut to "
                    f"{plan.eval_max_tokens} tokens{rest}")  # fmt: skip
        say(f"pipeline: {stage} -> {d}")
        started = time.monotonic()
        # The validation set and the data share one engine; it shuts down (and logs that)
        # into the stage's log, like everything else the stage's libraries print.
        with stage_log(d / f"{stage}.log"), shared_engines():
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
            say(summary_table(json.loads(results.read_text())))
        plots = ", ".join(sorted(p.name for p in results.parent.glob("*.png")))
        say(f"report: {results.parent / 'report.md'} (plots: {plots or 'none'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
