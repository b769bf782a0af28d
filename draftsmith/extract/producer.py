"""``draftsmith extract --stream true``: write the shards a streamed trainer asks for.

    draftsmith extract --config configs/extract/smollm2.yaml --output /shared/ds --stream true

The protocol is ``draftsmith.dataset.stream``. This loop reads what the trainer ranks want
(their order, at most their disk bound ahead), writes the first wanted shard of its own
(``k % workers == worker``) that is not on disk, and beats after each shard and while it
waits, with its rates, so the trainer's progress can say which side starves. It ends when
the trainer says it finished, or after ``trainer_timeout`` seconds without a word from it.
With ``time_limit`` it starts no new shard that would end past it and closes the dataset
at the shards written (``stream/closed-w<i>.json``): training goes on over those, as it
does over an offline dataset cut by its time limit, and later epochs' recaptures go on.

Run it in its own process (the pipeline starts one): vLLM refuses to start inside a
daemonic DataLoader worker (vllm#18308), and an engine in the trainer's process would share
its memory and its crashes. On other machines, point ``--output`` at a shared path and
give each producer ``--workers W --worker i``.
"""

from __future__ import annotations

import time
from typing import Any

from draftsmith.core.console import say
from draftsmith.core.errors import DraftsmithError
from draftsmith.dataset import manifest
from draftsmith.dataset.stream import POLL_S, StreamDir, sidecar


def serve(job: Any) -> dict:
    """Produce for the trainer until it finishes (``job``: extract's ``ShardJob``); returns
    the manifest as it stands at the end."""
    cfg, output = job.cfg, job.output
    stream = StreamDir(output)
    stats: dict[str, Any] = {"state": "starting", "shards_written": 0, "tokens": 0,
                             "busy_s": 0.0, "waiting_s": 0.0}  # fmt: skip
    stream.beat(cfg.worker, **stats)
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
                stream.beat(cfg.worker, **{**stats, "state": "waiting for the trainer"})
                continue
            k = mine[0]
            stream.beat(cfg.worker, **{**stats, "state": f"writing shard {k}"})
            t0 = time.monotonic()
            stats["tokens"] += job.extract(k)
            stats["busy_s"] += time.monotonic() - t0
            stats["shards_written"] += 1
            stats["tok_s"] = round(stats["tokens"] / max(stats["busy_s"], 1e-9), 1)
            stream.beat(cfg.worker, **{**stats, "state": f"wrote shard {k}"})
    except DraftsmithError as err:
        stream.fail(f"producer w{cfg.worker}: {err}")
        raise
    except BaseException as err:  # a crash: the trainer stops naming it, never hangs
        stream.fail(f"producer w{cfg.worker}: {type(err).__name__}: {err}")
        raise
    finally:
        job.engine.close()
    stream.beat(cfg.worker, **{**stats, "state": "finished"})
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
