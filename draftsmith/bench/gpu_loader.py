"""bench-gpu's data-path rows: the loader alone, then the step with the loader in front.

``loader_rows``: ``bench-loader``'s passes in shard order at the loader target's shape (bf16
shards written once, kept for the next part). ``end_to_end_rows``: the frozen head's step
at the smallest TTT (the fastest, the hardest to feed) timed as ``bench-train --data`` times
it, on batches from the training loader over those shards (page cache dropped first, one
row per worker count): tokens/s with the loader in the loop, beside the step-only main row
of the same shape, TTT and lm_head (``x step``: the share of the step's rate that survives).
"""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

from draftsmith.bench.flops import StepFlops
from draftsmith.bench.gpu_config import BenchGpuConfig, Options


def loader_rows(cfg: BenchGpuConfig) -> dict:
    """bench-loader's passes in shard order; the shards stay for ``end_to_end_rows``."""
    from draftsmith.bench.loader import BenchLoaderConfig
    from draftsmith.bench.loader import run as run_loader

    lcfg = BenchLoaderConfig(
        model=cfg.loader_target or cfg.targets[0], tokens=cfg.loader_tokens,
        sample_tokens=cfg.loader_sample_tokens, row_tokens=cfg.row_tokens,
        storage_dtypes=["bfloat16"], caches=[cfg.loader_cache], workers=cfg.loader_workers,
        order="shards", work_dir=cfg.work_dir, output=None, keep=True, breakdown=True,
    )  # fmt: skip
    return {"status": "ok", **run_loader(lcfg)}


def end_to_end_row(cfg: BenchGpuConfig, target: str, ttt: int, options: Options, data: Path,
                   workers: int, peak: float | None) -> dict:  # fmt: skip
    """The frozen head's step on the loader's batches (``bench-train --data``)."""
    from draftsmith.bench.gpu import measure, train_config, trainable
    from draftsmith.bench.train import prepare

    bcfg = replace(train_config(cfg, target, ttt, "frozen", options), data=str(data),
                   order="shards", num_workers=workers, cold=True)  # fmt: skip
    bench = prepare(bcfg)
    lm = bench.head.logits_weight.numel()
    flops = StepFlops(trainable(bench.head), lm, cfg.draft_vocab_size * bench.hidden_size, ttt)
    row = measure(bench, flops, replace(cfg, profile_steps=0), peak)
    seconds = row["seconds_per_step"] * cfg.steps
    row.update(workers=workers, real_tokens_per_s=int(bench.real_tokens) / seconds)
    return row


def end_to_end_rows(cfg: BenchGpuConfig, loader: dict, rows: list[dict], options: Options,
                    peak: float | None, guarded) -> list[dict]:  # fmt: skip
    """One row per loader worker count, against the step-only main row; the shards go after."""
    kept = loader.get("shards_kept_in")
    if not kept:
        return []
    target = cfg.loader_target or cfg.targets[0]
    ttt = min(cfg.ttt_steps)
    key = ("draftsmith", target, ttt, "frozen")
    base = next((r for r in rows if r["status"] == "ok"
                 and (r["trainer"], r["target"], r["ttt"], r["lm_head"]) == key), None)  # fmt: skip
    data, out = Path(kept) / "bfloat16", []
    try:
        for workers in cfg.loader_workers:
            label = f"end to end {Path(target).name} TTT {ttt}, {workers} loader workers"
            row = guarded(lambda w=workers: end_to_end_row(cfg, target, ttt, options, data, w,
                                                           peak), label)  # fmt: skip
            step = base["tokens_per_s"] if base else None
            ok = step and row.get("status") == "ok"
            out.append({"target": target, "ttt": ttt, "lm_head": "frozen", "workers": workers,
                        **row, "step_only_tokens_per_s": step,
                        "x_step": row["tokens_per_s"] / step if ok else None})  # fmt: skip
    finally:
        shutil.rmtree(kept, ignore_errors=True)
    return out
