"""vLLM engine options and start-up, shared by every stage that runs the target.

Importing vLLM is slow and spawns workers; keep calls that build engines under
``if __name__ == "__main__":`` in scripts (vLLM starts its workers with spawn).

Inside ``shared_engines()``, an engine started through ``pooled`` stays up for the next
run that asks for the same key (the pipeline extracts its validation set and its data
with one engine: one start, about a minute for SmolLM2 on two cores, instead of two).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator, MutableMapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from draftsmith.core.console import say
from draftsmith.core.cores import avoid_busy_cores


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
    cpu_avoid_busy_cores: bool = True
    """CPU build: before an engine starts, leave out cores another process keeps busy
    (draftsmith/core/cores.py: one busy core of two made vLLM 5.2x slower when it kept both)."""
    extra: dict = field(default_factory=dict)
    """Any other `vllm.LLM` keyword arguments, passed as they are."""


def check_engine_options(options: EngineOptions) -> None:
    """Refuse engine options vLLM would refuse, before it starts (its own validation error
    comes after the engine's start, as a traceback)."""
    from draftsmith.core.errors import ConfigError

    lows = {"tensor_parallel_size": 1, "max_model_len": 2, "max_num_seqs": 1,
            "max_num_batched_tokens": 1, "cpu_reserved_cores": 0}  # fmt: skip
    for name, low in lows.items():
        value = getattr(options, name)
        if value is not None and (isinstance(value, bool) or value < low):
            raise ConfigError(f"engine.{name}: {value} is out of range; give a number >= {low}")
    share = options.gpu_memory_utilization
    if share is not None and not 0.0 < share <= 1.0:
        raise ConfigError(
            f"engine.gpu_memory_utilization: {share} is a share of memory; give a number in "
            "(0, 1], e.g. 0.9"
        )


def check_temperature(option: str, value: float) -> float:
    """A sampling temperature: finite and >= 0 (0 is greedy)."""
    from draftsmith.core.errors import ConfigError

    if isinstance(value, bool) or not isinstance(value, int | float) or not 0.0 <= value < 1e4:
        raise ConfigError(
            f"{option}: {value} is not a temperature; give a number >= 0 (0 = greedy)"
        )
    return float(value)


def on_cpu() -> bool:
    """True when vLLM runs on the CPU platform (the `vllm-cpu` build)."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def cpu_runtime_env(options: EngineOptions, env: MutableMapping[str, str] = os.environ) -> None:
    """Thread and OpenMP settings for vLLM's CPU build, written into ``env`` (the processes
    vLLM spawns inherit it). Values the user already set are kept."""
    if options.cpu_reserved_cores is not None:
        env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", str(options.cpu_reserved_cores))
    iomp = Path(sys.prefix, "lib", "libiomp5.so")
    preload = env.get("LD_PRELOAD", "")
    if options.cpu_preload_iomp and iomp.is_file() and "libiomp5" not in preload:
        env["LD_PRELOAD"] = f"{iomp}:{preload}" if preload else str(iomp)


# Text model types vLLM-CPU 0.32 runs in bfloat16 only, with prefix caching off: Qwen3-Next's
# gated-delta-net CPU kernel takes bf16 (and a linear-attention head dim of 128), and its
# speculative decoding (method mtp) breaks with prefix caching on (docs/mtp.md).
CPU_BF16_ONLY = ("qwen3_next",)


def cpu_family_defaults(model: str, options: EngineOptions) -> dict:
    """The dtype and prefix caching a family needs on vLLM-CPU (``CPU_BF16_ONLY``); a dtype
    it cannot run is refused in one line."""
    from draftsmith.core.errors import ConfigError
    from draftsmith.core.readers import read_json
    from draftsmith.core.targets import text_config

    config = Path(model, "config.json")
    if not config.is_file():
        return {}
    kind = text_config(read_json(config, "target config", "re-download the target")).get(
        "model_type"
    )
    if kind not in CPU_BF16_ONLY:
        return {}
    if options.model_dtype not in ("auto", "bfloat16"):
        raise ConfigError(
            f"engine.model_dtype: {options.model_dtype!r} for a {kind} target on vLLM-CPU, whose "
            "kernels for it run in bfloat16 only; set engine.model_dtype auto or bfloat16"
        )
    return dict(dtype="bfloat16", enable_prefix_caching=False)


def engine_kwargs(model: str, options: EngineOptions, max_len: int) -> dict:
    """`vllm.LLM` keyword arguments with the per-device defaults filled in (on the CPU
    build, also the environment of ``cpu_runtime_env`` and ``cpu_family_defaults``)."""
    cpu = on_cpu()
    if cpu:
        cpu_runtime_env(options)
        if options.cpu_avoid_busy_cores and (note := avoid_busy_cores()):
            say(f"engine: {note}")
    kwargs = dict(
        model=model,
        dtype=("float32" if cpu else "bfloat16")
        if options.model_dtype == "auto"
        else options.model_dtype,
        tensor_parallel_size=options.tensor_parallel_size,
        gpu_memory_utilization=options.gpu_memory_utilization or (0.3 if cpu else 0.9),
        max_model_len=options.max_model_len or max_len,
        enforce_eager=cpu if options.enforce_eager is None else options.enforce_eager,
        disable_log_stats=False,
    )
    if options.max_num_seqs is not None:
        kwargs["max_num_seqs"] = options.max_num_seqs
    if options.max_num_batched_tokens is not None:
        kwargs["max_num_batched_tokens"] = options.max_num_batched_tokens
    if cpu:
        kwargs.update(cpu_family_defaults(model, options))
    kwargs.update(options.extra)
    return kwargs


def plain_engine(model: str, options: EngineOptions, max_len: int):
    """A `vllm.LLM` without speculation or capture (the baseline a benchmark compares with)."""
    from vllm import LLM

    return LLM(**engine_kwargs(model, options, max_len))


def close_engine(llm) -> None:
    """Stop the engine's worker processes now rather than at garbage collection."""
    import gc

    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()
    del llm
    gc.collect()


_pool: dict[tuple, tuple[Any, Callable[[], None]]] | None = None  # key -> (engine, cleanup)


@contextlib.contextmanager
def shared_engines() -> Iterator[None]:
    """Engines started by ``pooled`` inside this context are reused, and closed at its end."""
    global _pool
    outer, _pool = _pool, {}
    try:
        yield
    finally:
        release_shared()
        _pool = outer


def pooled(key: tuple, start: Callable[[], Any], cleanup: Callable[[], None]) -> tuple[Any, bool]:
    """``(engine, shared)``: the pool's engine for ``key``, else ``start()``'s (kept in the
    pool, with ``cleanup`` to run after it closes, when inside ``shared_engines()``).
    A shared engine belongs to the pool: its user must not close it."""
    if _pool is not None and key in _pool:
        return _pool[key][0], True
    llm = start()
    if _pool is None:
        return llm, False
    _pool[key] = (llm, cleanup)
    return llm, True


def is_pooled(key: tuple) -> bool:
    return _pool is not None and key in _pool


def release_shared() -> None:
    """Close the pool's engines now (before starting another that would not fit beside them)."""
    for llm, cleanup in (_pool or {}).values():
        close_engine(llm)
        cleanup()
    if _pool is not None:
        _pool.clear()
