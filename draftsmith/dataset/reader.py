"""Read a draftsmith dataset: random-access samples from its shards, read with ``pread``.

Opening a dataset reads ``manifest.json`` and each shard's header and sample offsets
only. ``ds[i]`` then reads just that sample's token ranges from the shard holding it, so
random access costs one sample's bytes however large the shards are; ``read_into`` reads
them straight into a caller's buffers (the training loader's batches). Safe in
``DataLoader`` workers: file descriptors are never pickled, each process opens its own.

Checks (``check_shards``, on by default): a shard whose sidecar recorded per-sample
xxh3-64 digests (``shards.sample_digest``; every shard written since 2026-11-28) has each
sample checked on the bytes just read, before it is returned: a byte flipped anywhere in a
sample's token ids, loss mask, states or scales is refused in one line naming the shard, the
sample and the command that re-extracts it. An older shard (sha256 only) is hashed whole
the first time a process reads it, as before; shards verified in a process stay verified in
the DataLoader workers it starts (the set travels with the dataset).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import Dataset
from xxhash import xxh3_64

from draftsmith.core.errors import DatasetError
from draftsmith.core.files import sha256_file
from draftsmith.core.readers import parse_json
from draftsmith.dataset.sample_io import PHASES, OpenFiles, byte_view, pread_into, will_need
from draftsmith.dataset.shards import (
    FORMAT,
    TORCH_STORAGE_DTYPES,
    TensorSpec,
    check_tensors,
    decode_hidden,
    read_header,
)

FORMAT_VERSIONS = (1,)
MAX_OPEN_SHARDS = 128  # file descriptors kept per process; older ones are closed (LRU)
HASH_CHUNK = 4 << 20
"""Bytes read, then hashed, at a time: the hash reads them from the CPU cache, not DRAM
(measured on the 2-core machine, warm page cache, one process: 3.4 GB/s read then hashed
whole, 4.0 GB/s in 4 MiB pieces, 5.8 GB/s read without hashing)."""


@dataclass
class _Shard:
    path: Path
    tensors: dict[str, TensorSpec]
    offsets: list[int]  # [S + 1] token offsets of the samples
    sample_ids: list[str]
    sha256: str | None = None  # the manifest's checksum of the whole file
    digests: list[str] | None = None  # per sample xxh3-64 (shards written since 2026-11-28)


class HiddenStatesDataset(Dataset):
    """Samples ``{"id", "input_ids" [T], "loss_mask" [T], "hidden_states" [T, L, H]}``.

    Attributes: ``manifest`` (parsed manifest.json), ``lengths`` (tokens per sample, for
    packing without touching hidden states), ``ids``, ``layer_ids``, ``num_layers``,
    ``hidden_size``, ``storage_dtype``.
    """

    def __init__(
        self,
        path: str | Path,
        dtype: torch.dtype = torch.float32,
        allow_incomplete: bool = False,
        verify_checksums: bool = False,
        check_shards: bool = True,
        shard_infos: list[dict[str, Any]] | None = None,
        manifest: dict[str, Any] | None = None,
    ) -> None:
        self.path = Path(path)
        self.dtype = dtype
        self.check_shards = check_shards
        self._verified: set[int] = set()  # shards whose sha256 this process tree checked
        # ``shard_infos``: these shards only (their manifest entries or sidecars), e.g. one
        # shard of a dataset still being written (training shard by shard, streaming).
        # ``manifest``: the dataset's, already read (the loader opens a shard at a time, and
        # a million-sample manifest takes seconds to parse).
        if manifest is None:
            manifest = _load_manifest(self.path, allow_incomplete or shard_infos is not None)
        self.manifest = manifest
        self.storage_dtype: str = self.manifest["storage_dtype"]
        self.layer_ids: list[int] = list(self.manifest["layer_ids"])
        self.num_layers = len(self.layer_ids)
        self.hidden_size: int = int(self.manifest["hidden_size"])
        self._shards: list[_Shard] = []
        for info in self.manifest["shards"] if shard_infos is None else shard_infos:
            shard = self._open_shard(info, verify_checksums)
            if shard.sample_ids:
                self._shards.append(shard)
        self.ids: list[str] = [sid for s in self._shards for sid in s.sample_ids]
        self.lengths: list[int] = [
            b - a for s in self._shards for a, b in zip(s.offsets, s.offsets[1:], strict=False)
        ]
        self._starts = [0]  # global index of each shard's first sample
        for s in self._shards:
            self._starts.append(self._starts[-1] + len(s.sample_ids))
        self._files = OpenFiles(MAX_OPEN_SHARDS)

    def _open_shard(self, info: dict, verify_checksums: bool) -> _Shard:
        path = self.path / info["file"]
        if not path.is_file():
            raise DatasetError(
                f"{self.path}: manifest lists shard {info['file']} but the file is missing; "
                "re-run the same `draftsmith extract` command to write it again"
            )
        rerun = (
            f"delete {path} and its .json sidecar, then re-run the same "
            "`draftsmith extract` command"
        )
        if path.stat().st_size != info["bytes"]:
            raise DatasetError(
                f"{path}: {path.stat().st_size} bytes, manifest says "
                f"{info['bytes']}; the shard is truncated or replaced ({rerun})"
            )
        if verify_checksums and sha256_file(path) != info["sha256"]:
            raise DatasetError(
                f"{path}: sha256 differs from the manifest; the shard is corrupt ({rerun})"
            )
        tensors, metadata = read_header(path)
        if (metadata.get("format"), metadata.get("storage_dtype")) != (FORMAT, self.storage_dtype):
            raise DatasetError(
                f"{path}: format {metadata.get('format')!r} storing "
                f"{metadata.get('storage_dtype')!r}, expected {FORMAT!r} storing "
                f"{self.storage_dtype!r} as the manifest says"
            )
        check_tensors(path, tensors, self.storage_dtype, self.num_layers, self.hidden_size)
        sample_ids = parse_json(metadata.get("sample_ids", ""), path, "shard", rerun)
        if sample_ids != info["sample_ids"]:
            raise DatasetError(f"{path}: its sample ids differ from the manifest's ({rerun})")
        spec = tensors["sample_offsets"]
        with open(path, "rb") as f:
            f.seek(spec.start)
            raw = bytearray(f.read(math.prod(spec.shape) * 8))
        offsets = torch.frombuffer(raw, dtype=torch.int64).tolist() if raw else []
        n = tensors["input_ids"].shape[0]
        if (
            len(offsets) != len(sample_ids) + 1
            or offsets[0] != 0
            or offsets[-1] != n
            or any(b < a for a, b in zip(offsets, offsets[1:], strict=False))
        ):
            raise DatasetError(f"{path}: sample_offsets do not describe its {n} tokens")
        digests = info.get("sample_xxh3") or None
        if digests is not None and len(digests) != len(sample_ids):
            raise DatasetError(
                f"{path}: its record lists {len(digests)} sample checksums for "
                f"{len(sample_ids)} samples ({rerun})"
            )
        return _Shard(path, tensors, offsets, sample_ids, info.get("sha256"), digests)

    def __len__(self) -> int:
        return self._starts[-1]

    @property
    def shard_paths(self) -> list[Path]:
        """The shard files this dataset reads, in order (shards without samples left out)."""
        return [s.path for s in self._shards]

    @property
    def has_digests(self) -> bool:
        """Every shard records per-sample checksums (each sample is checked as read)."""
        return all(s.digests is not None for s in self._shards)

    def _fd(self, k: int) -> int:
        """Shard k's file descriptor in this process; an older shard (no per-sample
        checksums) is hashed whole first, once per process tree."""
        shard = self._shards[k]
        if self.check_shards and shard.digests is None and k not in self._verified:
            self._verify(k)
        return self._files.get(k, shard.path)

    def _verify(self, k: int) -> None:
        """Hash shard k's bytes (whole file) and compare with the manifest's sha256."""
        from draftsmith.core.files import sha256_file

        shard = self._shards[k]
        if shard.sha256 is None:
            return
        with PHASES("checksum"):
            digest = sha256_file(shard.path)
        if digest != shard.sha256:
            raise DatasetError(
                f"{shard.path}: sha256 differs from the manifest's, the shard is corrupt "
                f"(same size, other bytes); re-extract only the corrupt shards with "
                f"`draftsmith extract --output {self.path} --repair true`"
            )
        self._verified.add(k)

    def locate(self, i: int) -> tuple[int, int]:
        """(shard position, sample within it) of sample ``i``."""
        i = int(i)
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"sample index {i} out of range for {len(self)} samples")
        k = bisect.bisect_right(self._starts, i) - 1
        return k, i - self._starts[k]

    def byte_ranges(self, i: int) -> list[tuple[int, int]]:
        """(file offset, length) of sample ``i``'s states (and scales): what a reader asks
        the kernel to read ahead (``will_need``)."""
        k, s = self.locate(i)
        shard = self._shards[k]
        first, last = shard.offsets[s], shard.offsets[s + 1]
        out = []
        for name in ("hidden_states", "hidden_scales"):
            if name in shard.tensors:
                spec = shard.tensors[name]
                row = math.prod(spec.shape[1:]) * spec.dtype.itemsize
                out.append((spec.start + first * row, (last - first) * row))
        return out

    def will_need(self, indices: list[int]) -> None:
        """Start reading these samples' states from disk in the background."""
        for i in indices:
            k, _ = self.locate(i)
            will_need(self._fd(k), self.byte_ranges(i))

    def read_into(
        self,
        i: int,
        ids: Tensor,
        mask: Tensor,
        states: Tensor,
        scales: Tensor | None = None,
        layers: list[int] | None = None,
    ) -> None:
        """Sample ``i``'s first ``n = len(ids)`` tokens, as stored, into the given buffers:
        ``ids`` long [n], ``mask`` bool [n], ``states`` [n, len(layers), H] in the storage
        dtype and, fp8 only, ``scales`` float32 [n, len(layers)]. ``layers``: positions on the
        dataset's layer axis to keep (None: all; then the states are read straight into
        ``states``). The sample's checksum covers all of its bytes, so all are read."""
        k, s = self.locate(i)
        shard, t = self._shards[k], self._shards[k].tensors
        first, last = shard.offsets[s], shard.offsets[s + 1]
        rows, n = last - first, ids.numel()
        if n > rows:
            raise ValueError(f"sample {i} has {rows} tokens, asked for {n}")
        fd = self._fd(k)
        check = self.check_shards and shard.digests is not None
        digest = xxh3_64() if check else None
        whole = layers is None or list(layers) == list(range(self.num_layers))

        def read(name: str, dest: Tensor | None) -> Tensor:
            """Rows first:last of ``name``; its first n rows land in ``dest`` where given."""
            spec = t[name]
            row_bytes = math.prod(spec.shape[1:]) * spec.dtype.itemsize
            shape = (rows, *spec.shape[1:])
            at = spec.start + first * row_bytes
            parts = [dest.view(spec.dtype)] if dest is not None else []
            if dest is None or n < rows:  # the tail (or all of it) goes to scratch
                parts.append(torch.empty((rows - (n if dest is not None else 0), *shape[1:]),
                                         dtype=spec.dtype))  # fmt: skip
            for part in parts:
                view = byte_view(part)
                for lo in range(0, view.nbytes, HASH_CHUNK):  # hashed while still in cache
                    piece = view[lo : lo + HASH_CHUNK]
                    with PHASES("read"):
                        pread_into(fd, piece, at + lo, shard.path)
                    if digest is not None:
                        with PHASES("checksum"):
                            digest.update(piece)
                at += view.nbytes
            return parts[-1] if dest is None else parts[0]

        got_ids = read("input_ids", None)
        ids.copy_(got_ids[:n])
        got_mask = read("loss_mask", mask if n == rows else None)
        if n < rows:
            mask.copy_(got_mask[:n].view(torch.bool))
        if whole:
            read("hidden_states", states)
        else:
            states.copy_(read("hidden_states", None)[:n, layers])
        if "hidden_scales" in t:
            if scales is None:
                raise ValueError("fp8 states need a scales buffer")
            if whole:
                read("hidden_scales", scales)
            else:
                scales.copy_(read("hidden_scales", None)[:n, layers])
        if digest is not None and digest.hexdigest() != shard.digests[s]:
            raise DatasetError(
                f"{shard.path}: sample {shard.sample_ids[s]!r} (tokens {first}-{last}) differs "
                "from its xxh3-64 in the manifest, the shard is corrupt (same size, other "
                f"bytes); re-extract only the corrupt shards with `draftsmith extract --output "
                f"{self.path} --repair true`"
            )

    def __getitem__(self, i: int) -> dict[str, Any]:
        """Sample ``i``: ids/mask ``[T]`` and ``hidden_states`` ``[T, L, H]`` in ``self.dtype``."""
        k, s = self.locate(i)
        shard = self._shards[k]
        rows = shard.offsets[s + 1] - shard.offsets[s]
        stored = TORCH_STORAGE_DTYPES[self.storage_dtype]
        ids, mask = torch.empty(rows, dtype=torch.long), torch.empty(rows, dtype=torch.bool)
        states = torch.empty(rows, self.num_layers, self.hidden_size, dtype=stored)
        scales = None
        if "hidden_scales" in shard.tensors:
            scales = torch.empty(rows, self.num_layers, dtype=torch.float32)
        self.read_into(i, ids, mask, states, scales)
        return {
            "id": shard.sample_ids[s],
            "input_ids": ids,
            "loss_mask": mask,
            "hidden_states": decode_hidden(states, scales, self.dtype),
        }

    def token_ids(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(sample id, ``input_ids`` [T] long) of every sample, without reading hidden states."""
        for k, shard in enumerate(self._shards):
            ids = torch.empty(shard.offsets[-1], dtype=torch.int32)
            spec = shard.tensors["input_ids"]
            pread_into(self._files.get(k, shard.path), byte_view(ids), spec.start, shard.path)
            for s, sid in enumerate(shard.sample_ids):
                yield sid, ids[shard.offsets[s] : shard.offsets[s + 1]].to(torch.long)

    def __repr__(self) -> str:
        return (
            f"HiddenStatesDataset({str(self.path)!r}, samples={len(self)}, "
            f"tokens={sum(self.lengths)}, layers={self.layer_ids}, "
            f"hidden={self.hidden_size}, storage={self.storage_dtype})"
        )


def _load_manifest(path: Path, allow_incomplete: bool) -> dict[str, Any]:
    manifest_path = path / "manifest.json"
    if not manifest_path.is_file():
        why = "no such directory" if not path.is_dir() else "no manifest.json"
        raise DatasetError(
            f"{path} is not a draftsmith dataset: {why}; run `draftsmith extract` first"
        )
    from draftsmith.dataset.manifest import read_manifest  # it imports this package

    manifest = read_manifest(
        manifest_path, "re-run `draftsmith extract` (the same command) to rebuild it"
    )
    if manifest.get("format") != FORMAT:
        raise DatasetError(f"{manifest_path}: format {manifest.get('format')!r} is not {FORMAT}")
    version = manifest.get("format_version")
    if version not in FORMAT_VERSIONS:
        raise DatasetError(
            f"{manifest_path}: format_version {version!r} is unknown (this "
            f"draftsmith reads {list(FORMAT_VERSIONS)}); upgrade draftsmith"
        )
    if manifest.get("storage_dtype") not in TORCH_STORAGE_DTYPES:
        raise DatasetError(
            f"{manifest_path}: unknown storage_dtype {manifest.get('storage_dtype')!r}"
        )
    stopped = manifest.get("stopped_by")  # ended on purpose (time_limit): whole shards
    if not manifest.get("complete", False) and not stopped and not allow_incomplete:
        done = len(manifest.get("shards", []))
        planned = manifest.get("num_shards_planned", "?")
        raise DatasetError(
            f"{path}: extraction is unfinished ({done} of {planned} shards written); resume "
            "it by re-running the same `draftsmith extract` command, or pass "
            "allow_incomplete=True to read the shards written so far"
        )
    return manifest


def open_dataset(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    allow_incomplete: bool = False,
    verify_checksums: bool = False,
    check_shards: bool = True,
) -> HiddenStatesDataset:
    """Open the dataset directory written by ``draftsmith extract``.

    ``dtype`` is the dtype of returned hidden states (fp8 is de-scaled into it).
    ``verify_checksums`` re-hashes every shard against the manifest now (reads all bytes);
    ``check_shards`` hashes each shard lazily instead, the first time a process maps it.
    """
    return HiddenStatesDataset(path, dtype, allow_incomplete, verify_checksums, check_shards)
