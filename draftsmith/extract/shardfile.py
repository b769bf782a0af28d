"""A shard's safetensors file, read without the safetensors library.

The format: 8 bytes of little-endian header length, a JSON header mapping each tensor name
to ``dtype``, ``shape`` and ``data_offsets`` (plus ``__metadata__``), then the raw bytes.
Reading the header alone tells where every tensor starts, so a sample's rows can be copied
out of a memory map without touching the rest of the file.
"""

from __future__ import annotations

import json
import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from draftsmith.core.errors import DatasetError
from draftsmith.extract.store import SAFETENSORS_DTYPES

MAX_HEADER_BYTES = 1 << 28


@dataclass(frozen=True)
class TensorSpec:
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file


def read_header(path: Path) -> tuple[dict[str, TensorSpec], dict[str, str]]:
    """Parse a safetensors header: ``({name: spec with absolute start}, __metadata__)``."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise DatasetError(f"{path}: too short to be a safetensors file")
        (length,) = struct.unpack("<Q", raw)
        if length > min(size - 8, MAX_HEADER_BYTES):
            raise DatasetError(f"{path}: header length {length} does not fit the file")
        try:
            header = json.loads(f.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise DatasetError(f"{path}: unreadable safetensors header ({exc})") from exc
    data_start = 8 + length
    metadata = header.pop("__metadata__", None) or {}
    tensors = {}
    for name, entry in header.items():
        if entry["dtype"] not in SAFETENSORS_DTYPES:
            raise DatasetError(f"{path}: tensor {name} has unsupported dtype {entry['dtype']}")
        dtype = SAFETENSORS_DTYPES[entry["dtype"]]
        shape = tuple(int(d) for d in entry["shape"])
        begin, end = entry["data_offsets"]
        if end - begin != math.prod(shape) * dtype.itemsize or data_start + end > size:
            raise DatasetError(
                f"{path}: tensor {name} {list(shape)} has inconsistent "
                f"data_offsets {[begin, end]} (file of {size} bytes)"
            )
        tensors[name] = TensorSpec(dtype, shape, data_start + begin)
    return tensors, metadata


def read_rows(mapped: mmap.mmap, spec: TensorSpec, first: int, rows: int) -> torch.Tensor:
    """Rows ``first:first + rows`` (along dim 0) of a tensor in a mapped file, copied out.

    Only those rows' pages are touched. The copy goes into a private ``bytearray``: the
    result is an ordinary writable tensor and no view into the (read-only) map survives.
    """
    row_bytes = math.prod(spec.shape[1:]) * spec.dtype.itemsize
    shape = (rows, *spec.shape[1:])
    if rows * row_bytes == 0:
        return torch.empty(shape, dtype=spec.dtype)
    start = spec.start + first * row_bytes
    buf = bytearray(rows * row_bytes)
    with memoryview(mapped) as view:
        buf[:] = view[start : start + len(buf)]
    return torch.frombuffer(buf, dtype=spec.dtype).view(shape)
