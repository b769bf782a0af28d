"""`draftsmith bench-gpu`: the device benchmark of GPU training in one call (issue 43).

For each target shape (random weights from ``configs/targets/*``), TTT setting and lm_head
(frozen, trained), one ``bench-train`` row: tokens/s, MFU two ways (``flops.py``: 6NT, and
the hardware's FLOPs with the frozen lm_head's forward and input gradient), peak memory and
a torch.profiler summary (``bench_profile.py``: matmul kernels against the rest, top 10
ops). Then speculators' EAGLE-3 model at the same shapes and TTT (``bench_speculators.py``;
a row says so when speculators is missing), and the training loader in shard order at the
first target's shape with each worker count, against the rate of the frozen head at the
smallest TTT (3: the fastest step, the hardest to feed).
Writes ``bench-gpu.json`` and ``bench-gpu.md`` to ``output`` ($OUT on the device machine),
again after every row, so a run cut short by its time limit still returns the rows it made.

    tools/bench_gpu.sh                         # on the device: carried wheels, then this
    draftsmith bench-gpu --ttt_steps '[7]' --lm_heads '[frozen]' --speculators false

Rows run one after another in this process; each frees its memory before the next, and a
row that fails (out of memory, say) records its error and the rest still run.
"""

from __future__ import annotations

import gc
import os
import resource
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Literal

import torch

from draftsmith.core.config import parse_config, to_dict
from draftsmith.core.errors import ConfigError, exit_code
from draftsmith.core.files import write_json_atomic
from draftsmith.core.outputs import check_output
from draftsmith.drafters.ttt import AttentionImpl
from draftsmith.train import bench_speculators
from draftsmith.train.bench import BenchTrainConfig, Prepared, prepare, time_steps
from draftsmith.train.bench_gpu_report import markdown
from draftsmith.train.bench_profile import profile_steps
from draftsmith.train.flops import StepFlops, peak_tflops

OWN = ("bench-gpu.json", "bench-gpu.md", "bench-gpu.log")


@dataclass
class BenchGpuConfig:
    """Time GPU training of EAGLE-3 heads at 8B shapes, beside speculators and the loader."""

    targets: list[str] = field(
        default_factory=lambda: ["configs/targets/llama3.1-8b", "configs/targets/qwen3-8b"]
    )
    """Targets whose shapes the heads take (a directory with only a config.json is enough:
    weights are random)."""
    ttt_steps: list[int] = field(default_factory=lambda: [3, 7])
    """TTT settings, one row each."""
    lm_heads: list[Literal["frozen", "trained"]] = field(
        default_factory=lambda: ["frozen", "trained"]
    )
    """The draft lm_head frozen (the default of ``draftsmith train``) and/or trained."""
    row_tokens: int = 2048
    """Tokens per packed row (one row per step)."""
    draft_vocab_size: int = 32000
    """Draft vocabulary size (EAGLE-3's usual 32k)."""
    steps: int = 10
    """Timed optimizer steps per row, after one warm-up step."""
    profile_steps: int = 2
    """Steps per row run under torch.profiler after the timed ones (0 = no profile)."""
    attention: AttentionImpl = "auto"
    """draftsmith's TTT attention (as ``model.attention``)."""
    loss_chunk_size: int = 1024
    """Tokens per chunk of logits in draftsmith's loss."""
    speculators: bool = True
    """Also time speculators' EAGLE-3 model (frozen lm_head, its only mode) per shape and TTT."""
    speculators_compile: bool = False
    """Let speculators' torch.compile run (it failed under torch 2.11: eager by default)."""
    loader: bool = True
    """Also time the training loader in shard order (``bench-loader``)."""
    loader_target: str | None = None
    """The loader's target shape; null = the first of ``targets``."""
    loader_workers: list[int] = field(default_factory=lambda: [1, 4])
    """Loader worker counts, one pass each."""
    loader_tokens: int = 65536
    """Tokens the loader's synthetic dataset holds (bf16, 32 KiB each at the 8B shape)."""
    loader_sample_tokens: int = 1024
    """Mean sample length of that dataset (at most 2/3 of ``row_tokens``)."""
    loader_cache: Literal["cold", "warm"] = "cold"
    """Page cache before each loader pass: cold (shards evicted) or warm."""
    work_dir: str = "outputs/bench-gpu-work"
    """Where the loader's shards are written (and removed); not the output folder."""
    peak_tflops: float | None = None
    """The GPU's bf16 dense peak in TFLOP/s; null = from ``flops.GPU_BF16_PEAK_TFLOPS`` by the
    device's name (no MFU where neither gives one, as on CPU)."""
    output: str | None = None
    """Folder for bench-gpu.json and bench-gpu.md; null = $OUT when set, else
    outputs/bench-gpu."""
    overwrite: bool = False
    """Write into ``output`` even if it holds files bench-gpu did not write."""


