"""Training data: the Lightning data module over a draftsmith dataset, for every drafter
kind. Samples are packed into rows by ``packing.py`` and read, as stored, straight into
the loader's batches (``batches.py``); on the device, after the copy (a side CUDA stream
on a GPU), each batch becomes the one every drafter trains on (``input_ids``,
``aux_states``, ``teacher_states``, ``position_ids``, ``doc_ids``, ``loss_mask``, each
[B, T, ...]: ``draftsmith.drafters.protocol.batch``)."""

from __future__ import annotations

import math
import time
from functools import partial
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.utils.data import DataLoader

from draftsmith.core.console import say
from draftsmith.core.errors import ConfigError
from draftsmith.core.targets import TargetInfo
from draftsmith.dataset import DatasetError, HiddenStatesDataset, open_dataset
from draftsmith.dataset.stream import StreamDir, StreamOptions
from draftsmith.train.batch_pool import SLOT_KEY, BatchPool, detach_from, release
from draftsmith.train.batches import SideStreamCopy, layout, model_batch
from draftsmith.train.packing import (  # token_counts: imported from here too
    PackedDataset,
    ResumableLoader,
    RowSampler,
    add_noise,
    collate,
    pack,
    resolve_aux_layers,
    split_samples,
    teacher_layer_id,
    token_counts,
    worker_init,
)
from draftsmith.train.shard_loader import ShardLoader
from draftsmith.train.shard_order import ShardBatches
from draftsmith.train.shard_plan import ShardPlan
from draftsmith.train.shard_window import open_window

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class StatesDataModule(pl.LightningDataModule):
    """Packed rows of a draftsmith dataset for training a draft head (batch: module doc).

    Args:
        data: the dataset directory written by ``draftsmith extract``.
        row_tokens: tokens per packed row (T); longer samples are truncated to it.
        batch_size: rows per batch (B).
        val_fraction: fraction of samples held out for validation (split by sample, seeded;
            at least one when the dataset has two or more, 0 disables validation, 1 makes every
            sample validation: ``draftsmith train validate`` on a whole dataset). Ignored
            when ``val_data`` is given.
        max_train_samples: train on the first N training samples only (in the dataset's
            order, after the validation split, so smaller N are nested subsets of larger
            ones): data-scaling curves at a fixed validation set. Null: every sample.
        val_data: a separate dataset to validate on, e.g. a held-out slice of a broad
            source answered by the target (``sharegpt@heldout``): then every sample of
            ``data`` trains, and the simulated acceptance predicts serving on prompts the
            head never saw rather than on the training set's own kind. Same target and
            tapped layers as ``data``.
        num_workers: DataLoader worker processes (0: read in the training process). In
            shard order (and so when streaming) worker ``j % num_workers`` reads batch j of
            the pass, so every count gives the same batches in the same order.
        seed: seeds the split, the packing and the row order (reshuffled every epoch).
        aux_layers: tapped layer ids that feed the head, concatenated in ascending order;
            default all but the last (EAGLE-3); EAGLE-1 uses the last one alone, ``[N]``.
        noise_std: std of i.i.d. Gaussian noise N(0, noise_std^2) added to every element of
            ``aux_states`` of real tokens, in training batches only (absolute, in the units of
            the target's hidden states); 0 disables it.
        dtype: dtype of the states handed to the model.
        workers_keep_memory: DataLoader workers keep the memory they free instead of
            returning it (glibc ``mallopt``): at an 8B shape a packed row is ~100 MB and
            re-faulting it every batch cost 2.5x the loader's time (``make bench-loader``);
            the price is each worker keeping its peak heap (0.5-1.5 GB there).
        check_shards: check what is read: each sample against its xxh3-64 in the manifest
            as its bytes are read (shards written since 2026-11-28), or an older shard's
            sha256 once per run before any of its samples trains; a flipped byte is refused
            in one line. False skips it (``make bench-loader`` measures the cost).
        prefetch_factor: batches each loader worker reads ahead of the step (as torch's
            DataLoader takes it); more hides uneven reads, each costs a batch of shared
            memory (at an 8B shape ~130 MB a row in bf16).
        order: samples (every training sample packed together, rows shuffled each epoch) or
            shards (plan order, rows packed and shuffled within each shard: the order a
            streamed run trains in, whatever order shards arrive in; ``shard_order.py``).
            In shard order the draft vocabulary, the schedule's length (estimated for the
            whole epoch) and the ``val_fraction`` split come from the first ``fit_shards``
            shards, and batch and position are per shard.
        fit_shards: shard order: how many leading shards the draft vocabulary, the schedule
            length and the validation split are taken from (null: every shard offline,
            ``stream.shards`` when streaming; at most ``stream.shards`` then).
        stream: train while ``draftsmith extract --stream true`` writes ``data`` (shard
            order): the disk bound, the policy after each epoch, the producer timeout
            (``draftsmith.dataset.stream``). Null: the dataset is already extracted.
        sequence_parallel: ranks that share each row, each holding ``row_tokens / N`` of its
            states (Ulysses all-to-all attention; ``drafters/attention/sequence_parallel.py``):
            rows of 64k tokens on 8 GPUs. Consecutive ranks form a group and get the same
            rows; it must divide the process count and ``row_tokens``. Serial TTT (eagle3).
    """

    def __init__(
        self,
        data: str,
        row_tokens: int = 2048,
        batch_size: int = 1,
        val_fraction: float = 0.05,
        val_data: str | None = None,
        max_train_samples: int | None = None,
        num_workers: int = 2,
        seed: int = 0,
        aux_layers: list[int] | None = None,
        noise_std: float = 0.0,
        dtype: Literal["float32", "bfloat16", "float16"] = "float32",
        workers_keep_memory: bool = True,
        check_shards: bool = True,
        prefetch_factor: int = 2,
        order: Literal["samples", "shards"] = "samples",
        fit_shards: int | None = None,
        stream: StreamOptions | None = None,
        sequence_parallel: int = 1,
    ) -> None:
        super().__init__()
        if sequence_parallel < 1 or row_tokens % sequence_parallel:
            raise ConfigError(
                f"data.sequence_parallel: {sequence_parallel}; give a divisor of data.row_tokens "
                f"{row_tokens} (1: each rank trains whole rows)"
            )
        self.sequence_parallel = sequence_parallel
        if row_tokens < 1 or batch_size < 1 or num_workers < 0 or noise_std < 0:
            raise ConfigError(
                "data: row_tokens and batch_size must be >= 1, num_workers and noise_std >= 0; "
                f"got {row_tokens}, {batch_size}, {num_workers}, {noise_std}"
            )
        if prefetch_factor < 1:
            raise ConfigError(f"data.prefetch_factor: {prefetch_factor}; give at least 1")
        self.prefetch_factor = prefetch_factor
        self.copy = SideStreamCopy()
        self.data, self.row_tokens, self.batch_size = data, row_tokens, batch_size
        self.val_data = val_data
        self.num_workers, self.seed, self.noise_std = num_workers, seed, noise_std
        self.workers_keep_memory = workers_keep_memory
        self.dtype, self.check_shards = DTYPES[dtype], check_shards
        self.stream, self.epochs_cap = stream, None
        self.window_wait_s = 0.0  # streaming: seconds spent waiting for the first shards
        self.order = "shards" if stream is not None else order
        self.shard_plan: ShardPlan | None = None
        self.listed: dict[int, dict[str, Any]] | None = None
        if self.order == "shards":
            if max_train_samples is not None:
                raise ConfigError(
                    "data.max_train_samples: shard order trains whole shards; drop it, or use "
                    "data.order: samples on an extracted dataset"
                )
            if stream is not None and stream.policy == "drop":
                self.epochs_cap = 1  # each shard trains once
            started = time.monotonic()
            self.dataset, self.all_shards, self.listed = open_window(
                data, fit_shards, stream, DTYPES[dtype], check_shards
            )
            self.window_wait_s = time.monotonic() - started if stream is not None else 0.0
        else:
            self.dataset = open_dataset(data, dtype=DTYPES[dtype], check_shards=check_shards)
        self.manifest: dict[str, Any] = self.dataset.manifest
        self.layer_ids: list[int] = list(self.dataset.layer_ids)
        self.teacher_layer_id = teacher_layer_id(self.manifest, data)
        self.aux_layer_ids = resolve_aux_layers(self.layer_ids, aux_layers)
        self.layout = layout(self.dataset, row_tokens, self.aux_layer_ids, self.teacher_layer_id)
        self.hidden_size: int = self.dataset.hidden_size
        self.vocab_size: int = int(self.manifest["target"]["vocab_size"])
        self.target_path: str = self.manifest["target"]["path"]
        self.train_indices, self.val_indices = split_samples(
            len(self.dataset), val_fraction, seed, ids=self.dataset.ids
        )
        self.val_dataset = self.dataset
        if stream is not None and stream.policy != "keep" and val_fraction > 0 and not val_data:
            say(
                f"train: data.stream.policy {stream.policy}: the {len(self.val_indices)} "
                "validation samples' shards are kept on disk (give data.val_data to keep none)"
            )
        if val_data:
            self.val_dataset = open_dataset(
                val_data, dtype=DTYPES[dtype], check_shards=check_shards
            )
            theirs = self.val_dataset.manifest
            for key in ("layer_ids", "hidden_size"):
                if theirs.get(key) != self.manifest.get(key):
                    raise DatasetError(
                        f"data.val_data: {val_data} has {key} {theirs.get(key)}, the training "
                        f"data {data} {self.manifest.get(key)}; extract both with the same "
                        "target and layer_ids"
                    )
            self.train_indices = list(range(len(self.dataset)))
            self.val_indices = list(range(len(self.val_dataset)))
        if max_train_samples is not None:
            if max_train_samples < 1:
                raise ConfigError(
                    f"data.max_train_samples: {max_train_samples}; give at least 1, or null "
                    "for every sample"
                )
            self.train_indices = self.train_indices[:max_train_samples]
        self._train_counts: Tensor | None = None  # ``train_token_counts``, read on first use
        lengths = self.dataset.lengths
        self.num_truncated = sum(n > row_tokens for n in lengths)
        self.tokens_cut = sum(max(n - row_tokens, 0) for n in lengths)
        if self.num_truncated:  # said, not warned: the pipeline sends warnings to its log
            say(
                f"train: {data}: {self.num_truncated} of {len(lengths)} samples are longer than "
                f"data.row_tokens={row_tokens}; their tails, {self.tokens_cut:,} of "
                f"{sum(lengths):,} tokens, are not trained on. Set data.row_tokens to "
                f"{max(lengths)} (the longest sample) to keep them"
            )

    def train_token_counts(self, vocab_size: int) -> Tensor:
        """``token_counts`` of the training samples, read once per data module (the draft
        vocabulary, the loss vocabulary and the mask token all ask for it)."""
        if self._train_counts is None:
            self._train_counts = token_counts(self.dataset, vocab_size, self.train_indices)
        return self._train_counts

    def check_target(self, target: TargetInfo) -> None:
        """Raise ``DatasetError`` naming each field where the dataset's target differs."""
        mine = self.manifest["target"]
        pairs = {
            "hidden_size": (self.hidden_size, target.hidden_size),
            "vocab_size": (self.vocab_size, target.vocab_size),
            "num_hidden_layers": (mine["num_hidden_layers"], target.num_hidden_layers),
            "config_sha256": (mine["config_sha256"], target.config_sha256),
        }
        bad = [f"{k} {a!r} (dataset) != {b!r} (target)" for k, (a, b) in pairs.items() if a != b]
        if bad:
            raise DatasetError(
                f"{self.data} was extracted from {mine['path']}, which differs from the target "
                f"{target.path}: {'; '.join(bad)}. Train against the model the dataset was "
                "extracted from, or re-extract the dataset with this target."
            )

    def _loader(self, dataset: HiddenStatesDataset, indices: list[int], seed: int | None):
        lengths = [dataset.lengths[i] for i in indices]
        rows = [[indices[i] for i in row] for row in pack(lengths, self.row_tokens, seed)]
        sampler = RowSampler(len(rows), seed, *self.ranks())
        slots = self.prefetch_factor + 3  # prefetched, pinning, training, fetched ahead
        pool = BatchPool(self.num_workers, slots) if self.num_workers else None
        return ResumableLoader(
            PackedDataset(dataset, rows, self.row_tokens, self.aux_layer_ids, pool),
            batches_done=self._batches_done,
            batch_size=self.batch_size,
            sampler=sampler,
            num_workers=self.num_workers,
            collate_fn=collate,
            worker_init_fn=partial(worker_init, keep_memory=self.workers_keep_memory),
            pin_memory=torch.cuda.is_available(),
            persistent_workers=self.num_workers > 0,
            prefetch_factor=self.prefetch_factor if self.num_workers else None,
        )

    def num_train_batches(self) -> int:
        """Training batches per epoch on each rank (the packing is computed, no data read;
        in shard order, estimated from the first ``fit_shards`` shards)."""
        if self.order == "shards":
            plan, world = self._shard_plan(), self.ranks()[1]
            window = [int(p.stem.split("-")[1]) for p in self.dataset.shard_paths]
            per_shard = sum(plan.batches(k, plan.info(k)) for k in window)
            per_shard /= max(len(window), 1)
            return max(1, math.ceil(per_shard * math.ceil(len(self.all_shards) / world)))
        lengths = [self.dataset.lengths[i] for i in self.train_indices]
        rows = len(pack(lengths, self.row_tokens, self.seed))
        per_rank = math.ceil(rows / self.ranks()[1])
        return math.ceil(per_rank / self.batch_size)

    def ranks(self) -> tuple[int, int]:
        """(this rank's data-parallel index, their count): the ranks sharing a row
        (``sequence_parallel``) are consecutive and read the same rows."""
        if self.trainer is None:
            return 0, 1
        sp = self.sequence_parallel
        return self.trainer.global_rank // sp, max(self.trainer.world_size // sp, 1)

    def _batches_done(self) -> int:
        """Training batches this rank has finished in the current epoch (for resuming)."""
        if self.trainer is None:
            return 0
        return self.trainer.fit_loop.epoch_loop.batch_progress.current.processed

    def train_dataloader(self) -> DataLoader:
        """Packed once (seeded); rows split across ranks and shuffled by ``seed + epoch``
        (shard order: ``shard_order.py``)."""
        if self.order == "shards":
            return self._shard_loader()
        return self._loader(self.dataset, self.train_indices, self.seed)

    def _shard_plan(self) -> ShardPlan:
        if self.shard_plan is None:
            rank, world = self.ranks()
            val_ids = set() if self.val_data else {self.dataset.ids[i] for i in self.val_indices}
            self.shard_plan = ShardPlan(
                Path(self.data),
                [k for k in self.all_shards if k % world == rank],
                self.all_shards,
                self.row_tokens,
                self.batch_size,
                self.seed,
                val_ids,
                self.listed,
                {k: v for k, v in self.manifest.items() if k != "shards"},
            )
        return self.shard_plan

    def _shard_loader(self) -> ShardLoader:
        rank, world = self.ranks()

        def stop() -> None:
            if self.trainer is not None:
                self.trainer.should_stop = True

        batches = ShardBatches(
            self._shard_plan(),
            rank,
            world,
            self.aux_layer_ids,
            self.dtype,
            self.check_shards,
            self.layout,
            lambda: self.trainer.current_epoch if self.trainer else 0,
            self.stream,
            lambda: self.trainer.max_epochs if self.trainer else None,
        )
        return ShardLoader(
            batches,
            self._batches_done,
            num_workers=self.num_workers,
            pin_memory=torch.cuda.is_available(),
            prefetch_factor=self.prefetch_factor,
            worker_init_fn=partial(worker_init, keep_memory=self.workers_keep_memory),
            on_stop=stop,
        )

    def teardown(self, stage: str) -> None:
        """Streaming: tell the producers the trainer is done (rank 0, after fit)."""
        if self.stream is not None and stage == "fit":
            if self.trainer is None or self.trainer.is_global_zero:
                StreamDir(self.data).finish()

    def val_dataloader(self) -> DataLoader | list:
        """Validation rows in a fixed packing and order; [] (no validation) when none."""
        if not self.val_indices:
            return []
        return self._loader(self.val_dataset, self.val_indices, None)

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int):
        """A side CUDA stream on a GPU (``batches.SideStreamCopy``); ``.to`` elsewhere. Once
        copied to a GPU, the worker may refill the batch's buffers (``batch_pool.py``)."""
        out = self.copy(batch, device)
        if device.type == "cuda":
            release(batch)
        return out

    def model_batch(self, batch: dict[str, Tensor]) -> dict[str, Tensor]:
        """The drafters' batch from a loader's (stored) batch, on its device."""
        return model_batch(batch, self.layout, self.dtype)

    def decoded(self, batch: dict[str, Tensor]) -> dict[str, Tensor]:
        """The drafters' batch; a pooled host batch's buffers go back to their worker."""
        out = self.model_batch(batch)
        if SLOT_KEY in batch and batch["states"].device.type == "cpu":
            out = detach_from(out, batch)
            release(batch)
        return out

    def on_after_batch_transfer(self, batch: dict[str, Tensor], dataloader_idx: int) -> Any:
        """On the device: decode the stored states into the drafters' batch, then add
        ``noise_std`` Gaussian noise to training batches only."""
        batch = self.decoded(batch)
        if self.noise_std > 0 and self.trainer is not None and self.trainer.training:
            return add_noise(batch, self.noise_std)
        return batch


def train_tokens(train_dir: Path) -> int:
    """Tokens of the samples that trained the head of a finished train stage (its
    ``stage.yaml``), counted through the same split training used."""
    from draftsmith.core.readers import check_shape, read_yaml

    path = train_dir / "stage.yaml"
    data = read_yaml(path, "yaml config", f"delete {train_dir} to train it again")
    data = check_shape(data.get("data"), path, "yaml config", "its data section is gone")
    dm = StatesDataModule(**data)
    return sum(dm.dataset.lengths[i] for i in dm.train_indices)
