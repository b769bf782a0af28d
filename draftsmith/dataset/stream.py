"""Streaming: a trainer reads a dataset while ``draftsmith extract --stream true`` writes it.

The dataset directory is the whole protocol; no socket, no broker. Beside the shards it
holds ``stream/``:

    want-r<rank>.json      each trainer rank: the shards it needs next, in order, and when
                           it last said so (its heartbeat)
    producer-w<i>.json     each producer: pid, host, state, shards and tokens written, time
                           busy and waiting (its heartbeat)
    closed-w<i>.json       producer i reached its time limit: the shards it wrote are the
                           last it writes new (a time budget's cut of the data; the
                           dataset is closed once every producer has said so)
    finished.json          the trainer is done: producers exit
    failed.json            a producer that cannot go on: why (the trainer stops on it)

The trainer drives. It asks for the next shards of its order, never more than its share of
the bound (``window``) ahead of what it has consumed, and a producer writes only shards
someone asked for and that are not on disk yet. So at most ``window`` unconsumed shards
exist, the producer waits when the trainer falls behind, and a shard deleted after use
(policies ``drop`` and ``recapture``) is written again only when it is asked for again:
by the next epoch, or by a trainer resumed from a checkpoint taken before it was used.
A shard counts once its sidecar is written (after the shard file, atomically), so a
producer killed mid-shard leaves nothing a trainer reads; the next one writes it again.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from draftsmith.core.cores import allowed_cores
from draftsmith.core.errors import DatasetError, DraftsmithError
from draftsmith.core.files import write_json_atomic
from draftsmith.core.readers import read_json_or

STREAM_DIR = "stream"
POLICIES = ("keep", "recapture", "drop")
POLL_S = 0.2
_CUT: dict[str, Any] = {}  # what a wait finds for a shard the stream was closed without


@dataclass
class StreamOptions:
    """Train while ``draftsmith extract --stream true`` writes the dataset (docs/scaling.md)."""

    shards: int = 4
    """The disk bound: at most this many unconsumed shards exist at once (over all
    ranks); the producer waits when the trainer falls behind."""
    policy: Literal["keep", "recapture", "drop"] = "keep"
    """After an epoch: keep (later epochs read the kept shards; disk grows to the whole
    dataset after the first epoch), recapture (each shard is deleted after use and
    captured again next epoch, by one prefill of the replies kept at its first capture;
    disk stays bounded, a capture runs every epoch), or drop (deleted after use; one epoch,
    whatever max_epochs says)."""
    producer_timeout: float = 300.0
    """Seconds without a producer heartbeat, while the trainer waits for a shard, before
    the run stops naming the producer (it died, or none was started)."""

    def check(self) -> None:
        if self.shards < 1:
            raise DatasetError(f"data.stream.shards: {self.shards}; give at least 1")
        if self.policy not in POLICIES:
            raise DatasetError(f"data.stream.policy: {self.policy!r}; use one of {list(POLICIES)}")
        if self.producer_timeout <= 0:
            raise DatasetError(
                f"data.stream.producer_timeout: {self.producer_timeout}; give seconds > 0"
            )


def shard_file(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


def sidecar_file(index: int) -> str:
    return f"shard-{index:05d}.json"


def planned_shards(root: Path) -> list[list[str]]:
    """The sample ids of every planned shard (``plan.json``), in shard order."""
    plan = root / "plan.json"
    if not plan.is_file():
        raise DatasetError(
            f"{root}: no plan.json; a streamed dataset is planned by its producer "
            f"(`draftsmith extract --stream true --output {root}`), which has not run yet"
        )
    from draftsmith.dataset.manifest import read_plan  # manifest imports shards, not this

    return read_plan(root)["shards"]


def sidecar(root: Path, index: int) -> dict[str, Any] | None:
    """What the producer recorded about shard ``index`` (None: not written yet)."""
    from draftsmith.dataset.manifest import read_sidecar

    path = root / sidecar_file(index)
    try:
        return read_sidecar(path)  # written whole (atomically), or not yet
    except DraftsmithError:
        if not path.exists():
            return None
    # Missing when read, there now: renamed into place in between (several loader workers
    # poll at once), or there but damaged; a second read tells which.
    return read_sidecar(path)


def shard_ready(root: Path, index: int) -> dict[str, Any] | None:
    """The sidecar of shard ``index`` when its file is on disk and whole, else None."""
    info = sidecar(root, index)
    path = root / shard_file(index)
    if info is None or not path.is_file() or path.stat().st_size != info["bytes"]:
        return None
    return info


class StreamDir:
    """The ``stream/`` folder of one dataset directory (module docstring)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.dir = self.root / STREAM_DIR

    # ----- trainer side -------------------------------------------------------------
    def want(self, rank: int, shards: list[int], **stats: Any) -> None:
        """Rank ``rank`` needs ``shards`` next, in this order (also its heartbeat)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        body = {"shards": shards, "time": time.time(), "pid": os.getpid(), **stats}
        write_json_atomic(self.dir / f"want-r{rank}.json", body)

    def finish(self) -> None:
        """Tell the producers the trainer is done."""
        self.dir.mkdir(parents=True, exist_ok=True)
        write_json_atomic(self.dir / "finished.json", {"time": time.time()})

    def release(self, index: int) -> None:
        """Delete shard ``index``'s file after its last planned use (its sidecar stays: the
        record of what it held, and its sample lengths for resuming)."""
        (self.root / shard_file(index)).unlink(missing_ok=True)

    def closed(self) -> set[int] | None:
        """The shards the dataset holds once every producer reached its time limit (each
        wrote ``closed-w<i>.json``); None while any still writes new shards."""
        notes = [_read(p, {}) for p in self.dir.glob("closed-w*.json")]
        if not notes or len(notes) < max(n.get("workers", 1) for n in notes):
            return None
        return {k for n in notes for k in n.get("shards", [])}

    def failure(self) -> str | None:
        """Why a producer stopped for good, or None."""
        return _read(self.dir / "failed.json", {}).get("error")

    def producers(self) -> list[dict[str, Any]]:
        """Every producer's last heartbeat."""
        return [_read(p, {}) for p in sorted(self.dir.glob("producer-w*.json"))]

    def wait_for(self, index: int, timeout: float, stop: Any = None) -> dict[str, Any] | None:
        """Block until shard ``index`` is on disk: its sidecar (``wait_until``); None when
        the stream is closed without it (``closed``)."""

        def ready() -> dict[str, Any] | None:
            if (info := shard_ready(self.root, index)) is not None:
                return info
            cut = self.closed()
            return _CUT if cut is not None and index not in cut else None

        found = self.wait_until(ready, f"shard {index}", timeout, stop)
        return None if found is _CUT else found

    def wait_until(self, ready: Any, what: str, timeout: float, stop: Any = None) -> Any:
        """Poll ``ready()`` until it returns something; return it. Raises ``DatasetError``
        naming the producer when one failed, or when none has beaten for ``timeout`` s.
        ``stop()`` (optional) is called each poll: the caller's heartbeat."""
        started = time.monotonic()
        while (found := ready()) is None:
            if error := self.failure():
                raise DatasetError(f"{self.root}: the producer stopped: {error}")
            beats = [p.get("time", 0.0) for p in self.producers()]
            last = max(beats) if beats else None
            silent = time.time() - last if last else time.monotonic() - started
            if silent > timeout:
                raise DatasetError(
                    f"{self.root}: {what} never came: {self._describe()} for {silent:.0f} s "
                    f"(data.stream.producer_timeout {timeout:.0f}); start or restart it "
                    f"with `draftsmith extract --stream true --output {self.root} ...` "
                    "(the trainer resumes from its last checkpoint)"
                )
            if stop is not None:
                stop()
            time.sleep(POLL_S)
        return found

    def _describe(self) -> str:
        beats = self.producers()
        if not beats:
            return "no producer has written a heartbeat"
        names = ", ".join(
            f"producer w{p.get('worker')} (pid {p.get('pid')} on {p.get('host')}, "
            f"last state {p.get('state')})"
            for p in beats
        )
        return f"{names} silent"

    # ----- producer side ------------------------------------------------------------
    def wanted(self) -> list[int]:
        """The shards the trainer ranks ask for, interleaved rank by rank in their order."""
        lists = [_read(p, {}).get("shards", []) for p in sorted(self.dir.glob("want-r*.json"))]
        out: list[int] = []
        for group in zip(*[lst + [None] * (max(map(len, lists), default=0) - len(lst))
                           for lst in lists], strict=True):  # fmt: skip
            out += [k for k in group if k is not None and k not in out]
        return out

    def trainer_seen(self) -> float | None:
        """When a trainer rank last wrote its wants (None: never)."""
        times = [_read(p, {}).get("time", 0.0) for p in self.dir.glob("want-r*.json")]
        return max(times) if times else None

    def finished(self) -> bool:
        return (self.dir / "finished.json").is_file()

    def beat(self, worker: int, **stats: Any) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        body = {
            "worker": worker,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "cores": sorted(allowed_cores()),
            "time": time.time(),
            **stats,
        }
        write_json_atomic(self.dir / f"producer-w{worker}.json", body)

    def busy_cores(self, fresh: float = 300.0) -> set[int]:
        """The cores of this machine that producers are computing on now: those of every
        producer on this host whose last heartbeat (under ``fresh`` s old) says it is not
        waiting for the trainer."""
        host, now, cores = socket.gethostname(), time.time(), set()
        for p in self.producers():
            idle = str(p.get("state", "")).startswith(("waiting", "finished"))
            if p.get("host") == host and now - p.get("time", 0.0) < fresh and not idle:
                cores.update(p.get("cores", []))
        return cores

    def closed_by(self, worker: int) -> set[int] | None:
        """The shards producer ``worker`` closed the dataset at (None: it has not)."""
        note = _read(self.dir / f"closed-w{worker}.json", None)
        return None if note is None else set(note["shards"])

    def close(self, worker: int, workers: int, shards: list[int]) -> None:
        """Producer ``worker`` of ``workers`` writes no new shard beyond ``shards``."""
        self.dir.mkdir(parents=True, exist_ok=True)
        body = {"workers": workers, "shards": sorted(shards), "time": time.time()}
        write_json_atomic(self.dir / f"closed-w{worker}.json", body)

    def fail(self, error: str) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        write_json_atomic(self.dir / "failed.json", {"error": error, "time": time.time()})

    def reset(self) -> None:
        """Forget a previous run's end (a resumed run streams again)."""
        for name in ("finished.json", "failed.json"):
            (self.dir / name).unlink(missing_ok=True)


def _read(path: Path, default: Any) -> Any:
    return read_json_or(path, default)
