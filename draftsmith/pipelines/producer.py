"""The pipeline's streaming producer: ``draftsmith extract --stream true`` in its own process.

vLLM refuses to start inside a daemonic DataLoader worker (vllm#18308), and an engine in the
trainer's process would share its memory and its crashes; so the producer is a plain child
process, started after the validation set and stopped when training ends, its output in
``<extract dir>/producer.log``. A producer that dies writes ``stream/failed.json`` (or
stops beating), and the trainer stops on it in one line.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from draftsmith.core.console import say
from draftsmith.dataset.stream import StreamDir

STOP_GRACE_S = 120.0  # an engine shutting down takes a while


class Producer:
    """One ``draftsmith extract --stream true`` child writing ``dataset`` from its
    recorded ``stage.yaml``."""

    def __init__(self, dataset: Path) -> None:
        self.dataset = Path(dataset)
        self.proc: subprocess.Popen | None = None
        self.started = 0.0

    def start(self, cores: set[int] | None = None) -> None:
        """Start it, on ``cores`` only when given (a CPU machine it shares with training)."""
        StreamDir(self.dataset).reset()
        command = [
            sys.executable, "-m", "draftsmith.cli", "extract",
            "--config", str(self.dataset / "stage.yaml"), "--stream", "true",
        ]  # fmt: skip
        log = (self.dataset / "producer.log").open("ab")
        # Its own process group: it and its engine's processes stop together.
        pin = (lambda: os.sched_setaffinity(0, cores)) if cores else None
        self.proc = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=pin
        )
        self.started = time.monotonic()
        where = f"; cores {sorted(cores)}, training the rest while it writes" if cores else ""
        say(f"pipeline: producer started (pid {self.proc.pid}{where}; log "
            f"{self.dataset}/producer.log)")  # fmt: skip

    def stop(self) -> float:
        """Tell it training is over, wait for it, kill it if it hangs; its seconds."""
        if self.proc is None:
            return 0.0
        StreamDir(self.dataset).finish()
        try:
            self.proc.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        return round(time.monotonic() - self.started, 1)