def check_config(cfg: BenchGpuConfig) -> None:
    if cfg.steps < 1 or cfg.row_tokens < 2 or cfg.profile_steps < 0:
        raise ConfigError(
            f"steps={cfg.steps}, row_tokens={cfg.row_tokens}, profile_steps="
            f"{cfg.profile_steps}: give steps >= 1, row_tokens >= 2, profile_steps >= 0"
        )
    if not cfg.targets or not cfg.ttt_steps or min(cfg.ttt_steps) < 1 or not cfg.lm_heads:
        raise ConfigError(
            f"targets={cfg.targets}, ttt_steps={cfg.ttt_steps}, lm_heads={cfg.lm_heads}: "
            "each needs at least one entry (TTT >= 1)"
        )
    if cfg.loader and (not cfg.loader_workers or min(cfg.loader_workers) < 0):
        raise ConfigError(f"loader_workers: {cfg.loader_workers}; give counts >= 0, e.g. [1, 4]")


def output_dir(cfg: BenchGpuConfig) -> Path:
    return Path(cfg.output or os.environ.get("OUT") or "outputs/bench-gpu")


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def measure(bench: Prepared, flops: StepFlops, cfg: BenchGpuConfig, peak: float | None) -> dict:
    """Time, then profile, ``bench``'s step; the figures of one row."""
    start_gib = torch.cuda.memory_allocated() / 2**30 if bench.device == "cuda" else None
    seconds = time_steps(bench, cfg.steps)
    tokens_per_s = cfg.row_tokens * cfg.steps / seconds
    row = {
        "status": "ok",
        "tokens_per_s": tokens_per_s,
        "seconds_per_step": seconds / cfg.steps,
        "trainable_params": flops.trainable_params,
        "flops_per_token_6nt": flops.model,
        "flops_per_token_hw": flops.hardware,
        **flops.mfu(tokens_per_s, peak),
    }
    if bench.device == "cuda":
        row["allocated_at_start_gib"] = start_gib
        row["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    else:  # the process's peak so far: no per-row figure on CPU
        row["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    if cfg.profile_steps:
        row["profile"] = profile_steps(bench.step, cfg.profile_steps, bench.device)
    return row


def trainable(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters() if p.requires_grad)


def draftsmith_row(cfg: BenchGpuConfig, target: str, ttt: int, lm_head: str, peak) -> dict:
    bcfg = BenchTrainConfig(
        model=target, ttt_steps=ttt, row_tokens=cfg.row_tokens,
        draft_vocab_size=cfg.draft_vocab_size, train_lm_head=lm_head == "trained",
        random_weights=True, steps=cfg.steps, loss_chunk_size=cfg.loss_chunk_size,
        attention=cfg.attention,
    )  # fmt: skip
    bench = prepare(bcfg)
    lm = bench.head.logits_weight.numel()
    frozen = 0 if lm_head == "trained" else lm
    flops = StepFlops(trainable(bench.head), frozen, cfg.draft_vocab_size * bench.hidden_size, ttt)
    return measure(bench, flops, cfg, peak)


def speculators_row(cfg: BenchGpuConfig, target: str, ttt: int, peak) -> dict:
    bench = bench_speculators.prepare(
        target, ttt, cfg.row_tokens, cfg.draft_vocab_size, compile=cfg.speculators_compile
    )
    model = bench.head
    lm, teacher = model.lm_head.weight, model.verifier_lm_head.weight
    frozen = 0 if lm.requires_grad else lm.numel()
    flops = StepFlops(trainable(model), frozen, teacher.numel(), ttt)
    row = measure(bench, flops, cfg, peak)
    row["speculators_version"] = bench_speculators.version()
    row["compiled"] = cfg.speculators_compile
    return row


def guarded(run: Callable[[], dict], label: str) -> dict:
    """``run()``, or a row recording why it failed; memory is freed either way."""
    print(f"bench-gpu: {label} ...", flush=True)
    try:
        row = run()
    except Exception as error:  # one row's failure (OOM, compile) must not end the run
        traceback.print_exc()
        row = {"status": f"failed: {type(error).__name__}: {str(error).splitlines()[0][:300]}"}
    free_memory()
    print(f"bench-gpu: {label}: {row.get('status')} {row.get('tokens_per_s', '')}", flush=True)
    return row


def speculators_missing() -> str | None:
    """Why speculators' rows cannot run here, or None when it imports."""
    if bench_speculators.version() is None:
        return "speculators is not installed (make device-wheels carries it to the device)"
    try:
        import speculators.models.eagle3  # noqa: F401
    except Exception as error:  # a missing dependency of it, say
        return f"speculators does not import: {type(error).__name__}: {error}"
    return None


def loader_rows(cfg: BenchGpuConfig) -> dict:
    """bench-loader's passes in shard order at the loader target's shape."""
    from draftsmith.train.bench_loader import BenchLoaderConfig
    from draftsmith.train.bench_loader import run as run_loader

    lcfg = BenchLoaderConfig(
        model=cfg.loader_target or cfg.targets[0], tokens=cfg.loader_tokens,
        sample_tokens=cfg.loader_sample_tokens, row_tokens=cfg.row_tokens,
        storage_dtypes=["bfloat16"], caches=[cfg.loader_cache], workers=cfg.loader_workers,
        order="shards", work_dir=cfg.work_dir, output=None,
    )  # fmt: skip
    return {"status": "ok", **run_loader(lcfg)}


def run(cfg: BenchGpuConfig, save: Callable[[dict], None] | None = None) -> dict:
    """Every row of ``cfg``; ``save(result)`` after each (a run cut short keeps its rows)."""
    check_config(cfg)
    cuda = torch.cuda.is_available()
    device_name = torch.cuda.get_device_name() if cuda else "cpu"
    peak = peak_tflops(device_name, cfg.peak_tflops)
    rows: list[dict] = []
    result = {
        "command": "bench-gpu",
        "config": to_dict(cfg),
        "device": device_name,
        "torch": torch.__version__,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "commit": commit(),
        "peak_tflops": peak,
        "peak_source": "--peak_tflops" if cfg.peak_tflops is not None else "flops.py table",
        "rows": rows,
    }

    def add(key: dict, row: dict) -> None:
        rows.append({**key, **row})
        if save:
            save(result)

    for target in cfg.targets:
        for ttt in cfg.ttt_steps:
            for lm_head in cfg.lm_heads:
                key = {"trainer": "draftsmith", "target": target, "ttt": ttt, "lm_head": lm_head}
                label = f"draftsmith {Path(target).name} TTT {ttt} {lm_head}"
                add(key, guarded(partial(draftsmith_row, cfg, target, ttt, lm_head, peak), label))
    if cfg.speculators:
        missing = speculators_missing()
        for target in cfg.targets:
            for ttt in cfg.ttt_steps:
                key = {"trainer": "speculators", "target": target, "ttt": ttt, "lm_head": "frozen"}
                label = f"speculators {Path(target).name} TTT {ttt}"
                run_row = partial(speculators_row, cfg, target, ttt, peak)
                add(key, {"status": f"skipped: {missing}"} if missing else guarded(run_row, label))
    if cfg.loader:
        loader = guarded(lambda: loader_rows(cfg), "loader, shard order")
        shape = cfg.loader_target or cfg.targets[0]
        fed = [r for r in rows if r["trainer"] == "draftsmith" and r["lm_head"] == "frozen"
               and r["target"] == shape and r["status"] == "ok"]  # fmt: skip
        base = min(fed, key=lambda r: r["ttt"], default=None)  # TTT 3: the fastest to feed
        loader["gpu_ttt"] = base["ttt"] if base else None
        loader["gpu_tokens_per_s"] = base["tokens_per_s"] if base else None
        for p in loader.get("passes", []):
            p["x_gpu"] = p["tokens_per_s"] / base["tokens_per_s"] if base else None
        result["loader"] = loader
        if save:
            save(result)
    return result


def commit() -> str | None:
    """$DRAFTSMITH_COMMIT, else the checked-out commit where git and the repository are at
    hand (the device machine gets the tree without its history)."""
    import subprocess

    if os.environ.get("DRAFTSMITH_COMMIT"):
        return os.environ["DRAFTSMITH_COMMIT"]

    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=10, check=True)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def main(args: list[str] | None = None) -> int:
    def go() -> int:
        cfg = parse_config(BenchGpuConfig, args, prog="draftsmith bench-gpu")
        check_config(cfg)
        out = output_dir(cfg)
        check_output(out, "output", OWN, overwrite=cfg.overwrite)
        out.mkdir(parents=True, exist_ok=True)

        def save(result: dict) -> None:
            write_json_atomic(out / "bench-gpu.json", result)
            (out / "bench-gpu.md").write_text(markdown(result))

        table = markdown(run(cfg, save))
        print(table, flush=True)
        print(f"figures: {out / 'bench-gpu.json'}, {out / 'bench-gpu.md'}")
        return 0

    return exit_code("draftsmith bench-gpu", go)


if __name__ == "__main__":
    sys.exit(main())
