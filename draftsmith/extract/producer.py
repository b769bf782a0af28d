"""``draftsmith extract --stream true``: write the shards a streamed trainer asks for.

    draftsmith extract --config configs/extract/smollm2.yaml --output /shared/ds --stream true

The protocol is ``draftsmith.dataset.stream``. This loop reads what the trainer ranks want
(their order, at most their disk bound ahead) and writes the first wanted shard of its own
(``k % workers == worker``) that is not on disk. Its heartbeat (:class:`Pulse`) beats from
a thread from the moment extraction starts, with its state and rates, so the trainer can
tell a producer that writes prompts or one long shard from a dead one, and its progress
can say which side starves; a producer that raises, at any point, fails the stream with
its error. It ends when
the trainer says it finished, or after ``trainer_timeout`` seconds without a word from it.
SIGTERM stops it at once (``core/signals.py``): the shard in progress leaves nothing, the
engine is shut down, and a producer started again writes what is still wanted.
With ``time_limit`` it starts no new shard that would end past it and closes the dataset
at the shards written (``stream/closed-w<i>.json``): training goes on over those, as it
does over an offline dataset cut by its time limit, and later epochs' recaptures go on.

Run it in its own process (the pipeline starts one): vLLM refuses to start inside a
daemonic DataLoader worker (vllm#18308), and an engine in the trainer's process would share
its memory and its crashes. On other machines, point ``--output`` at a shared path and
give each producer ``--workers W --worker i``.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from draftsmith.core.console import say
from draftsmith.core.errors import DraftsmithError
from draftsmith.core.signals import Terminated
from draftsmith.dataset import manifest
from draftsmith.dataset.stream import POLL_S, StreamDir, sidecar

PULSE_S = 5.0  # seconds between heartbeats; the trainer's producer_timeout is 300 s


class Pulse:
    """A producer's heartbeat, written every ``period`` s by a thread whatever the producer
    is doing (writing prompts, planning, one long shard); :meth:`set` changes what it says.
    Leaving the ``with`` block on an error writes ``stream/failed.json`` with it, so the
    trainer stops naming it instead of waiting out its timeout; SIGTERM is no failure: the
    last beat says so and the trainer waits (``producer_timeout``) for a restarted one."""

    def __init__(self, stream: StreamDir, worker: int, period: float = PULSE_S) -> None:
        self.stream, self.worker, self.period = stream, worker, period
        self.state: dict[str, Any] = {"state": "starting"}
        self._lock, self._stop = threading.Lock(), threading.Event()
        self._thread = threading.Thread(target=self._run, name="producer-pulse", daemon=True)

    def __enter__(self) -> Pulse:
        self.set(state="starting")
        self._thread.start()
        return self

    def __exit__(self, kind, err, tb) -> None:
        self._stop.set()
        self._thread.join()
        if isinstance(err, Terminated):  # preempted, not failed: a restarted producer goes on
            self.set(**{**self.state, "state": "stopped by SIGTERM"})
        elif err is not None:
            why = str(err) if isinstance(err, DraftsmithError) else f"{kind.__name__}: {err}"
            self.stream.fail(f"producer w{self.worker}: {why}")

    def set(self, **state: Any) -> None:
        """Say ``state`` now, and on every beat after."""
        with self._lock:
            self.state = state
            self.stream.beat(self.worker, **state)

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            with self._lock:
                self.stream.beat(self.worker, **self.state)


def serve(job: Any, pulse: Pulse) -> dict:
    """Produce for the trainer until it finishes (``job``: the ``ShardPass`` of
    ``shard_pass.py``, which writes a shard); returns the manifest as it stands at the end."""
    cfg, output = job.cfg, job.output
    stream = StreamDir(output)
    stats: dict[str, Any] = {"state": "starting", "shards_written": 0, "tokens": 0,
                             "busy_s": 0.0, "waiting_s": 0.0}  # fmt: skip
    pulse.set(**stats)
    started = time.monotonic()
    try:
        job.engine.get()
        say(f"extract: producing for a streamed trainer at {output} (worker {cfg.worker})")
        closed = stream.closed_by(cfg.worker)  # a restarted producer keeps its cut
        while not stream.finished():
            if closed is None and _past_limit(cfg.time_limit, started, stats):
                closed = {k for k in range(cfg.worker, len(job.shards), cfg.workers)
                          if sidecar(output, k) is not None}  # fmt: skip
                stream.close(cfg.worker, cfg.workers, sorted(closed))
                say(f"extract: time_limit {cfg.time_limit:.0f} s: dataset closed at "
                    f"{len(closed)} shards of worker {cfg.worker}")  # fmt: skip
            mine = [
                k
                for k in stream.wanted()
                if k % cfg.workers == cfg.worker
                and (closed is None or k in closed)
                and not manifest.shard_done(output, k, job.shards[k])
            ]
            if not mine:
                seen = stream.trainer_seen()
                quiet = time.time() - seen if seen else time.monotonic() - started
                if quiet > cfg.trainer_timeout:
                    say(f"extract: no word from the trainer for {quiet:.0f} s; producer exits")
                    break
                t0 = time.monotonic()
                time.sleep(POLL_S)
                stats["waiting_s"] += time.monotonic() - t0
                pulse.set(**{**stats, "state": "waiting for the trainer"})
                continue
            k = mine[0]
            pulse.set(**{**stats, "state": f"writing shard {k}"})
            t0 = time.monotonic()
            stats["tokens"] += job.extract(k)
            stats["busy_s"] += time.monotonic() - t0
            stats["shards_written"] += 1
            stats["tok_s"] = round(stats["tokens"] / max(stats["busy_s"], 1e-9), 1)
            pulse.set(**{**stats, "state": f"wrote shard {k}"})
    finally:
        job.engine.close()
    pulse.set(**{**stats, "state": "finished"})
    say(
        f"extract: producer wrote {stats['shards_written']} shards, {stats['tokens']:,} tokens "
        f"in {stats['busy_s']:.0f} s; waited {stats['waiting_s']:.0f} s for the trainer"
    )
    return manifest.build_manifest(output, job.target, job.layer_ids, job.config)


def _past_limit(time_limit: float | None, started: float, stats: dict[str, Any]) -> bool:
    """Would the next shard end past ``time_limit`` (at the mean shard time so far)? Never
    before the first shard is written: training needs data."""
    if not time_limit or not stats["shards_written"]:
        return False
    per_shard = stats["busy_s"] / stats["shards_written"]
    return time.monotonic() + per_shard > started + time_limit
