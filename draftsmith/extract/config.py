"""Options of the extract stage (each field's docstring is its ``--help`` text)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass
class EngineOptions:
    """vLLM engine options passed through to ``vllm.LLM``."""

    tensor_parallel_size: int = 1
    """GPUs one engine spreads the target over (vLLM tensor parallelism)."""
    gpu_memory_utilization: float | None = None
    """Fraction of device memory vLLM may take; null picks 0.3 on CPU, 0.9 on GPU."""
    max_model_len: int | None = None
    """Longest sequence the engine accepts; null uses `max_length` + 1."""
    enforce_eager: bool | None = None
    """Disable CUDA graphs / compilation; null means eager on CPU, graphs on GPU."""
    max_num_seqs: int | None = None
    """Most requests scheduled in one step; null keeps vLLM's default."""
    max_num_batched_tokens: int | None = None
    """Token budget of one engine step; null keeps vLLM's default."""
    model_dtype: str = "auto"
    """Dtype the target runs in: auto = float32 on CPU (bf16 is slow without AVX-512),
    bfloat16 on GPU."""
    cpu_reserved_cores: int | None = 0
    """CPU build: cores vLLM keeps free of compute threads (``VLLM_CPU_NUM_OF_RESERVED_CPU``).
    vLLM's own default reserves one, which leaves a 2-core machine one compute core; 0
    measured 1.63x the batch-64 and 1.37x the single-stream tokens/s here. null = vLLM's."""
    cpu_preload_iomp: bool = True
    """CPU build: put the venv's ``libiomp5.so`` in ``LD_PRELOAD`` of vLLM's processes, as
    vLLM advises (measured: single-stream 28.0 against 24.0 tok/s without it)."""
    extra: dict = field(default_factory=dict)
    """Any other `vllm.LLM` keyword arguments, passed as they are."""


@dataclass
class ExtractConfig:
    """Capture a target's hidden states with vLLM into a sharded safetensors dataset."""

    model: str = "smollm2-135m"
    """Target: a Hugging Face model directory, a hub id, or an embedded name (smollm2-135m)."""
    data: list[str] = field(default_factory=lambda: ["self:64"])
    """Sources, in order: JSON/JSONL files (ShareGPT or OpenAI shape), `hf:<id or dir>[@split]`,
    `mt_bench`, `humaneval`, or `self:N` (N prompts the target writes itself)."""
    output: str = "outputs/extract"
    """Dataset directory; re-running the same command resumes it."""
    layer_ids: list[int] | None = None
    """Layers to capture in vLLM's meaning (k = residual stream after k decoder layers, 0 =
    embeddings, N = last layer before the final norm); null = [2, N//2, N-3, N]."""
    regenerate: bool = False
    """Replace assistant turns with the target's own replies, written in the capturing pass."""
    temperature: float = 0.0
    """Sampling temperature of regenerated replies (0 = greedy)."""
    max_new_tokens: int = 512
    """Longest regenerated reply, in tokens."""
    max_length: int = 2048
    """Longest stored sequence, in tokens."""
    overlong: Literal["truncate", "skip"] = "truncate"
    """What to do with a conversation over `max_length`: cut it, or skip it (counted)."""
    bad_rows: Literal["error", "skip"] = "error"
    """A malformed input row stops the run with a one-line error, or is skipped and counted."""
    limit: int | None = None
    """Use at most this many conversations (after skips)."""
    dtype: Literal["bfloat16", "float16", "float32", "fp8_e4m3"] = "bfloat16"
    """Storage dtype of hidden states; fp8_e4m3 (per-token scales) halves the disk of bf16."""
    samples_per_shard: int = 256
    """Samples per shard file (one engine call each); lower it for large targets."""
    workers: int = 1
    """Data-parallel extraction: total number of worker processes writing this dataset."""
    worker: int = 0
    """Index of this worker in [0, workers); it writes shards k with k % workers == worker."""
    seed: int = 0
    """Seed for self-written prompts and sampled regeneration."""
    verify: int = 0
    """After extraction, recompute this many samples with transformers and fail above tolerance."""
    verify_tolerance: float | None = None
    """Largest allowed error relative to each layer's max |value|; null picks one per dtype."""
    staging_dir: str | None = None
    """Scratch directory for the connector's per-request files; null = /dev/shm when present."""
    engine: EngineOptions = field(default_factory=EngineOptions)
    """vLLM engine options."""
