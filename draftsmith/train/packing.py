"""Packing: samples of a draftsmith dataset as fixed-length rows, dealt to ranks, resumable.

A row holds whole samples ("documents") back to back, ``row_tokens`` tokens in all, then
padding. The batch each row becomes is described in ``draftsmith.drafters.protocol.batch``.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, Sampler, default_collate

from draftsmith.core.errors import ConfigError
from draftsmith.core.memory import keep_freed_memory
from draftsmith.core.readers import open_safetensors
from draftsmith.core.signals import ignore_first_sigterm
from draftsmith.dataset import DatasetError, HiddenStatesDataset
from draftsmith.dataset.sample_io import PHASES
from draftsmith.dataset.shards import SHARD_FIX
from draftsmith.drafters.protocol.batch import PAD_DOC_ID
from draftsmith.train.batch_pool import BatchPool
from draftsmith.train.batches import fill_row, layout, new_batch


def pack(lengths: list[int], row_tokens: int, shuffle_seed: int | None = None) -> list[list[int]]:
    """Best-fit-decreasing packing of sample indices into rows of at most ``row_tokens``.

    Samples longer than ``row_tokens`` count as ``row_tokens`` (they are truncated when read).
    Every index appears exactly once. ``shuffle_seed`` None: ties keep index order and rows
    come in packing order; an int: ties are broken and the rows ordered at random, the same
    way for the same seed.
    """
    if row_tokens < 1:
        raise ConfigError(f"data.row_tokens: {row_tokens}; give at least 1")
    order = list(range(len(lengths)))
    gen = torch.Generator().manual_seed(shuffle_seed) if shuffle_seed is not None else None
    if gen is not None:
        order = torch.randperm(len(lengths), generator=gen).tolist()
    order.sort(key=lambda i: -min(lengths[i], row_tokens))  # stable: ties keep `order`
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (free tokens, row), sorted; full rows are dropped
    for i in order:
        n = min(lengths[i], row_tokens)
        k = bisect.bisect_left(free, (n, -1))  # the row with the least room that fits
        if k < len(free):
            space, r = free.pop(k)
        else:
            space, r = row_tokens, len(rows)
            rows.append([])
        rows[r].append(i)
        if space > n:
            bisect.insort(free, (space - n, r))
    if gen is not None:
        rows = [rows[r] for r in torch.randperm(len(rows), generator=gen).tolist()]
    return rows


def split_samples(
    n: int, val_fraction: float, seed: int, ids: list[str] | None = None
) -> tuple[list[int], list[int]]:
    """(train, val) sample indices, each sorted: a seeded random ``val_fraction`` of ``n``
    for validation, at least 1 when ``n >= 2`` and ``val_fraction > 0``, never all unless
    ``val_fraction`` is 1 (everything is validation: for ``validate`` on a whole dataset).

    With the samples' ``ids``, whole conversations are split: the per-turn samples of one
    conversation (``<conversation>#<turn>``, which share its prefix) land on one side."""
    if not 0.0 <= val_fraction <= 1.0:
        raise ConfigError(f"data.val_fraction: {val_fraction}; give a share in [0, 1]")
    if val_fraction == 1.0:
        return [], list(range(n))
    groups: dict[str, list[int]] = {}
    for i in range(n):
        key = ids[i].partition("#")[0] if ids is not None else str(i)
        groups.setdefault(key, []).append(i)
    members = list(groups.values())
    g = len(members)
    n_val = min(g - 1, max(1, round(g * val_fraction))) if g >= 2 and val_fraction > 0 else 0
    perm = torch.randperm(g, generator=torch.Generator().manual_seed(seed)).tolist()
    train = sorted(i for k in perm[n_val:] for i in members[k])
    return train, sorted(i for k in perm[:n_val] for i in members[k])


def teacher_layer_id(manifest: dict[str, Any], where: object = "the dataset") -> int:
    """Layer id N of the teacher states; raises unless the dataset tapped layer N."""
    ids, n = list(manifest["layer_ids"]), int(manifest["target"]["num_hidden_layers"])
    if not ids or ids[-1] != n:
        raise DatasetError(
            f"{where}: the dataset has no last-layer states for the teacher: its layer_ids "
            f"{ids} lack {n}, the target's num_hidden_layers (the teacher is the last layer's "
            f"output before the final norm). Re-extract with `--layer_ids "
            f"{sorted({*ids, n})}` (any taps, as long as {n} is among them)."
        )
    return n


def resolve_aux_layers(layer_ids: list[int], aux_layers: list[int] | None) -> list[int]:
    """The layer ids that feed the head, ascending; default: all tapped layers but the last
    (none for a dataset of the last layer alone, which the MTP kind reads)."""
    if aux_layers is None or list(aux_layers) == list(layer_ids[:-1]):
        return list(layer_ids[:-1])
    missing = [i for i in aux_layers if i not in layer_ids]
    if missing or not aux_layers or len(set(aux_layers)) != len(aux_layers):
        raise DatasetError(
            f"aux_layers: {aux_layers} must be distinct, non-empty and among the dataset's "
            f"tapped layer_ids {layer_ids} (missing: {missing})"
        )
    return sorted(aux_layers)


def token_counts(
    ds: HiddenStatesDataset, vocab_size: int, samples: list[int] | None = None
) -> Tensor:
    """How often each token id is a loss-masked (predicted) token: long ``[vocab_size]``,
    over the dataset's samples at positions ``samples`` (all of them when None).

    Reads only ``input_ids``, ``loss_mask`` and ``sample_offsets`` of each shard, never the
    hidden states.
    """
    counts = torch.zeros(vocab_size, dtype=torch.long)
    wanted = None if samples is None else set(samples)
    first = 0  # dataset position of the shard's first sample
    for path in ds.shard_paths:
        with open_safetensors(path, "shard", SHARD_FIX) as f:
            keep = f.get_tensor("loss_mask").bool()
            offsets = f.get_tensor("sample_offsets").tolist()
            if wanted is not None:
                for s, (a, b) in enumerate(zip(offsets, offsets[1:], strict=False)):
                    if first + s not in wanted:
                        keep[a:b] = False
            first += len(offsets) - 1
            ids = f.get_tensor("input_ids").long()[keep]
        if ids.numel() and (ids.min() < 0 or ids.max() >= vocab_size):
            raise DatasetError(
                f"{path}: token ids span [{ids.min()}, {ids.max()}], "
                f"outside a vocabulary of {vocab_size}"
            )
        counts += torch.bincount(ids, minlength=vocab_size)
    return counts


class PackedDataset(Dataset):
    """Rows of packed samples, in stored form (``batches.py``): item ``r`` is one row
    ``[T, ...]``; ``__getitems__`` (what a DataLoader asks for) builds a whole batch
    ``[B, T, ...]`` in place. ``batches.model_batch`` gives the drafters' batch.

    Args:
        ds: the opened dataset.
        rows: sample indices of each row (from ``pack``).
        row_tokens: T, the row length; a sample longer than T is cut to its first T tokens.
        aux_layers: layer ids that feed the head (default: all tapped layers but the last).
        pool: batch buffers the loader's workers reuse (``batch_pool.py``); None: fresh ones.
    """

    def __init__(
        self,
        ds: HiddenStatesDataset,
        rows: list[list[int]],
        row_tokens: int,
        aux_layers: list[int] | None = None,
        pool: BatchPool | None = None,
    ) -> None:
        self.ds, self.rows, self.row_tokens, self.pool = ds, rows, row_tokens, pool
        self.teacher_layer_id = teacher_layer_id(ds.manifest, ds.path)
        self.aux_layer_ids = resolve_aux_layers(ds.layer_ids, aux_layers)
        self.layout = layout(ds, row_tokens, self.aux_layer_ids, self.teacher_layer_id)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, r: int) -> dict[str, Tensor]:
        return {k: v[0] for k, v in self.__getitems__([r]).items()}

    def __getitems__(self, rows: list[int]) -> dict[str, Tensor]:
        """Rows ``rows`` as one stored batch: each sample read straight into it."""
        self.ds.will_need([i for r in rows for i in self.rows[r]])
        with PHASES("collate"):
            batch = new_batch(self.layout, len(rows), self.pool)
        for b, r in enumerate(rows):
            fill_row(self.ds, self.layout, batch, b, self.rows[r])
        return batch


