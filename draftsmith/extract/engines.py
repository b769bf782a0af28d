"""The extraction's vLLM engines, started on first use: a finished or merge-only run needs none.

A capture engine is keyed by what it captures (target, layers, engine options, length), so
inside ``draftsmith.core.engine.shared_engines()`` a second run on the same target reuses the
first one's engine; its connector keeps staging in the first run's directory, which is
scratch space. A plain engine (self-written prompts, sampled replies) never runs beside
shared ones: starting it closes them, as two engines at once would not fit in memory here.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from draftsmith.core import engine
from draftsmith.core.engine import EngineOptions

_started: set[LazyEngine] = set()  # engines get() started and close() has not stopped yet


def close_started() -> None:
    """Close every engine still running: a run that ends early (an error, SIGTERM) must not
    leave vLLM's engine processes behind. Pooled ones stay with their pool."""
    for lazy in list(_started):
        lazy.close()


def staging_dir(output: Path, worker: int, configured: str | None) -> Path:
    """Per-output, per-worker scratch space for the connector's files (`configured`, the
    config's ``staging_dir``, or in memory (/dev/shm) when the system has it)."""
    if configured:
        return Path(configured) / f"worker-{worker}"
    tag = hashlib.sha256(str(output.resolve()).encode()).hexdigest()[:12]
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() else output
    return base / f"draftsmith-staging-{tag}-w{worker}"


class LazyEngine:
    """A plain engine (``layer_ids`` None) or a capture engine whose connector stages
    hidden states in ``staging``; started by the first ``get()``."""

    def __init__(
        self,
        model: str,
        options: EngineOptions,
        max_len: int,
        layer_ids: list[int] | None = None,
        staging: Path | None = None,
    ):
        self.model, self.options, self.max_len = model, options, max_len
        self.layer_ids, self.staging = layer_ids, staging
        self.key = ("capture", model, tuple(layer_ids or ()), repr(options), max_len)
        self.llm = None
        self.shared = False  # the pool's engine: close() leaves it running

    @property
    def reused(self) -> bool:
        """True when ``get()`` will hand back an engine an earlier run started."""
        return self.llm is None and self.staging is not None and engine.is_pooled(self.key)

    def get(self):
        if self.llm is not None:
            return self.llm
        _started.add(self)
        if self.staging is None:
            engine.release_shared()
            self.llm = engine.plain_engine(self.model, self.options, self.max_len)
            return self.llm
        from draftsmith.extract.capture import capture_engine, clean_staging

        staging = self.staging

        def start():
            clean_staging(staging)
            return capture_engine(
                self.model, self.layer_ids, str(staging), self.options, self.max_len
            )

        self.llm, self.shared = engine.pooled(self.key, start, lambda: clean_staging(staging))
        return self.llm

    def close(self) -> None:
        """Stop the engine and empty its staging directory, unless the pool owns them."""
        if not self.shared:
            if self.llm is not None:
                engine.close_engine(self.llm)
            if self.staging is not None:
                from draftsmith.extract.capture import clean_staging

                clean_staging(self.staging)
        self.llm, self.shared = None, False
        _started.discard(self)
