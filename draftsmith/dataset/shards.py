"""Shard files: many samples' hidden states in one safetensors file, written atomically and
read back without the safetensors library.

A shard concatenates its samples along the token axis (N tokens, S samples, L layers,
hidden size H):

- ``sample_offsets`` int64 ``[S + 1]``: sample s spans tokens ``offsets[s]:offsets[s + 1]``
- ``input_ids`` int32 ``[N]`` and ``loss_mask`` uint8 ``[N]``
- ``hidden_states`` ``[N, L, H]`` in the storage dtype (bf16, f16, f32 or fp8 e4m3)
- ``hidden_scales`` float32 ``[N, L]``, fp8 only: ``value ≈ fp8 * scale`` per token and layer

Besides the whole file's sha256, ``ShardInfo.sample_xxh3`` records each sample's xxh3-64 over
its bytes as stored (``input_ids``, ``loss_mask``, ``hidden_states``, then ``hidden_scales``
where present, each over the sample's token range): the loader checks every sample on the
bytes it has just read, so no second pass over the file is needed (``dataset/sample_io.py``).

The file is plain safetensors (any safetensors reader opens it). It is written by hand
rather than through ``safetensors.torch.save`` so that samples stream to disk without a
concatenated copy, the sha256 is computed from the bytes as they are written, and every
tensor starts at an offset aligned to its element size (see ``_TENSOR_ORDER``), which
lets the reader map tensors straight out of the file.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import torch
import xxhash

from draftsmith.core.errors import DatasetError
from draftsmith.core.files import write_atomic
from draftsmith.core.readers import check_file, check_shape, parse_json

SHARD_FIX = "delete it and its .json sidecar, then re-run the same `draftsmith extract` command"

FORMAT = "draftsmith.hidden_states"
STORAGE_DTYPES = ("bfloat16", "float16", "float32", "fp8_e4m3")
FP8_MAX = 448.0  # largest finite float8_e4m3fn value

TORCH_STORAGE_DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "fp8_e4m3": torch.float8_e4m3fn,
}
# safetensors dtype strings <-> torch dtypes, for the dtypes a shard can hold.
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F8_E4M3": torch.float8_e4m3fn,
    "I32": torch.int32,
    "I64": torch.int64,
    "U8": torch.uint8,
}
_SAFETENSORS_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}

# Largest element size first: each tensor's byte length is a multiple of its own element
# size, so every tensor then starts aligned (the header is padded to 8 bytes).
_TENSOR_ORDER = ("sample_offsets", "hidden_scales", "input_ids", "hidden_states", "loss_mask")


def _check_storage_dtype(storage_dtype: str) -> None:
    if storage_dtype not in STORAGE_DTYPES:
        raise ValueError(f"storage dtype {storage_dtype!r} is not one of {list(STORAGE_DTYPES)}")


def bytes_per_token(num_layers: int, hidden: int, storage_dtype: str) -> int:
    """Bytes one token takes on disk, not counting the shard header and sample offsets.

    ``L * H * itemsize`` for the hidden states, 4 for the int32 token id, 1 for the
    uint8 loss mask, and for ``fp8_e4m3`` another ``4 * L`` for the float32 scales.
    """
    _check_storage_dtype(storage_dtype)
    itemsize = TORCH_STORAGE_DTYPES[storage_dtype].itemsize
    scales = 4 * num_layers if storage_dtype == "fp8_e4m3" else 0
    return num_layers * hidden * itemsize + 4 + 1 + scales


def encode_hidden(h: torch.Tensor, storage_dtype: str) -> dict[str, torch.Tensor]:
    """Convert float hidden states ``[T, L, H]`` to their stored form.

    Returns ``{"hidden_states": [T, L, H]}`` in the storage dtype, plus for ``fp8_e4m3``
    ``{"hidden_scales": float32 [T, L]}`` with ``scale = absmax / 448`` per token and
    layer (1.0 for all-zero rows), so that ``decode_hidden`` gives back ``fp8 * scale``.
    """
    _check_storage_dtype(storage_dtype)
    if storage_dtype != "fp8_e4m3":
        return {"hidden_states": h.to(TORCH_STORAGE_DTYPES[storage_dtype]).contiguous()}
    h32 = h.to(torch.float32)
    absmax = h32.abs().amax(dim=-1)  # [T, L]
    scales = torch.where(absmax > 0, absmax / FP8_MAX, torch.ones_like(absmax))
    q = (h32 / scales.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return {"hidden_states": q.contiguous(), "hidden_scales": scales.contiguous()}


def decode_hidden(
    hidden: torch.Tensor, scales: torch.Tensor | None, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Stored hidden states ``[T, L, H]`` (+ fp8 scales ``[T, L]``) to ``dtype`` ``[T, L, H]``."""
    if hidden.dtype == torch.float8_e4m3fn:
        if scales is None:
            raise ValueError("fp8 hidden states need their hidden_scales to be decoded")
        return (hidden.to(torch.float32) * scales.to(torch.float32).unsqueeze(-1)).to(dtype)
    return hidden.to(dtype)


