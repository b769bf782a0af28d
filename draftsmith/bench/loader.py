"""`draftsmith bench-loader`: tokens/s of the training data path alone, no model.

Writes synthetic shards in the real on-disk format (``write_shard``, sidecars, plan and
``build_manifest``, as ``draftsmith extract`` does) with a target's shapes, then times
passes of the training loader over them (``StatesDataModule.train_dataloader``: open the
dataset, read each sample as stored into the batch, check its xxh3-64, pack rows, and copy
into pinned memory where CUDA makes pinning possible), for each storage dtype, page cache
state (cold: every shard evicted first and checked with ``mincore``; warm: read once first)
and DataLoader worker count. A pass is the loader's second epoch (workers started, batch
pools filled, the cache state set again): the steady state a run reads at; the first epoch,
worker start included, is reported beside it. Beside each pass: the same files read by a
plain sequential read in the same run (**x raw** = the pass's bytes/s over it), and per
storage dtype where a token's time goes, phase by phase (``loader_phases.py``). Prints
tables, writes JSON.

    draftsmith bench-loader                        # Llama-3.1-8B shapes, bf16 and fp8
    draftsmith bench-loader --tokens 196608 --workers '[1, 2, 4]'
    draftsmith bench-loader --order samples --storage_dtypes '[bfloat16]'

What it reports against: the trainer's appetite at that shape (the H200's TTT-3 step with
every lever, docs/benchmarks.md) and the disk bandwidth that takes (bytes/token x tok/s).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from draftsmith.bench.loader_phases import breakdown, breakdown_lines, raw_read, set_cache
from draftsmith.core.config import parse_config, to_dict
from draftsmith.core.errors import ConfigError, exit_code
from draftsmith.core.memory import resident_fraction
from draftsmith.core.outputs import check_output, json_from
from draftsmith.core.targets import TargetInfo, default_layer_ids, read_target, validate_layer_ids

TRAINER_TOKENS_PER_S = 57401
"""bench-gpu on an H200, Llama-3.1-8B shape, TTT 3, every lever (docs/benchmarks.md,
2026-11-27): the fastest step measured, the hardest to feed."""
GOAL_FACTOR = 2
RAW_GOAL = 0.8
"""A pass should move bytes at >= 0.8x a plain sequential read of the same files."""

StorageDtype = Literal["bfloat16", "float16", "float32", "fp8_e4m3"]


@dataclass
class BenchLoaderConfig:
    """Time the training data path (open, page in, pack, collate, pin) on synthetic shards."""

    model: str = "configs/targets/llama3.1-8b"
    """Target whose shapes the shards take (hidden size, number of layers); a directory
    with only a config.json is enough."""
    layer_ids: list[int] | None = None
    """Tapped layers as ``draftsmith extract`` takes them; null = its default [2, N//2, N-3, N]."""
    tokens: int = 49152
    """Tokens written per storage dtype (the bf16 Llama shape takes 32 KiB each on disk)."""
    sample_tokens: int = 1024
    """Mean tokens per sample; lengths are uniform in [mean/2, 3*mean/2], seeded."""
    samples_per_shard: int = 32
    """Samples per shard file (as ``extract.samples_per_shard``)."""
    row_tokens: int = 4096
    """Tokens per packed row (as ``data.row_tokens``)."""
    batch_size: int = 1
    """Rows per batch (as ``data.batch_size``)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    """Dtype of the states the loader hands to the model (as ``data.dtype``)."""
    storage_dtypes: list[StorageDtype] = field(default_factory=lambda: ["bfloat16", "fp8_e4m3"])
    """Storage dtypes to write and read (as ``extract.dtype``)."""
    caches: list[Literal["cold", "warm"]] = field(default_factory=lambda: ["cold", "warm"])
    """Page cache states: cold (shards evicted before the pass) and/or warm (read before)."""
    workers: list[int] = field(default_factory=lambda: [1, 2])
    """DataLoader worker counts to time (as ``data.num_workers``; 0 = in the main process)."""
    breakdown: bool = True
    """Also time one pass per storage dtype and cache state in this process, phase by phase
    (open, read, checksum, pack, collate, pin, h2d, decode)."""
    order: Literal["samples", "shards"] = "shards"
    """The loader's order (as ``data.order``): samples, or shards (plan order, rows packed
    within each shard: what a streamed run reads)."""
    seed: int = 0
    """Seeds the sample lengths, token ids, states and the packing."""
    work_dir: str = "outputs/bench-loader"
    """Where the shards are written, in a fresh subdirectory; put it on the disk your
    datasets live on (a cold cache cannot be had on tmpfs)."""
    check_shards: bool = True
    """Check each sample's xxh3-64 as it is read, as training does (as ``data.check_shards``)."""
    keep: bool = False
    """Keep the written shards (by default their directory is removed at the end)."""
    output: str | None = "outputs/bench-loader/result.json"
    """JSON file for the figures; null = print the table only. An existing file
    bench-loader did not write is refused (see `overwrite`)."""
    overwrite: bool = False
    """Replace `output` even if bench-loader did not write it."""


