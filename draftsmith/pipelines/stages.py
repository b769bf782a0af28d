"""A stage as the pipeline sees it: a section parsed and checked by the stage itself, then run
in this process. Everything about a stage goes through its entry in ``commands.COMMANDS``;
nothing here knows which stage it calls."""

from __future__ import annotations

import contextlib
import importlib
from typing import Any

from draftsmith.core.config import parse_section
from draftsmith.core.errors import DraftsmithError
from draftsmith.pipelines.commands import COMMANDS
from draftsmith.pipelines.config import PipelineError


def stage_config(stage: str, section: dict[str, Any], check: bool = True) -> Any:
    """The stage's typed config parsed from its section in memory, and (``check``) checked by
    the stage's own ``check`` hook: what it would refuse, refused before hours of work. A
    stage with a parser of its own (the train stage's LightningCLI) gets its section as it
    is; its check is a dry parse, and it parses the section again when it runs."""
    command = COMMANDS[stage]
    with named(stage):
        if command.config is None:
            config = section
        else:
            config = parse_section(command.config_class(), section, prog=f"draftsmith {stage}")
        if check and (hook := command.hook("check")):
            hook(config)
        return config


def run_stage(stage: str, config: Any) -> int:
    """Run one stage in this process on its parsed config; its errors propagate, prefixed
    with the stage."""
    with named(stage):
        return importlib.import_module(COMMANDS[stage].module).run_stage(config) or 0


@contextlib.contextmanager
def named(stage: str):
    """Prefix a stage's DraftsmithError with the stage: the option is in its section."""
    try:
        yield
    except DraftsmithError as err:
        raise PipelineError(f"{stage}: {err}") from err