def collate(items: list[dict[str, Tensor]] | dict[str, Tensor]) -> dict[str, Tensor]:
    """A batch built whole by ``PackedDataset.__getitems__`` passes as it is; a list of
    rows is stacked (each key ``[T, ...]`` -> ``[B, T, ...]``)."""
    if isinstance(items, dict):
        return items
    return default_collate(items)


def worker_init(worker_id: int, keep_memory: bool = True) -> None:
    """DataLoader ``worker_init_fn``. The worker ignores the first SIGTERM: sent to the
    whole process group (``timeout``, SLURM), it would kill the worker mid-batch and the
    trainer would die of "DataLoader worker exited unexpectedly" before saving; the trainer
    saves and shuts its workers down itself (``train/preemption.py``), and a worker it could
    not stop is ended by the second (``terminate()`` at exit). With ``keep_memory`` the
    worker keeps the memory it frees, so the ~100 MB buffers of each row do not fault in
    page by page again (``memory.keep_freed_memory``)."""
    ignore_first_sigterm()
    if keep_memory:
        keep_freed_memory()


def add_noise(batch: dict[str, Tensor], std: float) -> dict[str, Tensor]:
    """``aux_states`` + i.i.d. Gaussian N(0, std^2) per element on real tokens (not padding)."""
    real = (batch["doc_ids"] != PAD_DOC_ID).unsqueeze(-1)  # [B, T, 1]
    aux = batch["aux_states"]
    return {**batch, "aux_states": aux + torch.randn_like(aux) * std * real}


