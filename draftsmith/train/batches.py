"""Batches as the loader hands them over (stored form) and as a head reads them.

The loader reads each sample's states as stored, straight into the batch it builds (one
``pread`` per sample into shared memory inside a worker: no per-layer split, no decode, no
stacking copy), so a worker moves bytes at about the speed a plain sequential read does.
A stored batch holds, for B rows of T tokens:

- ``states`` [B, T, L, H] in the storage dtype (bf16, f16, f32 or fp8 e4m3): the L tapped
  layers the head reads (``Layout.layers``: its aux layers and the teacher's, ascending);
- ``scales`` float32 [B, T, L], fp8 storage only;
- ``input_ids``, ``position_ids``, ``doc_ids``, ``loss_mask`` as in the model's batch.

``model_batch`` turns it into the batch every drafter trains on
(``drafters.protocol.batch``: ``aux_states`` [B, T, n_aux * H], ``teacher_states`` [B, T, H]
in ``data.dtype``): on the device, after the copy (``StatesDataModule.on_after_batch_transfer``),
so fp8 crosses PCIe as fp8 and is decoded by the GPU. The values are those the loader made
before this change, element for element (the same decode, padding zero).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from torch.utils.data import get_worker_info

from draftsmith.dataset import HiddenStatesDataset
from draftsmith.dataset.sample_io import PHASES
from draftsmith.dataset.shards import TORCH_STORAGE_DTYPES
from draftsmith.drafters.protocol.batch import PAD_DOC_ID
from draftsmith.train.batch_pool import SLOT_KEY, BatchPool, Shapes, shared


@dataclass(frozen=True)
class Layout:
    """What a stored batch holds, and how ``model_batch`` splits it."""

    row_tokens: int
    hidden: int
    storage: torch.dtype
    fp8: bool
    layers: tuple[int, ...]
    """Positions on the dataset's layer axis that are read (aux and teacher), ascending."""
    aux: tuple[int, ...]
    """Positions of the aux layers within ``layers``, ascending."""
    teacher: int
    """Position of the teacher layer within ``layers``."""
    all_layers: bool
    """``layers`` is the dataset's whole layer axis: a sample is one read into the batch."""


def layout(ds: HiddenStatesDataset, row_tokens: int, aux_ids: list[int], teacher_id: int) -> Layout:
    read = sorted({*aux_ids, teacher_id})
    return Layout(
        row_tokens=row_tokens,
        hidden=ds.hidden_size,
        storage=TORCH_STORAGE_DTYPES[ds.storage_dtype],
        fp8=ds.storage_dtype == "fp8_e4m3",
        layers=tuple(ds.layer_ids.index(i) for i in read),
        aux=tuple(read.index(i) for i in aux_ids),
        teacher=read.index(teacher_id),
        all_layers=read == list(ds.layer_ids),
    )


def batch_shapes(lay: Layout, rows: int) -> Shapes:
    """The buffers of a stored batch of ``rows`` rows: name -> (shape, dtype)."""
    t, n = lay.row_tokens, len(lay.layers)
    shapes = {
        "input_ids": ((rows, t), torch.long),
        "states": ((rows, t, n, lay.hidden), lay.storage),
        "position_ids": ((rows, t), torch.long),
        "doc_ids": ((rows, t), torch.long),
        "loss_mask": ((rows, t), torch.bool),
    }
    if lay.fp8:
        shapes["scales"] = ((rows, t, n), torch.float32)
    return shapes


def new_batch(lay: Layout, rows: int, pool: BatchPool | None = None) -> dict[str, Tensor]:
    """Buffers of a stored batch of ``rows`` rows (``fill_row`` writes each row): a free
    slot of ``pool`` in a worker, else fresh (shared memory in a worker)."""
    shapes = batch_shapes(lay, rows)
    batch = pool.take(shapes) if pool is not None else None
    if batch is None:
        in_worker = get_worker_info() is not None
        batch = {k: shared(*v) if in_worker else torch.empty(*v[:1], dtype=v[1])
                 for k, v in shapes.items()}  # fmt: skip
    return batch


