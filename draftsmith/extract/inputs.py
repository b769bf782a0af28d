"""The conversations a run reads: its data sources in order, then the prompts the target
writes itself (``self:N``, with a plain engine: see ``conversations/selfwrite.py``)."""

from __future__ import annotations

from pathlib import Path

from draftsmith.conversations.sources import Conversation, SkipLog, load_many
from draftsmith.core.console import say
from draftsmith.core.errors import ConfigError
from draftsmith.extract.records import DataOptions


def conversations(
    opts: DataOptions, tokenizer, writer, output: Path, skips: SkipLog, pulse
) -> list[Conversation]:
    """Every source's conversations (rows skipped are counted in `skips`), then the
    self-written prompts: `writer` is the plain engine that writes them, started only when
    ``prompts.self.jsonl`` in `output` does not hold them yet; a streaming producer's
    `pulse` says so meanwhile."""
    file_specs = [s for s in opts.data if not s.startswith("self:")]
    self_specs = [s for s in opts.data if s.startswith("self:")]
    convs = load_many(
        file_specs,
        bad_rows=opts.bad_rows,
        require_assistant=not opts.regenerate,
        skips=skips,
        encoding=opts.encoding,
    )
    if not self_specs:
        return convs
    from draftsmith.conversations.selfwrite import write_prompts

    if not opts.regenerate:
        raise ConfigError(
            f"data: {self_specs} are prompts without replies; set regenerate: true "
            "so the target answers them."
        )
    count = sum(map(_self_count, self_specs))
    say(f"extract: the target writes {count} prompts (vLLM, pre-query sampling)")
    if pulse is not None:
        pulse.set(state=f"writing {count} prompts")
    cache = output / "prompts.self.jsonl"
    return convs + write_prompts(writer, tokenizer, count, opts.seed, cache)


def _self_count(spec: str) -> int:
    try:
        count = int(spec.split(":", 1)[1])
    except ValueError:
        count = 0
    if count < 1:
        raise ConfigError(f"data: {spec!r}; write self:N with N a positive number of prompts.")
    return count
