"""The one table of draftsmith's commands, read by the ``draftsmith`` command and the pipeline.

Each command is a module whose ``main(args=None)`` runs it; modules are imported only when
their command runs (vLLM and Lightning are slow to import), so ``draftsmith --help`` stays
fast. The pipeline chains the four ``PIPELINE`` stages in order.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


def _load(path: str) -> Any:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


@dataclass(frozen=True)
class Command:
    module: str
    """Module whose ``main(args=None) -> int`` runs the command."""
    help: str
    """One line for ``draftsmith --help``."""
    config: str | None = None
    """``module:Class`` of the command's typed config (what a pipeline dry run parses);
    None for commands with a parser of their own (the train stage's LightningCLI)."""
    hooks: dict[str, str] = field(default_factory=dict)
    """What the pipeline asks of a stage without knowing it, name -> ``module:function``:

    - ``check``: refuse bad option values, given the stage's parsed config (or its section,
      for a stage with its own parser), before any stage runs;
    - ``summary``: a finished stage's directory -> the text the pipeline prints last;
    - ``engines``: the parsed config -> (engines it starts, how many a time limit may skip),
      for the pipeline's time budget;
    - ``train_tokens``: a finished stage's directory -> the tokens that trained the head;
    - ``by_context``: (an eval's results.json, its head method) -> tokens per step per
      context bucket of the head (served and expected), ngram and suffix;
    - ``target``: (the stage's section, the target's ``TargetInfo``) -> refuse, in one line,
      what the target cannot do, before any stage runs."""

    def main(self) -> Callable[[list[str] | None], int]:
        return importlib.import_module(self.module).main

    def config_class(self) -> type:
        return _load(self.config or "")

    def hook(self, name: str) -> Callable[..., Any] | None:
        """The stage's ``name`` hook, or None when it declares none."""
        return _load(self.hooks[name]) if name in self.hooks else None


COMMANDS = {
    "extract": Command(
        "draftsmith.extract.main",
        "capture target hidden states into a dataset",
        "draftsmith.extract.config:ExtractConfig",
        {"check": "draftsmith.extract.main:check_config"},
    ),
    "train": Command(
        "draftsmith.train.main",
        "train a draft head (LightningCLI: fit, validate)",
        hooks={
            "check": "draftsmith.train.main:check_section",
            "train_tokens": "draftsmith.train.data:train_tokens",
        },
    ),  # fmt: skip
    "export": Command(
        "draftsmith.train.export",
        "write a trained head as a directory vLLM serves",
        "draftsmith.train.export:ExportConfig",
    ),
    "convert": Command(
        "draftsmith.convert.main",
        "read a published EAGLE-3 head in any layout, write it for vllm/sglang/trtllm/...",
        "draftsmith.convert.main:ConvertConfig",
    ),
    "eval": Command(
        "draftsmith.evaluate.main",
        "measure a head's acceptance and speed in vLLM",
        "draftsmith.evaluate.config:EvalConfig",
        {
            "check": "draftsmith.evaluate.main:check_ranges",
            "target": "draftsmith.evaluate.checks:check_section_target",
            "summary": "draftsmith.evaluate.report:summary_of",
            "engines": "draftsmith.evaluate.runs:engine_count",
            "by_context": "draftsmith.evaluate.context:figures_by_context",
        },
    ),  # fmt: skip
    "pipeline": Command(
        "draftsmith.pipelines.main", "extract -> train -> export -> eval, resumable"
    ),
    "study": Command(
        "draftsmith.pipelines.study", "vary one knob at a time, measure each head in vLLM"
    ),
    "bench-train": Command("draftsmith.bench.train", "time training steps of a head (tokens/s)"),
    "bench-extract": Command(
        "draftsmith.bench.extract", "time extraction against plain generation and HF"
    ),
    "bench-loader": Command(
        "draftsmith.bench.loader", "time the training data path alone (tokens/s)"
    ),
    "bench-memory": Command(
        "draftsmith.bench.memory", "peak memory of a training step against the row length"
    ),
    "bench-gpu": Command(
        "draftsmith.bench.gpu",
        "the device benchmark: bench-train rows, profiles, speculators, the loader",
    ),
}

PIPELINE = ("extract", "train", "export", "eval")
"""The stages ``draftsmith pipeline`` chains, in order."""