def fill_row(ds: HiddenStatesDataset, lay: Layout, batch: dict[str, Tensor], b: int,
             samples: list[int]) -> None:  # fmt: skip
    """Row ``b`` of ``batch``: ``samples`` back to back (each cut to what fits), then
    padding (ids 0, positions counting on, doc ``PAD_DOC_ID``, mask false, states 0)."""
    t = lay.row_tokens
    states, scales = batch["states"][b], batch["scales"][b] if lay.fp8 else None
    ids, pos, docs, mask = (batch[k][b] for k in ("input_ids", "position_ids", "doc_ids",
                                                   "loss_mask"))  # fmt: skip
    layers = None if lay.all_layers else list(lay.layers)
    start = 0
    for doc, i in enumerate(samples):
        n = min(ds.lengths[i], t - start)
        span = slice(start, start + n)
        ds.read_into(i, ids[span], mask[span], states[span],
                     scales[span] if scales is not None else None, layers)  # fmt: skip
        with PHASES("pack"):
            pos[span] = torch.arange(n)
            docs[span] = doc
        start += n
    with PHASES("pack"):
        ids[start:] = 0
        pos[start:] = torch.arange(t - start)
        docs[start:] = PAD_DOC_ID
        mask[start:] = False
        states[start:] = 0
        if scales is not None:
            scales[start:] = 0


def empty_batch(lay: Layout, rows: int) -> dict[str, Tensor]:
    """A batch of padding only: no loss, no gradient (keeps ranks in step)."""
    batch = new_batch(lay, rows)
    for b in range(rows):
        fill_row(None, lay, batch, b, [])  # type: ignore[arg-type]
    return batch


def model_batch(batch: dict[str, Tensor], lay: Layout, dtype: torch.dtype) -> dict[str, Tensor]:
    """The drafters' batch from a stored one, on whatever device it is: ``aux_states``
    [..., T, n_aux * H] and ``teacher_states`` [..., T, H] in ``dtype`` (fp8 de-scaled
    as ``shards.decode_hidden`` does). A batch already in that form passes through."""
    if "states" not in batch:
        return batch
    out = {k: v for k, v in batch.items() if k not in ("states", "scales", SLOT_KEY)}
    states, scales = batch["states"], batch.get("scales")

    def decode(x: Tensor, s: Tensor | None) -> Tensor:
        if s is None:
            return x.to(dtype)
        return (x.to(torch.float32) * s.to(torch.float32).unsqueeze(-1)).to(dtype)

    aux = list(lay.aux)
    pick = states[..., aux, :]  # [..., T, n_aux, H], a copy
    out["aux_states"] = decode(pick, scales[..., aux] if scales is not None else None).flatten(-2)
    teacher = states[..., lay.teacher, :]  # [..., T, H]
    s = scales[..., lay.teacher] if scales is not None else None
    out["teacher_states"] = decode(teacher, s).contiguous()
    return out


class SideStreamCopy:
    """Host-to-device copies of batches on a side CUDA stream.

    The loader's batches arrive pinned (the DataLoader pins them in the training process's
    pin thread: pinning inside forked workers is unsafe). Issued on the training stream, a
    non-blocking copy waits behind the previous step's queued kernels; on its own stream it
    starts at once, on the copy engine, while they run, and the training stream waits only
    for it. Off CUDA it is a plain ``.to(device)``."""

    def __init__(self) -> None:
        self.stream: torch.cuda.Stream | None = None

    def __call__(self, batch: dict[str, Tensor], device: torch.device) -> dict[str, Tensor]:
        if device.type != "cuda" or not torch.cuda.is_available():
            return {k: v.to(device) for k, v in batch.items()}
        if self.stream is None:
            self.stream = torch.cuda.Stream(device)
        main = torch.cuda.current_stream(device)
        with PHASES("h2d"), torch.cuda.stream(self.stream):
            out = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        main.wait_stream(self.stream)
        for v in out.values():
            v.record_stream(main)  # not reused by the side stream before the step is done
        return out