def check_config(cfg: BenchLoaderConfig) -> None:
    if cfg.tokens < 1 or cfg.samples_per_shard < 1 or cfg.batch_size < 1:
        raise ConfigError(
            f"tokens={cfg.tokens}, samples_per_shard={cfg.samples_per_shard}, batch_size="
            f"{cfg.batch_size}: each must be at least 1"
        )
    longest = (3 * cfg.sample_tokens) // 2
    if cfg.sample_tokens < 2 or longest > cfg.row_tokens:
        raise ConfigError(
            f"sample_tokens: {cfg.sample_tokens} gives samples of up to {longest} tokens, "
            f"which must fit row_tokens={cfg.row_tokens} (nothing may be truncated, so that "
            f"every written token is read); give sample_tokens in [2, {2 * cfg.row_tokens // 3}]"
        )
    if not cfg.workers or min(cfg.workers) < 0:
        raise ConfigError(f"workers: {cfg.workers}; give worker counts >= 0, e.g. [1, 2]")
    if not cfg.storage_dtypes or not cfg.caches:
        raise ConfigError("storage_dtypes and caches each need at least one entry")


def sample_lengths(tokens: int, mean: int, seed: int) -> list[int]:
    """Lengths uniform in [mean/2, 3*mean/2] summing to exactly ``tokens`` (the last cut)."""
    gen = torch.Generator().manual_seed(seed)
    low, high = max(1, mean // 2), (3 * mean) // 2
    lengths: list[int] = []
    left = tokens
    while left > 0:
        n = min(int(torch.randint(low, high + 1, (1,), generator=gen)), left)
        lengths.append(n)
        left -= n
    return lengths


def write_synthetic(
    out: Path, target: TargetInfo, layer_ids: list[int], storage: str, cfg: BenchLoaderConfig
) -> dict:
    """A complete dataset of random states in ``out``, written as extract writes one."""
    from draftsmith.conversations.sources import SkipLog
    from draftsmith.core.files import write_json_atomic
    from draftsmith.dataset.manifest import build_manifest, shard_name, sidecar_path, write_plan
    from draftsmith.dataset.shards import write_shard

    lengths = sample_lengths(cfg.tokens, cfg.sample_tokens, cfg.seed)
    ids = [f"synthetic-{k}" for k in range(len(lengths))]
    shards = [ids[i : i + cfg.samples_per_shard] for i in range(0, len(ids), cfg.samples_per_shard)]
    gen = torch.Generator().manual_seed(cfg.seed)
    longest = max(lengths)
    # One pool of states: samples are slices at random offsets (values do not change I/O).
    pool = torch.randn(2 * longest, len(layer_ids), target.hidden_size, generator=gen)
    pool = pool.to(torch.bfloat16)  # [2 * longest, L, H]
    fp = {"synthetic": True, "storage_dtype": storage, "seed": cfg.seed}
    write_plan(out, fp, shards, SkipLog().to_dict())
    length = dict(zip(ids, lengths, strict=True))
    for index, shard in enumerate(shards):
        samples = []
        for sid in shard:
            n = length[sid]
            at = int(torch.randint(0, longest + 1, (1,), generator=gen))
            mask = torch.ones(n, dtype=torch.bool)
            mask[: n // 4] = False  # a prompt, then the reply
            samples.append(
                {
                    "id": sid,
                    "input_ids": torch.randint(0, target.vocab_size, (n,), generator=gen),
                    "loss_mask": mask,
                    "hidden_states": pool[at : at + n],  # [n, L, H]
                }
            )
        info = write_shard(out / shard_name(index), samples, storage)
        write_json_atomic(sidecar_path(out, index), {**info.to_dict(), "skipped": []})
    config = {"dtype": storage, "synthetic": True, "bench": "bench-loader", "seed": cfg.seed}
    return build_manifest(out, target, layer_ids, config)


def module_kwargs(cfg: BenchLoaderConfig, workers: int) -> dict:
    """The data module's options for a pass (training's, with no validation split)."""
    return dict(
        row_tokens=cfg.row_tokens,
        batch_size=cfg.batch_size,
        val_fraction=0.0,
        num_workers=workers,
        seed=cfg.seed,
        dtype=cfg.dtype,
        check_shards=cfg.check_shards,
        order=cfg.order,
    )


def one_pass(data: Path, cfg: BenchLoaderConfig, workers: int, files: list[Path],
             cache: str) -> dict:  # fmt: skip
    """Read every packed row twice through one training loader: the first epoch starts the
    workers and fills their batch pools (``first_*``: what a run's first seconds see), the
    second, with the page cache set to ``cache`` again, is timed as the steady state a
    training run reads at after its first batches."""
    from draftsmith.train.batch_pool import release
    from draftsmith.train.data import StatesDataModule
    from draftsmith.train.packing import PAD_DOC_ID

    def epoch(loader) -> tuple[int, int, int, float, float]:
        start = time.perf_counter()
        tokens = row_tokens = batches = 0
        first = 0.0
        for batch in loader:
            if not batches:
                first = time.perf_counter() - start
            tokens += int((batch["doc_ids"] != PAD_DOC_ID).sum())
            row_tokens += batch["input_ids"].numel()
            batches += 1
            release(batch)  # as training does once the batch is on the GPU
        return tokens, row_tokens, batches, first, time.perf_counter() - start

    set_cache(files, cache)
    resident_first = resident_fraction(files)
    start = time.perf_counter()
    module = StatesDataModule(str(data), **module_kwargs(cfg, workers))
    loader = module.train_dataloader()
    opened = time.perf_counter() - start
    first_tokens, _, _, first_batch, first_s = epoch(loader)
    set_cache(files, cache)
    resident = resident_fraction(files)
    load = os.getloadavg()[0]
    tokens, row_tokens, batches, _, seconds = epoch(loader)
    pinned = bool(loader.pin_memory)  # what the training loader chose (CUDA present)
    del loader  # stops persistent workers
    return {
        "tokens": tokens,
        "row_tokens": row_tokens,
        "batches": batches,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "resident_before": resident,
        "first_epoch_tokens": first_tokens,
        "first_epoch_s": opened + first_s,
        "first_epoch_tokens_per_s": first_tokens / (opened + first_s),
        "first_batch_s": opened + first_batch,
        "first_resident_before": resident_first,
        "pinned": pinned,
        "load_1m_before": load,
        "load_1m_after": os.getloadavg()[0],
    }


def run(cfg: BenchLoaderConfig) -> dict:
    check_config(cfg)
    target = read_target(cfg.model)
    ids = (
        cfg.layer_ids if cfg.layer_ids is not None else default_layer_ids(target.num_hidden_layers)
    )
    layer_ids = validate_layer_ids(ids, target.num_hidden_layers)
    Path(cfg.work_dir).mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="shards-", dir=cfg.work_dir))
    passes, datasets, raw, phases = [], {}, [], []
    try:
        for storage in cfg.storage_dtypes:
            data = root / storage
            started = time.perf_counter()
            manifest = write_synthetic(data, target, layer_ids, storage, cfg)
            files = [data / s["file"] for s in manifest["shards"]]
            file_bytes = sum(f.stat().st_size for f in files)
            datasets[storage] = {
                "tokens_written": manifest["num_tokens"],
                "samples": manifest["num_samples"],
                "shards": len(files),
                "bytes_per_token": manifest["bytes_per_token"],
                "file_bytes_per_token": file_bytes / manifest["num_tokens"],
                "write_s": time.perf_counter() - started,
            }
            for cache in cfg.caches:
                base = {"storage_dtype": storage, **raw_read(files, cache)}
                base["load_1m"] = os.getloadavg()[0]
                raw.append(base)
                for workers in cfg.workers:
                    row = {"storage_dtype": storage, "cache": cache, "workers": workers}
                    row.update(one_pass(data, cfg, workers, files, cache))
                    row["disk_mb_per_s"] = file_bytes / row["seconds"] / 1e6
                    row["x_raw"] = row["disk_mb_per_s"] / base["mb_per_s"]
                    first_mb_s = file_bytes / row["first_epoch_s"] / 1e6
                    row["first_epoch_x_raw"] = first_mb_s / base["mb_per_s"]
                    passes.append(row)
                if cfg.breakdown:
                    kwargs = module_kwargs(cfg, 0)
                    phases.append({"storage_dtype": storage,
                                   **breakdown(data, files, cache, kwargs)})  # fmt: skip
            if not cfg.keep:
                shutil.rmtree(data)
    finally:
        if not cfg.keep:
            shutil.rmtree(root, ignore_errors=True)
    goal = GOAL_FACTOR * TRAINER_TOKENS_PER_S
    for info in datasets.values():
        info["disk_mb_per_s_at_goal"] = info["file_bytes_per_token"] * goal / 1e6
    return {
        "config": to_dict(cfg),
        "shape": {
            "target": target.path,
            "hidden_size": target.hidden_size,
            "layer_ids": layer_ids,
        },
        "cpus": len(os.sched_getaffinity(0))
        if hasattr(os, "sched_getaffinity")
        else os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "pin_memory": bool(torch.cuda.is_available()),
        "goal_tokens_per_s": goal,
        "datasets": datasets,
        "raw_reads": raw,
        "passes": passes,
        "breakdown": phases,
        "shards_kept_in": str(root) if cfg.keep else None,
    }


