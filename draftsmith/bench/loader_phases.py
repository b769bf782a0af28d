"""What ``bench-loader`` compares the loader with, and where a token's time goes.

- ``raw_read``: the same shard files read by a plain sequential read in the same run (one
  process, ``readinto`` of 8 MiB blocks into one reused buffer: what ``dd bs=8M`` does), from
  a cold or a warm page cache. A loader pass's **x raw** is its bytes/s over this.
- ``breakdown``: one pass in the benchmark's own process (no workers), each phase timed
  where it happens (``sample_io.PHASES``): ``open`` (the data module, each shard's header),
  ``read`` (the preads into the batch, page faults of its fresh memory included),
  ``checksum`` (xxh3-64 of each sample, or an older shard's sha256), ``pack`` (positions,
  documents, padding), ``collate`` (allocating the batch), then what training does with a
  batch after the loader: ``pin`` (copy into pinned memory) and ``h2d`` (the side-stream
  copy, waited for) where CUDA is, and ``decode`` (stored states to the drafters' batch: on
  the GPU after the copy, on the CPU here). ``other`` is the rest of the wall time.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from draftsmith.core.memory import evict, warm

PHASES_SHOWN = ("open", "read", "checksum", "pack", "collate", "pin", "h2d", "decode", "other")
BLOCK = 8 << 20


def set_cache(files: list[Path], cache: str) -> None:
    if cache == "cold":
        evict(files)
    else:
        warm(files)


def raw_read(files: list[Path], cache: str) -> dict:
    """Seconds and MB/s of one sequential read of ``files`` (cache ``cold`` or ``warm``)."""
    set_cache(files, cache)
    buf = bytearray(BLOCK)
    size = 0
    start = time.perf_counter()
    for path in files:
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(buf):
                size += n
    seconds = time.perf_counter() - start
    return {"cache": cache, "bytes": size, "seconds": seconds, "mb_per_s": size / seconds / 1e6}


def breakdown(data: Path, files: list[Path], cache: str, module_kwargs: dict) -> dict:
    """One timed pass in this process (``module_kwargs``: the data module's, 0 workers)."""
    from draftsmith.dataset.sample_io import PHASES
    from draftsmith.train.data import StatesDataModule
    from draftsmith.train.packing import PAD_DOC_ID

    set_cache(files, cache)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    PHASES.reset(on=True)
    tokens = 0
    start = time.perf_counter()
    try:
        with PHASES("open"):
            module = StatesDataModule(str(data), **{**module_kwargs, "num_workers": 0})
            loader = module.train_dataloader()
        for batch in loader:
            tokens += int((batch["doc_ids"] != PAD_DOC_ID).sum())
            if cuda:
                with PHASES("pin"):
                    batch = {k: v.pin_memory() for k, v in batch.items()}
                batch = module.copy(batch, device)  # timed as h2d inside
                with PHASES("h2d"):
                    torch.cuda.synchronize()
            with PHASES("decode"):
                module.model_batch(batch)
                if cuda:
                    torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        phases = dict(PHASES.seconds)
    finally:
        PHASES.reset(on=False)
    phases["other"] = max(seconds - sum(phases.values()), 0.0)
    return {
        "cache": cache,
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "device": str(device),
        "phases_s": phases,
    }


def breakdown_lines(storage: str, rows: list[dict]) -> list[str]:
    """The breakdown of each cache state: seconds, microseconds per token and share."""
    lines = [f"where a token's time goes ({storage}, in-process pass, no workers):"]
    head = f"  {'phase':<9}" + "".join(f" {r['cache'] + ' s':>9} {'us/tok':>7} {'share':>6}"
                                       for r in rows)  # fmt: skip
    lines.append(head)
    for name in PHASES_SHOWN:
        if not any(name in r["phases_s"] for r in rows):
            continue
        cells = ""
        for r in rows:
            s = r["phases_s"].get(name, 0.0)
            cells += f" {s:>9.3f} {1e6 * s / max(r['tokens'], 1):>7.1f} {s / r['seconds']:>6.0%}"
        lines.append(f"  {name:<9}{cells}")
    lines.append(
        f"  {'total':<9}"
        + "".join(
            f" {r['seconds']:>9.3f} {1e6 * r['seconds'] / max(r['tokens'], 1):>7.1f} {'':>6}"
            for r in rows
        )  # fmt: skip
    )
    where = "the GPU, after the copy" if rows and rows[0]["device"] == "cuda" else "the CPU here"
    lines.append(f"  (decode runs on {where}; pin and h2d only where CUDA is)")
    return lines
