"""Training shard by shard (``data.order: shards``), from a finished dataset or a stream.

The order is fixed by the plan, never by when shards arrive, so a streamed run and an
offline run over the same shards train the same rows in the same order:

- rank r of w trains the planned shards ``k`` with ``k % w == r``, in plan order;
- a shard's training samples are packed into rows once (seeded by ``seed`` and ``k``) and
  its rows are shuffled every epoch (seeded by ``seed``, the epoch and ``k``);
- a batch holds rows of one shard; a rank that runs out before the others pads with empty
  batches (no loss), so every rank takes the same number of steps;
- the position is Lightning's count of batches finished in the epoch: the shards' batch
  counts, computed from their sample lengths (in each sidecar, kept after a shard is
  deleted), turn it into (shard, row), so a resumed run trains exactly the batches the
  interrupted one had not.

With W loader workers (``data.num_workers``) the batches of a pass are dealt round-robin:
batch j (counted from where the pass starts) is read by worker ``j % W``, and torch's
DataLoader takes one batch from each worker in turn, so the order, and the head, are those
of one worker or none. Every worker walks the same schedule (from the sidecars); a shard is
read only by the workers holding some of its batches. Each sample is checked (xxh3-64) by
the worker that reads it; an older shard without per-sample checksums is hashed whole, once
per run, by the worker holding its first batch (a bad one fails that batch, which the
trainer gets before any later batch of the shard). ``ShardLoader`` (``shard_loader.py``)
is the DataLoader over it.

Streaming adds the producer (``draftsmith.dataset.stream``): before reading a shard the
loader asks for it and for the next ones, up to this rank's share of the disk bound, waits
for it, and afterwards deletes it unless the policy keeps it or it holds validation samples.
With several workers the rank's list is the first shards not yet done by every worker (a
count per shard in shared memory, written under one lock), and the worker that finishes a
shard last deletes it. Under ``recapture`` the last shards of an epoch are followed, in
that list, by the next epoch's first ones (when another epoch comes), so the producer
captures those again while the epoch ends rather than after it.
"""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import IterableDataset, get_worker_info

from draftsmith.core.console import say
from draftsmith.dataset import DatasetError
from draftsmith.dataset.sample_io import PHASES
from draftsmith.dataset.stream import (
    StreamDir,
    StreamOptions,
    shard_ready,
    sidecar,
)
from draftsmith.train.batch_pool import BatchPool
from draftsmith.train.batches import Layout, batch_shapes, empty_batch
from draftsmith.train.packing import PackedDataset
from draftsmith.train.shard_plan import Pass, ShardPlan, one_shard, shard_seed