def table(result: dict) -> str:
    """The figures as a few lines of text."""
    shape, cfg = result["shape"], result["config"]
    lines = [
        f"bench-loader: {len(shape['layer_ids'])} layers {shape['layer_ids']} x hidden "
        f"{shape['hidden_size']}, rows of {cfg['row_tokens']} x {cfg['batch_size']}, states "
        f"as {cfg['dtype']}, {cfg['order']} order; {result['cpus']} CPUs, torch threads "
        f"{result['torch_threads']}",
        "pin_memory: on (CUDA)"
        if result["pin_memory"]
        else "pin_memory: not measured (no CUDA: the loader pins only for a GPU); "
        "figures end at the batch in shared memory",
        "raw: the same files, one process reading 8 MiB blocks (x raw = a pass's MB/s over it)",
    ]
    for r in result["raw_reads"]:
        lines.append(
            f"  raw {r['storage_dtype']:<9} {r['cache']:<5} {r['mb_per_s']:>9,.0f} MB/s "
            f"({r['bytes'] / 1e6:,.0f} MB in {r['seconds']:.2f} s; load 1m {r['load_1m']:.2f})"
        )
    lines.append(
        f"{'storage':<9} {'cache':<5} {'workers':>7} {'tokens':>8} {'tokens/s':>9} "
        f"{'MB/s':>7} {'x raw':>6} {'1st batch s':>11} {'x raw 1st':>9} {'resident':>8} "
        f"{'load 1m':>7}"
    )
    for p in result["passes"]:
        res = "-" if p["resident_before"] is None else f"{p['resident_before']:.0%}"
        lines.append(
            f"{p['storage_dtype']:<9} {p['cache']:<5} {p['workers']:>7} {p['tokens']:>8,} "
            f"{p['tokens_per_s']:>9,.0f} {p['disk_mb_per_s']:>7,.0f} {p['x_raw']:>6.2f} "
            f"{p['first_batch_s']:>11.2f} {p['first_epoch_x_raw']:>9.2f} {res:>8} "
            f"{p['load_1m_after']:>7.2f}"
        )
    lines.append(
        "a pass: the steady state (the loader's second epoch: workers started, batch pools "
        "filled, the cache set again); 1st batch s and x raw 1st: its first epoch, opening "
        "and worker start included"
    )
    lines.append(f"goal on any machine: each pass >= {RAW_GOAL}x raw (cold and warm)")
    goal = result["goal_tokens_per_s"]
    lines.append(
        f"trainer: {TRAINER_TOKENS_PER_S:,} tok/s (an H200 training the Llama-3.1-8B-shape "
        f"head at TTT 3, docs/benchmarks.md); {GOAL_FACTOR}x that = {goal:,} tok/s"
    )
    for storage, d in result["datasets"].items():
        best = max(p["tokens_per_s"] for p in result["passes"] if p["storage_dtype"] == storage)
        lines.append(
            f"{storage}: {d['bytes_per_token']:,} bytes/token (+ headers: "
            f"{d['file_bytes_per_token']:,.0f}); {GOAL_FACTOR}x the trainer needs "
            f"{d['disk_mb_per_s_at_goal']:,.0f} MB/s; best pass here {best:,.0f} tok/s "
            f"({best / TRAINER_TOKENS_PER_S:.2f}x the trainer)"
        )
    for storage in result["datasets"]:
        rows = [b for b in result["breakdown"] if b["storage_dtype"] == storage]
        if rows:
            lines += breakdown_lines(storage, rows)
    return "\n".join(lines)


def main(args: list[str] | None = None) -> int:
    def go() -> int:
        cfg = parse_config(BenchLoaderConfig, args, prog="draftsmith bench-loader")
        check_config(cfg)
        # work_dir only ever gets a fresh subdirectory: any directory there will do.
        check_output(cfg.work_dir, "work_dir", lambda _dir: True)
        if cfg.output:
            own = json_from("bench-loader")
            check_output(cfg.output, "output", own, overwrite=cfg.overwrite, is_file=True)
        result = {"command": "bench-loader", **run(cfg)}
        print(table(result), flush=True)
        if cfg.output:
            Path(cfg.output).parent.mkdir(parents=True, exist_ok=True)
            Path(cfg.output).write_text(json.dumps(result, indent=2) + "\n")
            print(f"figures: {cfg.output}")
        return 0

    return exit_code("draftsmith bench-loader", go)


if __name__ == "__main__":
    sys.exit(main())
