"""``draftsmith bench-gpu``'s options and the speed levers' table of configurations
(``bench_gpu.py`` runs them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from draftsmith.core.errors import ConfigError
from draftsmith.drafters.attention.ttt import AttentionImpl
from draftsmith.drafters.attention.ttt_compile import CompileMode
from draftsmith.drafters.losses.fused_loss import FusedMode

OWN = ("bench-gpu.json", "bench-gpu.md", "bench-gpu.log")

LeverConfig = Literal["old", "fused", "flex", "compile", "all", "auto"]
Options = tuple[FusedMode, AttentionImpl, CompileMode]
"""A row's (``fused_loss``, ``attention``, ``compile``), as the head's training options."""
LEVERS: dict[str, Options] = {
    "old": ("off", "efficient", "off"),  # the GPU path before the levers (gpu.md, 2026-11-26)
    "fused": ("on", "efficient", "off"),
    "flex": ("off", "flex", "off"),
    "compile": ("off", "efficient", "on"),
    "all": ("on", "flex", "on"),
    "auto": ("auto", "auto", "auto"),
}
"""The levers table's configurations: (``fused_loss``, ``attention``, ``compile``)."""
LEVER_OPTIONS = ("fused_loss", "attention", "compile")
COMPILE_ON_CPU = (
    "skipped: compile on is timed on CUDA only (on CPU torch.compile builds C++ kernels "
    "for minutes, and auto never compiles there)"
)


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
    steps: int = 5
    """Timed optimizer steps per row, after the warm-up steps."""
    warmup_steps: int = 2
    """Untimed steps per row first (a compiled unroll and flex attention are built there)."""
    profile_steps: int = 1
    """Steps per row run under torch.profiler after the timed ones (0 = no profile)."""
    attention: AttentionImpl = "auto"
    """The main rows' TTT attention (as ``model.attention``)."""
    fused_loss: FusedMode = "auto"
    """The main rows' fused Triton loss (as ``model.fused_loss``)."""
    compile: CompileMode = "auto"
    """The main rows' torch.compile of the TTT unroll (as ``model.compile``)."""
    levers: list[LeverConfig] = field(default_factory=list)
    """The levers table's configurations (``LEVERS``), frozen lm_head; [] (the default since
    2026-11-28, so that speculators' rows and the end-to-end rows fit one call) = no table;
    every one: ``[old, fused, flex, compile, all, auto]``."""
    levers_ttt_steps: list[int] = field(default_factory=lambda: [3, 7])
    """TTT settings of the levers table."""
    levers_target: str | None = None
    """The levers table's target shape; null = the first of ``targets``."""
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
    end_to_end: bool = True
    """With ``loader``: time the frozen head's smallest-TTT step again on the loader's batches
    (one row per ``loader_workers``), beside the step-only figure."""
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
    if cfg.steps < 1 or cfg.row_tokens < 2 or cfg.profile_steps < 0 or cfg.warmup_steps < 1:
        raise ConfigError(
            f"steps={cfg.steps}, row_tokens={cfg.row_tokens}, profile_steps="
            f"{cfg.profile_steps}, warmup_steps={cfg.warmup_steps}: give steps >= 1, "
            "row_tokens >= 2, profile_steps >= 0, warmup_steps >= 1"
        )
    unknown = [name for name in cfg.levers if name not in LEVERS]
    if unknown or (cfg.levers and min(cfg.levers_ttt_steps, default=0) < 1):
        raise ConfigError(
            f"levers={cfg.levers}, levers_ttt_steps={cfg.levers_ttt_steps}: give levers among "
            f"{list(LEVERS)} and at least one TTT setting >= 1 (or levers [] for no table)"
        )
    if not cfg.targets or not cfg.ttt_steps or min(cfg.ttt_steps) < 1 or not cfg.lm_heads:
        raise ConfigError(
            f"targets={cfg.targets}, ttt_steps={cfg.ttt_steps}, lm_heads={cfg.lm_heads}: "
            "each needs at least one entry (TTT >= 1)"
        )
    if cfg.loader and (not cfg.loader_workers or min(cfg.loader_workers) < 0):
        raise ConfigError(f"loader_workers: {cfg.loader_workers}; give counts >= 0, e.g. [1, 4]")