class ShardBatches(IterableDataset):
    """One epoch of this rank's batches, shard by shard (module docstring)."""

    def __init__(
        self,
        plan: ShardPlan,
        rank: int,
        world: int,
        aux_layers: list[int],
        dtype: torch.dtype,
        check_shards: bool,
        layout: Layout,
        current_epoch: Callable[[], int],
        stream: StreamOptions | None = None,
        max_epochs: Callable[[], int | None] = lambda: None,
    ) -> None:
        self.plan, self.rank, self.world = plan, rank, world
        self.layout = layout  # of the stored batches (the padding batches need it)
        self.pool: BatchPool | None = None  # each pass's (``prepare``)
        self.pool_slots = 0  # batches each worker reuses (``ShardLoader`` sets it)
        # Older shards (sha256 only) are hashed whole once per run, not every epoch: made
        # here, before any worker forks, so every worker and epoch sees the same flags.
        self.verified = multiprocessing.Array("b", len(plan.shards), lock=False)
        self.current_epoch = current_epoch
        self.max_epochs = max_epochs
        self.aux_layers, self.dtype, self.check_shards = aux_layers, dtype, check_shards
        self.stream = stream
        self.streams = StreamDir(plan.root) if stream else None
        self.window = max(1, stream.shards // world) if stream else 0
        self.epoch = 0
        self.skip = 0  # batches of the epoch trained before a resume (``load_state_dict``)
        self.start = 0  # the skip of the pass ``prepare`` set up
        self.shared: Pass | None = None
        self._prepared = False
        self._at = {k: i for i, k in enumerate(plan.shards)}  # shard -> position in the plan
        self._beat = 0.0
        self.cut: set[int] | None = None  # the shards a closed stream holds

    # ----- position -----------------------------------------------------------------
    def position(self, batches_done: int) -> dict[str, Any]:
        """(shards finished, shard in progress, its batches done) after ``batches_done``,
        from the plan and the shards' records alone (the loader's workers have the state)."""
        finished, left = [], batches_done
        for index in self.plan.shards:
            info = self.plan.info(index)
            if info is None and not self._kept(index):
                continue  # the stream closed without it
            if info is None:
                break
            n = self.plan.batches(index, info)
            if left < n:
                return {"shards_done": finished, "shard": index, "batches_in_shard": left}
            finished.append(index)
            left -= n
        return {"shards_done": finished, "shard": None, "batches_in_shard": left}

    # ----- iteration ----------------------------------------------------------------
    def prepare(self, workers: int) -> None:
        """Set up the next pass for ``workers`` readers (1 without worker processes), in the
        training process before they fork: the skip after a resume applies to this pass
        only, and the shared counts start at zero."""
        self.start, self.skip = self.skip, 0
        self.shared = Pass(len(self.plan.shards), workers)
        if self.pool is None or (self.pool.workers, self.pool.slots) != (workers, self.pool_slots):
            # Kept from pass to pass: each pass's workers inherit buffers made once, here.
            self.pool = BatchPool(workers, self.pool_slots)
            if self.pool_slots:
                self.pool.preallocate(batch_shapes(self.layout, self.plan.batch_size))
        self._prepared = True

    def __iter__(self) -> Iterator[dict[str, Tensor]]:
        if not self._prepared:  # read without a ShardLoader: in this process
            self.prepare(1)
        self._prepared = False
        shared = self.shared
        assert shared is not None
        worker = get_worker_info()
        w, workers = (worker.id, worker.num_workers) if worker is not None else (0, 1)
        if workers != shared.workers:
            raise RuntimeError(
                f"ShardBatches: prepared for {shared.workers} readers, read by {workers}; "
                "read it through a ShardLoader"
            )
        self.epoch = self.current_epoch()
        skip = self.start
        covered = 0  # batches of this epoch yielded or skipped (trained before a resume)
        j = 0  # batches of this pass so far: batch j is worker j % workers's
        for index in self.plan.shards:
            info = self._sidecar_or_wait(index, need_file=False)
            if info is None:  # the stream closed without it (its producer's time limit)
                self._finish(index, None)
                continue
            n = self.plan.batches(index, info)
            if skip >= n:  # trained before the checkpoint this run resumed from
                skip -= n
                covered += n
                self._finish(index, info)
                continue
            own = [b for b in range(skip, n) if (j + b - skip) % workers == w]
            j, covered, first = j + n - skip, covered + n, skip
            skip = 0
            if not own:
                self._finish(index, info)
                continue
            got = self._sidecar_or_wait(index, need_file=True)
            if got is None:  # recorded, but the stream closed without it after all
                if workers > 1:  # the others count its batches: the order would break
                    raise DatasetError(
                        f"{self.plan.root}: shard {index} was written, then deleted, and "
                        "the stream closed without it; train it with data.num_workers 1"
                    )
                self._finish(index, None)
                continue
            yield from self._shard(index, got, own, check=own[0] == first)
        for _ in range(self._rank_padding(covered) - skip):  # skip: padding trained already
            if j % workers == w:
                yield self._empty()
            j += 1
        if shared.add(Pass.ENDED, 1) == workers and self.streams is not None:
            self._epoch_line(int(shared.stats[Pass.SHARDS]))

    def _shard(
        self, index: int, info: dict[str, Any], own: list[int], check: bool
    ) -> Iterator[dict[str, Tensor]]:
        """Batches ``own`` (ascending) of shard ``index``. ``check``: this reader holds the
        pass's first batch of it, so it hashes an older shard (no per-sample checksums)
        whole, once per run; a newer shard's samples are each checked as they are read."""
        digests = bool(info.get("sample_xxh3"))
        at = self._at[index]
        whole = check and not digests and not self.verified[at]
        with PHASES("open"):
            check = self.check_shards and (digests or whole)
            ds = one_shard(self.plan.root, info, self.dtype, check, self.plan.manifest)
            train = [i for i, sid in enumerate(ds.ids) if sid not in self.plan.val_ids]
            rows = [[train[i] for i in row] for row in self.plan.rows(index, info)]
        order = torch.randperm(
            len(rows), generator=torch.Generator().manual_seed(shard_seed(self.plan.seed, index,
                                                                          self.epoch + 1))
        ).tolist()  # fmt: skip
        rows = [rows[r] for r in order]
        packed = PackedDataset(ds, rows, self.plan.row_tokens, self.aux_layers, self.pool)
        bs = self.plan.batch_size
        started = time.monotonic()
        for k, b in enumerate(own):
            if k + 1 < len(own):  # this reader's next batch of the shard: read ahead
                nxt = own[k + 1]
                ds.will_need([i for r in packed.rows[nxt * bs : (nxt + 1) * bs] for i in r])
            batch = packed.__getitems__(list(range(b * bs, min((b + 1) * bs, len(rows)))))
            if whole and self.check_shards:
                self.verified[at] = 1  # hashed before its first sample was read
            tokens = int(batch["loss_mask"].numel() - (batch["doc_ids"] < 0).sum())
            self.shared.add(Pass.TOKENS, tokens)
            if b == own[-1]:  # read in full: its file can go before the last step trains
                self._finish(index, info)
            yield batch
            self._heartbeat()
        self.shared.add(Pass.TRAIN_S, time.monotonic() - started)

    def _empty(self) -> dict[str, Tensor]:
        """A batch of padding only: no loss, no gradient; keeps ranks in step."""
        return empty_batch(self.layout, self.plan.batch_size)

    def _rank_padding(self, mine: int) -> int:
        """Empty batches this rank adds so that it takes as many steps as the busiest rank."""
        if self.world == 1:
            return 0
        totals = [0] * self.world
        for index in self.plan.all_shards:
            info = self._sidecar_or_wait(index, need_file=False)
            if info is None:
                continue
            totals[index % self.world] += self.plan.batches(index, info)
        return max(totals) - mine

    # ----- streaming ----------------------------------------------------------------
    def _sidecar_or_wait(self, index: int, need_file: bool) -> dict[str, Any] | None:
        """Shard ``index``'s record (and, with ``need_file``, its file on disk). Streaming,
        a shard about to be read is announced with the rank's next ones, however it stands:
        the producer then never acts on an older list; a missing one is waited for.
        None: the stream was closed without it (its producer's time limit)."""
        root = self.plan.root
        if self.streams is None:
            info = self.plan.info(index)
            if info is None:
                raise DatasetError(
                    f"{root}: shard {index} is missing; re-run its `draftsmith extract` "
                    "command to write it again (or `--repair true`)"
                )
            return info
        if not need_file:
            info = sidecar(root, index)
            if info is not None:
                return info
        if not self._kept(index):
            return None
        self._tell(also=index)
        started = time.monotonic()
        info = self.streams.wait_for(
            index, self.stream.producer_timeout, stop=lambda: self._heartbeat(also=index)
        )
        if info is None:
            return None
        waited = time.monotonic() - started
        self.shared.add(Pass.WAITED_S, waited)
        if waited > 1.0:
            self._report(index, waited)
        return info

    def _tell(self, also: int | None = None, drop: int | None = None) -> None:
        """Write what this rank wants next: its shards not yet done by every worker (then
        ``also``, when not among them), up to the window, without ``drop``. Under the lock,
        so a list computed before a shard was finished is never written after it."""
        assert self.streams is not None and self.shared is not None
        s = self.shared
        with s.lock:
            rest = self._unread()
            if also is not None and also not in rest:
                rest.append(also)
            workers = s.workers
            self.streams.want(
                self.rank,
                [k for k in self._next(rest) if k != drop],
                epoch=self.epoch,
                trained_tokens=int(s.stats[Pass.TOKENS]),
                train_s=round(s.stats[Pass.TRAIN_S] / workers, 1),  # per worker
                waited_s=round(s.stats[Pass.WAITED_S] / workers, 1),
            )
        self._beat = time.monotonic()

    def _heartbeat(self, also: int | None = None) -> None:
        """Every few seconds, re-say what this rank wants (the producer's sign of life)."""
        if self.streams is None or time.monotonic() - self._beat < 5.0:
            return
        self._tell(also=also)

    def _finish(self, index: int, info: dict[str, Any] | None) -> None:
        """This reader is done with shard ``index`` for this pass (read its batches, or has
        none); the last of the workers to say so deletes it unless the policy keeps it or
        it holds validation samples (``info`` None: the stream holds no such shard)."""
        s = self.shared
        assert s is not None
        with s.lock:
            s.finished[self._at[index]] += 1
            if s.finished[self._at[index]] < s.workers or info is None:
                return
            s.stats[Pass.SHARDS] += 1
        if self.streams is None or self.stream.policy == "keep":
            return
        if self.plan.holds_validation(info):
            return
        # Say first that it is no longer wanted, then delete it: a producer never reads a
        # list that still asks for a shard already gone.
        self._tell(drop=index)
        self.streams.release(index)

    def _unread(self) -> list[int]:
        """This rank's shards that some worker has still to finish this pass."""
        s = self.shared
        assert s is not None
        return [k for i, k in enumerate(self.plan.shards) if s.finished[i] < s.workers]

    def _next(self, rest: list[int]) -> list[int]:
        """What to ask for: the first ``window`` shards of ``rest`` (this epoch's, in
        order), then under ``recapture``, when another epoch comes, the next epoch's first."""
        want = [k for k in rest if self._kept(k)]
        if self.stream.policy == "recapture" and len(want) < self.window:
            last = self.max_epochs()
            if last is None or last < 0 or self.epoch + 1 < last:
                want += [k for k in self.plan.shards if self._kept(k) and k not in want]
        return want[: self.window]

    def _kept(self, index: int) -> bool:
        """Is shard ``index`` in the dataset: always, until a producer's time limit closes
        the stream at the shards written (final once known)."""
        if self.streams is None:
            return True
        if self.cut is None:
            self.cut = self.streams.closed()
        return self.cut is None or index in self.cut

    def _report(self, index: int, waited: float) -> None:
        """Which side starves: the trainer's rate, the producers' and the backlog."""
        producers = self.streams.producers() if self.streams else []
        rate = sum(p.get("tok_s", 0.0) for p in producers)
        backlog = sum(shard_ready(self.plan.root, k) is not None for k in self._unread())
        s = self.shared
        assert s is not None
        train_rate = s.stats[Pass.TOKENS] / max(s.stats[Pass.TRAIN_S] / s.workers, 1e-9)
        say(
            f"stream: rank {self.rank} waited {waited:.0f} s for shard {index} (epoch "
            f"{self.epoch}; {s.stats[Pass.WAITED_S] / s.workers:.0f} s in all): producer "
            f"{rate:,.0f} tok/s, trainer {train_rate:,.0f} tok/s, backlog {backlog} shards"
        )

    def _epoch_line(self, shards: int) -> None:
        """One line per streamed epoch: which side waited for the other."""
        producers = self.streams.producers() if self.streams else []
        made = sum(p.get("tokens", 0) for p in producers)
        busy = max((p.get("busy_s", 0.0) for p in producers), default=0.0)
        idle = max((p.get("waiting_s", 0.0) for p in producers), default=0.0)
        s = self.shared
        assert s is not None
        train_s = s.stats[Pass.TRAIN_S] / s.workers
        say(
            f"stream: epoch {self.epoch}, rank {self.rank}: {shards} shards, "
            f"{int(s.stats[Pass.TOKENS]):,} tokens trained in {train_s:.0f} s, "
            f"{s.stats[Pass.WAITED_S] / s.workers:.0f} s waiting for shards; producers: {made:,} "
            f"tokens written in {busy:.0f} s, {idle:.0f} s waiting for the trainer"
        )