@dataclass
class ShardInfo:
    """What the manifest records about one written shard."""

    file: str  # file name, relative to the dataset directory
    samples: int
    tokens: int
    loss_tokens: int
    bytes: int
    sha256: str
    sample_ids: list[str] = field(default_factory=list)
    sample_xxh3: list[str] = field(default_factory=list)  # per sample: ``sample_digest``

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ShardInfo:
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


def _validate(samples: list[dict]) -> tuple[int, int]:
    """Check every sample's shapes; return the shared ``(num_layers, hidden)``."""
    shape: tuple[int, int] | None = None
    seen: set[str] = set()
    for k, s in enumerate(samples):
        missing = {"id", "input_ids", "loss_mask", "hidden_states"} - set(s)
        if missing:
            raise ValueError(f"sample {k} lacks {sorted(missing)}")
        sid = s["id"]
        if not isinstance(sid, str):
            raise ValueError(f"sample {k}: id must be a str, got {type(sid).__name__}")
        if sid in seen:
            raise ValueError(f"sample id {sid!r} appears twice in one shard")
        seen.add(sid)
        ids, mask, h = s["input_ids"], s["loss_mask"], s["hidden_states"]
        if ids.dim() != 1 or ids.numel() == 0:
            raise ValueError(
                f"sample {sid!r}: input_ids must be a non-empty 1-D [T] tensor, "
                f"got shape {list(ids.shape)}"
            )
        t = ids.numel()
        if list(mask.shape) != [t]:
            raise ValueError(
                f"sample {sid!r}: loss_mask shape {list(mask.shape)} does not match input_ids [{t}]"
            )
        if h.dim() != 3 or h.shape[0] != t:
            raise ValueError(
                f"sample {sid!r}: hidden_states must be [T={t}, L, H], got {list(h.shape)}"
            )
        if not h.is_floating_point():
            raise ValueError(f"sample {sid!r}: hidden_states must be floating point, got {h.dtype}")
        if shape is None:
            shape = (h.shape[1], h.shape[2])
        elif (h.shape[1], h.shape[2]) != shape:
            raise ValueError(
                f"sample {sid!r}: hidden_states [*, {h.shape[1]}, {h.shape[2]}] "
                f"differ from earlier samples' [*, {shape[0]}, {shape[1]}]"
            )
    return shape if shape is not None else (0, 0)


def sample_digest(pieces: list[Any]) -> str:
    """xxh3-64 (hex) of a sample's stored bytes: its ``input_ids``, ``loss_mask``,
    ``hidden_states`` and (fp8) ``hidden_scales`` ranges, in that order."""
    digest = xxhash.xxh3_64()
    for piece in pieces:
        digest.update(piece)
    return digest.hexdigest()


def _raw(t: torch.Tensor) -> memoryview:
    """A tensor's bytes (host order, i.e. little-endian on every supported platform)."""
    flat = t.detach().cpu().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())


def write_shard(path: Path, samples: list[dict], storage_dtype: str) -> ShardInfo:
    """Write ``samples`` as one shard at ``path``, atomically; return its ``ShardInfo``.

    Each sample is ``{"id": str, "input_ids": [T], "loss_mask": [T], "hidden_states":
    float [T, L, H]}`` with the same L and H throughout. The file appears under its final
    name only once complete and fsynced; on any failure the temporary file is removed.
    """
    _check_storage_dtype(storage_dtype)
    path = Path(path)
    num_layers, hidden = _validate(samples)
    lengths = [s["input_ids"].numel() for s in samples]
    offsets = torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0)
    n = int(offsets[-1])
    encoded = [encode_hidden(s["hidden_states"], storage_dtype) for s in samples]
    masks = [s["loss_mask"].to(torch.uint8) for s in samples]
    if any(bool((m > 1).any()) for m in masks):
        raise ValueError("loss_mask values must be 0 or 1")

    # name -> (dtype, shape, pieces): the pieces (one per sample) are written back to back.
    layout: dict[str, tuple[torch.dtype, list[int], list[torch.Tensor]]] = {
        "sample_offsets": (torch.int64, [len(samples) + 1], [offsets]),
        "input_ids": (torch.int32, [n], [s["input_ids"].to(torch.int32) for s in samples]),
        "loss_mask": (torch.uint8, [n], masks),
        "hidden_states": (
            TORCH_STORAGE_DTYPES[storage_dtype],
            [n, num_layers, hidden],
            [e["hidden_states"] for e in encoded],
        ),
    }
    if storage_dtype == "fp8_e4m3":
        scales = [e["hidden_scales"] for e in encoded]
        layout["hidden_scales"] = (torch.float32, [n, num_layers], scales)

    sample_ids = [s["id"] for s in samples]
    pieces = [layout[name][2] for name in ("input_ids", "loss_mask", "hidden_states")]
    if storage_dtype == "fp8_e4m3":
        pieces.append(layout["hidden_scales"][2])
    digests = [sample_digest([_raw(p[k]) for p in pieces]) for k in range(len(samples))]
    header: dict[str, Any] = {
        "__metadata__": {
            "format": FORMAT,
            "sample_ids": json.dumps(sample_ids),
            "storage_dtype": storage_dtype,
        }
    }
    start = 0
    names = [name for name in _TENSOR_ORDER if name in layout]
    for name in names:
        dtype, shape, _ = layout[name]
        size = math.prod(shape) * dtype.itemsize
        header[name] = {
            "dtype": _SAFETENSORS_NAMES[dtype],
            "shape": shape,
            "data_offsets": [start, start + size],
        }
        start += size
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)

    def write(f: BinaryIO, digest: Any) -> None:
        for chunk in (len(header_bytes).to_bytes(8, "little"), header_bytes):
            f.write(chunk)
            digest.update(chunk)
        for name in names:
            for piece in layout[name][2]:
                data = _raw(piece)
                f.write(data)
                digest.update(data)

    sha, size = write_atomic(path, write, what="shard")
    return ShardInfo(
        file=path.name,
        samples=len(samples),
        tokens=n,
        loss_tokens=int(sum(int(m.sum()) for m in masks)),
        bytes=size,
        sha256=sha,
        sample_ids=sample_ids,
        sample_xxh3=digests,
    )