class RowSampler(Sampler[int]):
    """This rank's rows of one epoch: a permutation seeded by ``seed + epoch`` (None: in
    order), padded by wrapping to a multiple of ``world_size`` and dealt round-robin.

    ``skip`` rows are left out of the next pass only: that is how a run resumed mid-epoch
    continues where it stopped instead of replaying the epoch (``ResumableLoader``).
    """

    def __init__(self, num_rows: int, seed: int | None, rank: int = 0, world_size: int = 1):
        self.num_rows, self.seed, self.rank, self.world_size = num_rows, seed, rank, world_size
        self.epoch, self.skip = 0, 0

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.epoch, self.skip = epoch, 0

    def order(self) -> list[int]:
        if self.seed is None:
            rows = list(range(self.num_rows))
        else:
            gen = torch.Generator().manual_seed(self.seed + self.epoch)
            rows = torch.randperm(self.num_rows, generator=gen).tolist()
        padded = -(-self.num_rows // self.world_size) * self.world_size
        rows += rows[: padded - self.num_rows] if rows else []
        return rows[self.rank :: self.world_size]

    def __iter__(self) -> Iterator[int]:
        rows, self.skip = self.order()[self.skip :], 0
        return iter(rows)

    def __len__(self) -> int:
        return -(-self.num_rows // self.world_size)  # the whole epoch, as Lightning counts it


class ResumableLoader(DataLoader):
    """A DataLoader over a ``RowSampler`` whose position Lightning saves in checkpoints.

    ``batches_done()`` tells how many batches of the epoch the trainer has finished; a
    checkpoint stores it (with the epoch), and loading it makes the next pass skip them.
    """

    def __init__(self, *args: Any, batches_done: Callable[[], int], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.batches_done = batches_done

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.sampler.epoch, "batches_done": self.batches_done()}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.sampler.epoch = state["epoch"]
        self.sampler.skip = state["batches_done"] * (self.batch_size or 1)
