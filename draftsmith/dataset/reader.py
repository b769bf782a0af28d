"""Read a draftsmith dataset: memory-mapped, random-access samples from its shards.

Opening a dataset reads ``manifest.json`` and each shard's header and sample offsets
only. ``ds[i]`` then maps the shard holding sample i (once per process, lazily) and
copies just that sample's token range out of it, so random access costs one sample's
bytes however large the shards are. Safe in ``DataLoader`` workers: memory maps are never
pickled, each process opens its own.

Every shard's bytes are checked against the manifest's sha256 the first time a process
maps it, before any of its samples is returned (``check_shards``, on by default): a byte
flipped anywhere in a shard is refused in one line naming the shard and the command that
re-extracts it. Hashing reads the shard once through the map, which also warms the page
cache for the samples that follow; shards verified in a process stay verified in the
DataLoader workers it starts (the set travels with the dataset).
"""

from __future__ import annotations

import bisect
import hashlib
import math
import mmap
import os
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from draftsmith.core.errors import DatasetError
from draftsmith.core.files import sha256_file
from draftsmith.core.readers import parse_json
from draftsmith.dataset.shards import (
    FORMAT,
    TORCH_STORAGE_DTYPES,
    TensorSpec,
    decode_hidden,
    read_header,
    read_rows,
)

FORMAT_VERSIONS = (1,)
MAX_OPEN_SHARDS = 128  # memory maps kept per process; older ones are dropped (LRU)


@dataclass
class _Shard:
    path: Path
    tensors: dict[str, TensorSpec]
    offsets: list[int]  # [S + 1] token offsets of the samples
    sample_ids: list[str]
    sha256: str | None = None  # the manifest's checksum of the whole file


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
    ) -> None:
        self.path = Path(path)
        self.dtype = dtype
        self.check_shards = check_shards
        self._verified: set[int] = set()  # shards whose sha256 this process tree checked
        # ``shard_infos``: these shards only (their manifest entries or sidecars), e.g. one
        # shard of a dataset still being written (training shard by shard, streaming).
        self.manifest = _load_manifest(self.path, allow_incomplete or shard_infos is not None)
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
        self._maps: OrderedDict[int, mmap.mmap] = OrderedDict()
        self._pid = os.getpid()

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
        self._check_tensors(path, tensors)
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
        return _Shard(path, tensors, offsets, sample_ids, info.get("sha256"))

    def _check_tensors(self, path: Path, tensors: dict[str, TensorSpec]) -> None:
        required = ["sample_offsets", "input_ids", "loss_mask", "hidden_states"]
        if self.storage_dtype == "fp8_e4m3":
            required.append("hidden_scales")
        missing = [name for name in required if name not in tensors]
        if missing:
            raise DatasetError(f"{path}: missing tensors {missing}")
        n = tensors["input_ids"].shape[0]
        hidden_rows = (n, self.num_layers) if n else tensors["hidden_states"].shape[:2]
        expected = {  # an empty shard is written without L and H: take them as they are
            "sample_offsets": (torch.int64, tensors["sample_offsets"].shape[:1]),
            "input_ids": (torch.int32, (n,)),
            "loss_mask": (torch.uint8, (n,)),
            "hidden_states": (
                TORCH_STORAGE_DTYPES[self.storage_dtype],
                (*hidden_rows, self.hidden_size if n else tensors["hidden_states"].shape[-1]),
            ),
            "hidden_scales": (torch.float32, hidden_rows),
        }
        for name in required:
            (dtype, shape), got = expected[name], tensors[name]
            if got.dtype != dtype or got.shape != shape:
                raise DatasetError(
                    f"{path}: tensor {name} is {got.dtype} {list(got.shape)}, "
                    f"expected {dtype} {list(shape)}"
                )

    def __len__(self) -> int:
        return self._starts[-1]

    @property
    def shard_paths(self) -> list[Path]:
        """The shard files this dataset reads, in order (shards without samples left out)."""
        return [s.path for s in self._shards]

    def _map(self, k: int) -> mmap.mmap:
        """The memory map of shard k, opened on first use in this process."""
        if self._pid != os.getpid():  # a forked worker: start with its own maps
            self._maps, self._pid = OrderedDict(), os.getpid()
        if k in self._maps:
            self._maps.move_to_end(k)
            return self._maps[k]
        with open(self._shards[k].path, "rb") as f:
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        if self.check_shards and k not in self._verified:
            self._verify(k, mapped)
        self._maps[k] = mapped
        if len(self._maps) > MAX_OPEN_SHARDS:
            self._maps.popitem(last=False)
        return mapped

    def _verify(self, k: int, mapped: mmap.mmap) -> None:
        """Hash shard k's mapped bytes (whole file) and compare with the manifest's sha256."""
        shard = self._shards[k]
        if shard.sha256 is None:
            return
        with memoryview(mapped) as view:
            digest = hashlib.sha256(view).hexdigest()
        if digest != shard.sha256:
            mapped.close()
            raise DatasetError(
                f"{shard.path}: sha256 differs from the manifest's, the shard is corrupt "
                f"(same size, other bytes); re-extract only the corrupt shards with "
                f"`draftsmith extract --output {self.path} --repair true`"
            )
        self._verified.add(k)

    def __getitem__(self, i: int) -> dict[str, Any]:
        """Sample ``i``: ids/mask ``[T]`` and ``hidden_states`` ``[T, L, H]`` in ``self.dtype``."""
        i = int(i)
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"sample index {i} out of range for {len(self)} samples")
        k = bisect.bisect_right(self._starts, i) - 1
        shard, s = self._shards[k], i - self._starts[k]
        first, last = shard.offsets[s], shard.offsets[s + 1]
        mapped, rows = self._map(k), last - first
        t = shard.tensors
        hidden = read_rows(mapped, t["hidden_states"], first, rows)
        scales = (
            read_rows(mapped, t["hidden_scales"], first, rows) if "hidden_scales" in t else None
        )
        return {
            "id": shard.sample_ids[s],
            "input_ids": read_rows(mapped, t["input_ids"], first, rows).to(torch.long),
            "loss_mask": read_rows(mapped, t["loss_mask"], first, rows).to(torch.bool),
            "hidden_states": decode_hidden(hidden, scales, self.dtype),
        }

    def token_ids(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(sample id, ``input_ids`` [T] long) of every sample, without reading hidden states."""
        for k, shard in enumerate(self._shards):
            ids = read_rows(self._map(k), shard.tensors["input_ids"], 0, shard.offsets[-1])
            for s, sid in enumerate(shard.sample_ids):
                yield sid, ids[shard.offsets[s] : shard.offsets[s + 1]].to(torch.long)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_maps"] = OrderedDict()  # memory maps stay in the process that opened them
        return state

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
