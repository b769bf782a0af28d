"""One way to configure every stage: typed dataclasses parsed by jsonargparse.

A stage declares a dataclass whose field docstrings become ``--help``; users pass
``--config file.yaml`` (several apply in order, last wins) and dotted overrides such
as ``--engine.max_model_len 4096``. The train stage uses LightningCLI, which is built
on the same parser, so flags look the same everywhere.
"""

from __future__ import annotations

import dataclasses
import os
from typing import TypeVar

from jsonargparse import ArgumentParser, set_parsing_settings

os.environ.setdefault("JSONARGPARSE_DEPRECATION_WARNINGS", "off")
set_parsing_settings(docstring_parse_attribute_docstrings=True)

T = TypeVar("T")


def build_parser(cls: type, prog: str, description: str) -> ArgumentParser:
    """A parser whose flags are the fields of dataclass `cls`, plus ``--config``."""
    parser = ArgumentParser(prog=prog, description=description, exit_on_error=True)
    parser.add_argument("--config", action="config", help="YAML file(s) with the fields below.")
    parser.add_class_arguments(cls, None, as_group=False)
    return parser


def parse_config(cls: type[T], args: list[str] | None, prog: str) -> T:
    """Parse `args` (``sys.argv[1:]`` when None) into an instance of dataclass `cls`."""
    parser = build_parser(cls, prog, (cls.__doc__ or "").strip())
    namespace = parser.instantiate(parser.parse_args(args))
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in vars(namespace).items() if k in names})


def to_dict(config) -> dict:
    """A dataclass config as plain JSON-able data (for manifests and reports)."""
    return dataclasses.asdict(config)