# ----- reading ---------------------------------------------------------------------
# The format: 8 bytes of little-endian header length, a JSON header mapping each tensor name
# to ``dtype``, ``shape`` and ``data_offsets`` (plus ``__metadata__``), then the raw bytes.
# Reading the header alone tells where every tensor starts, so a sample's rows can be read
# without touching the rest of the file (``reader.py``, ``sample_io.py``).
MAX_HEADER_BYTES = 1 << 28


@dataclass(frozen=True)
class TensorSpec:
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file


def read_header(path: Path) -> tuple[dict[str, TensorSpec], dict[str, str]]:
    """Parse a safetensors header: ``({name: spec with absolute start}, __metadata__)``."""
    check_file(path, "shard", SHARD_FIX)
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise DatasetError(f"{path}: too short to be a safetensors file ({SHARD_FIX})")
        (length,) = struct.unpack("<Q", raw)
        if length > min(size - 8, MAX_HEADER_BYTES):
            raise DatasetError(
                f"{path}: header length {length} does not fit the file of {size} bytes; the "
                f"shard is cut short or not a safetensors file ({SHARD_FIX})"
            )
        header = parse_json(f.read(length), path, "shard", SHARD_FIX)
    check_shape(header, path, "shard", SHARD_FIX)
    data_start = 8 + length
    metadata = header.pop("__metadata__", None) or {}
    tensors = {}
    for name, entry in header.items():
        try:
            dtype = SAFETENSORS_DTYPES[entry["dtype"]]
            shape = tuple(int(d) for d in entry["shape"])
            begin, end = (int(x) for x in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise DatasetError(
                f"{path}: tensor {name!r} has a malformed header entry {entry!r} ({SHARD_FIX})"
            ) from None
        if end - begin != math.prod(shape) * dtype.itemsize or data_start + end > size:
            raise DatasetError(
                f"{path}: tensor {name} {list(shape)} has inconsistent "
                f"data_offsets {[begin, end]} (file of {size} bytes; {SHARD_FIX})"
            )
        tensors[name] = TensorSpec(dtype, shape, data_start + begin)
    if not isinstance(metadata, dict):
        raise DatasetError(f"{path}: its __metadata__ is not an object ({SHARD_FIX})")
    return tensors, metadata


def check_tensors(
    path: Path, tensors: dict[str, TensorSpec], storage_dtype: str, num_layers: int, hidden: int
) -> None:
    """Refuse a shard whose tensors are missing or of other dtypes or shapes than its
    dataset's (``storage_dtype``, ``num_layers`` x ``hidden``)."""
    required = ["sample_offsets", "input_ids", "loss_mask", "hidden_states"]
    if storage_dtype == "fp8_e4m3":
        required.append("hidden_scales")
    missing = [name for name in required if name not in tensors]
    if missing:
        raise DatasetError(f"{path}: missing tensors {missing}")
    n = tensors["input_ids"].shape[0]
    hidden_rows = (n, num_layers) if n else tensors["hidden_states"].shape[:2]
    expected = {  # an empty shard is written without L and H: take them as they are
        "sample_offsets": (torch.int64, tensors["sample_offsets"].shape[:1]),
        "input_ids": (torch.int32, (n,)),
        "loss_mask": (torch.uint8, (n,)),
        "hidden_states": (
            TORCH_STORAGE_DTYPES[storage_dtype],
            (*hidden_rows, hidden if n else tensors["hidden_states"].shape[-1]),
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
