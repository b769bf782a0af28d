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

import sys
from pathlib import Path
from typing import Any

from draftsmith.core.console import say
from draftsmith.core.errors import exit_code
from draftsmith.pipelines.commands import COMMANDS
from draftsmith.pipelines.config import STAGES, parse_pipeline
from draftsmith.pipelines.runner import run
from draftsmith.pipelines.stage_dirs import Plan
from draftsmith.pipelines.stages import stage_config


def dry_run(plan: Plan) -> None:
    """Parse every section with its stage's parser and check it against the target's
    config where it can be read (nothing runs, nothing is written)."""
    from draftsmith.pipelines.checks import check_against_target

    for line in check_against_target(plan.cfg):  # the target's facts first: the cheapest
        say(line)
    if plan.val_dir() is not None and plan.runs("extract"):
        stage_config("extract", plan.validation_section())
    for stage in filter(plan.runs, STAGES):
        stage_config(stage, plan.section(stage))
        say(f"{stage:8s} ok  -> {plan.dirs[stage]}")


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
    for stage, entry in state["stages"].items():  # a stage that ran printed its own table
        hook = COMMANDS[stage].hook("summary")
        if hook and (text := hook(Path(entry["dir"]), entry["status"] == "done")):
            say(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
