"""One pipeline run: extract -> train -> export -> eval, each stage skipped when its directory
is done, run in this process otherwise, and recorded in ``pipeline.json`` as it goes.

What the pipeline adds around each stage, in its own step: extraction takes the validation
set first (one engine for both), or becomes a producer that streams shards to training; a
time budget gives training its share and cuts the evaluation's prompts to what is left.
Everything else about a stage (its options, checks, how it runs) is the stage's own
(``stages.py``, ``commands.COMMANDS``).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from draftsmith.core.console import say, stage_log
from draftsmith.core.cores import producer_cores
from draftsmith.core.engine import shared_engines
from draftsmith.core.files import write_json_atomic
from draftsmith.core.outputs import PIPELINE_OWN, check_output
from draftsmith.core.readers import read_json
from draftsmith.pipelines.commands import COMMANDS
from draftsmith.pipelines.config import STAGES, PipelineConfig, PipelineError, seconds_of
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
from draftsmith.pipelines.stages import run_stage, stage_config


def run(cfg: PipelineConfig) -> dict[str, Any]:
    """Run (or resume) the pipeline; return the state written to pipeline.json."""
    from draftsmith.pipelines.checks import check_against_target

    plan = Plan(cfg)
    out = check_output(cfg.output, "output", PIPELINE_OWN, overwrite=cfg.overwrite)
    for line in check_against_target(cfg, offline=False):  # a kind the target cannot use
        say("pipeline: " + " ".join(line.split()))  # ...and says so before any engine starts
    steps = STAGES[: STAGES.index(cfg.stop_after) + 1]
    for stage in steps:  # bad options fail before hours of work
        if plan.runs(stage):
            stage_config(stage, plan.section(stage))
    if plan.val_dir() is not None and plan.runs("extract"):
        stage_config("extract", plan.validation_section())
    out.mkdir(parents=True, exist_ok=True)
    this = Run(plan, out / "pipeline.json")
    try:
        for stage in steps:
            getattr(this, stage)()
    finally:
        this.close()
    return this.state


class Run:
    """A run's plan, its state (``pipeline.json``) and one method per stage."""

    def __init__(self, plan: Plan, state_file: Path) -> None:
        self.plan, self.cfg, self.file = plan, plan.cfg, state_file
        self.state: dict[str, Any] = {"config": self.cfg.__dict__, "stages": {}}
        self.started = time.monotonic()
        self.producer: Producer | None = None

    # ----- the stages, in order -----------------------------------------------------------
    def extract(self) -> None:
        plan, cfg = self.plan, self.cfg
        if not plan.runs("extract"):
            self.note("extract", "given", 0.0)
            say(f"pipeline: extract skipped: training on {plan.dirs['extract']}")
        elif cfg.stream and not (plan.dirs["train"] / DONE).is_file():
            self.stream()
        elif not self.up_to_date("extract"):
            first = self.validation_set if plan.val_dir() is not None else None
            self.execute("extract", before=first)

    def train(self) -> None:
        if self.up_to_date("train"):
            return
        if self.cfg.time_budget:
            extract_s = self.state["stages"]["extract"]["seconds"]
            self.plan.train_max_time, self.state["budget"] = train_time(self.cfg, extract_s)
            say(f"pipeline: time_budget {self.cfg.time_budget}: train for "
                f"{self.plan.train_max_time}")  # fmt: skip
        self.execute("train", after=self.end_streaming)  # training over: so is producing

    def export(self) -> None:
        if not self.up_to_date("export"):
            self.execute("export")

    def eval(self) -> None:
        if self.cfg.time_budget:  # fewer prompts when the hour is slow
            used = time.monotonic() - self.started
            left = max(seconds_of(self.cfg.time_budget) - used, 60.0)
            self.plan.eval_time_limit = round(left)
            self.cut_evaluation(left)
        if not self.up_to_date("eval"):
            self.execute("eval")
        report = self.plan.dirs["eval"] / "report.md"
        summary = self.file.parent / "summary.md"
        summary.write_text(report.read_text() if report.is_file() else "")

    def close(self) -> None:
        """End a producer still running (``stop_after: extract`` on a streamed run)."""
        self.end_streaming()

    # ----- around every stage ---------------------------------------------------------------
    def note(self, stage: str, status: str, seconds: float, **more: Any) -> None:
        """Record ``stage``'s status in pipeline.json now."""
        entry = {"dir": str(self.plan.dirs[stage]), "hash": self.plan.hashes[stage]}
        self.state["stages"][stage] = {**entry, "status": status, "seconds": seconds, **more}
        write_json_atomic(self.file, self.state)

    def up_to_date(self, stage: str) -> bool:
        """Whether ``stage``'s directory is done (then it is recorded as skipped)."""
        d = self.plan.dirs[stage]
        if not (d / DONE).is_file():
            return False
        done = read_json(d / DONE, "stage record", RERUN_STAGE, keys=("seconds",))
        self.note(stage, "skipped", done["seconds"])
        say(f"pipeline: {stage} is up to date ({d})")
        return True

    def execute(self, stage: str, before=None, after=None) -> None:
        """Run ``stage`` on its section as known now (paths, budget, resume point), its
        libraries' output in ``<dir>/<stage>.log``; ``before`` runs inside the same log and
        engines (the validation set shares extraction's engine), ``after`` whatever happens."""
        d = self.plan.dirs[stage]
        say(f"pipeline: {stage} -> {d}")
        started = time.monotonic()
        try:
            with stage_log(d / f"{stage}.log"), shared_engines():
                if before is not None:
                    before()
                section = self.plan.section(stage)
                record(d, section)
                code = run_stage(stage, stage_config(stage, section, check=False))
        finally:
            if after is not None:
                after()
        seconds = round(time.monotonic() - started, 1)
        self.note(stage, "done" if not code else f"failed (exit {code})", seconds)
        if code:
            raise PipelineError(f"{stage} failed (exit {code}); its log: {d / (stage + '.log')}")
        write_json_atomic(d / DONE, {"seconds": seconds})
        say(f"pipeline: {stage} done in {seconds:.0f} s{self.budget_left()}")

    def budget_left(self) -> str:
        if not self.cfg.time_budget:
            return ""
        used, budget = time.monotonic() - self.started, seconds_of(self.cfg.time_budget)
        return f"; {used / 60:.1f} of {budget / 60:.0f} budget minutes used"

    # ----- what the pipeline adds around a stage --------------------------------------------
    def validation_set(self) -> None:
        """Extract the validation dataset (before the data, with the same engine)."""
        started = time.monotonic()
        say(f"pipeline: validation set -> {self.plan.val_dir()}")
        section = self.plan.validation_section()
        record(self.plan.val_dir(), section)
        run_stage("extract", stage_config("extract", section, check=False))
        self.plan.validation_seconds = time.monotonic() - started

    def stream(self) -> None:
        """The extract stage of a streamed run: the validation set now, then a producer that
        writes the training data as the train stage asks for it (``producer.py``)."""
        d = self.plan.dirs["extract"]
        say(f"pipeline: extract -> {d} (streamed: at most {self.cfg.stream.get('shards', 4)} "
            "shards ahead of training)")  # fmt: skip
        if self.plan.val_dir() is not None:
            with stage_log(d / "extract.log"), shared_engines():
                self.validation_set()
        record(d, self.plan.section("extract"))
        import torch

        self.producer = Producer(d)  # on a CPU machine, on half its cores (train/share_cores.py)
        self.producer.start(None if torch.cuda.is_available() else producer_cores())
        # The producer's own time overlaps training: the stage counts the validation set.
        self.note("extract", "streaming", round(self.plan.validation_seconds, 1))

    def end_streaming(self) -> None:
        if self.producer is None:
            return
        producer, self.producer = self.producer, None
        seconds = producer.stop()
        entry = self.state["stages"]["extract"]
        code = producer.proc.returncode if producer.proc else None
        if code == 0:  # the dataset is as training left it (policy: shards kept or dropped)
            status = "streamed"
            done = {"seconds": entry["seconds"], "streamed": True}
            write_json_atomic(self.plan.dirs["extract"] / DONE, done)
        else:
            log = self.plan.dirs["extract"] / "producer.log"
            status = f"streamed (producer exit {code}; log {log})"
        self.note("extract", status, entry["seconds"], producer_seconds=seconds)

    def cut_evaluation(self, left: float) -> None:
        """Decide the evaluation's prompts per set from this run's extraction speed."""
        measured = shard_seconds_per_sample(self.plan.dirs["extract"])
        if measured is None:
            return
        per_sample, extract_tokens = measured
        section = stage_config("eval", self.plan.section("eval"), check=False)
        counts = prompt_counts(section)
        engines = COMMANDS["eval"].hook("engines")(section)
        limit, accounting = eval_prompts(
            self.cfg, section, engines, per_sample, left, counts, extract_tokens
        )
        self.plan.set_eval_limit(limit)
        self.state.setdefault("budget", {}).update(accounting, eval_left_s=round(left))
        predicted, n = accounting["eval_predicted_s"], accounting["eval_engines"]
        head = f"pipeline: time_budget: {left:.0f} s left; {n} engines"
        if limit is None:
            say(f"{head} at {section.max_tokens} tokens per reply: about {predicted:.0f} s")
            return
        say(f"{head} on {sum(counts)} prompts would take about {predicted:.0f} s: {limit} "
            f"prompts per set, replies kept at {section.max_tokens} tokens")  # fmt: skip


def prompt_counts(section: Any) -> list[int]:
    """Prompts each of the evaluation's sets holds, after its ``limit``."""
    from draftsmith.conversations.sources import SkipLog, load_many

    counts = []
    for spec in section.datasets:
        n = len(load_many([spec], require_assistant=False, skips=SkipLog(), limit=section.limit))
        counts.append(n)
    return counts
