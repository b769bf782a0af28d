"""Where a training step's time goes: a torch.profiler summary for ``bench-gpu``.

On CUDA the time is the GPU's (kernel durations): the share in matmul (GEMM) kernels,
in attention kernels and in the rest, how busy the GPU was over the profiled steps, and the
ten aten ops whose own kernels took longest. On CPU the same summary is made of the CPU
ops' self times (matmul = aten::mm and its kin), so the command can be checked without a GPU.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile

# Kernel names: cuBLAS/cuBLASLt (nvjet, sm90_xmma_gemm, ampere_*gemm), CUTLASS, Triton
# matmul templates (triton_tem_fused_mm / _addmm / _bmm).
MATMUL_KERNEL = re.compile(r"gemm|xmma|nvjet|cutlass|cublas|wgmma|s16816|triton_tem_fused_.*mm")
ATTENTION_KERNEL = re.compile(r"flash|fmha|attention|flex", re.IGNORECASE)
MATMUL_OP = re.compile(r"^aten::(mm|addmm|bmm|baddbmm|addbmm|_scaled_mm|mkldnn_\w*mm\w*)$")
ATTENTION_OP = re.compile(r"attention|flash|flex", re.IGNORECASE)
TOP = 10


def profile_steps(step: Callable[[], None], steps: int, device: str) -> dict:
    """Run ``step`` ``steps`` times under torch.profiler and summarise (see the module doc)."""
    activities = [ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(ProfilerActivity.CUDA)
        torch.cuda.synchronize()
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            step()
        if device == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
    return summarize(prof.key_averages(), steps, wall, device)


def summarize(events, steps: int, wall_s: float, device: str) -> dict:
    """The summary of ``events`` (``prof.key_averages()``) over ``steps`` steps of ``wall_s``."""
    cuda = device == "cuda"
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    if cuda:
        ops = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
        if kernels:
            own = {e.key: e.self_device_time_total for e in kernels}
            matmul, attention = MATMUL_KERNEL, ATTENTION_KERNEL
        else:  # no kernel records (CUPTI missing): the ops' own GPU time, by op name
            own = {e.key: e.self_device_time_total for e in ops}
            matmul, attention = MATMUL_OP, ATTENTION_OP
    else:
        ops = list(events)
        own = {e.key: e.self_cpu_time_total for e in ops}
        matmul, attention = MATMUL_OP, ATTENTION_OP
    total_us = sum(own.values()) or 1e-9
    mm = sum(t for k, t in own.items() if matmul.search(k))
    att = sum(t for k, t in own.items() if not matmul.search(k) and attention.search(k))
    op_time = {e.key: e.self_device_time_total if cuda else e.self_cpu_time_total for e in ops}
    op_total = sum(op_time.values()) or 1e-9
    top = sorted(op_time.items(), key=lambda kv: -kv[1])[:TOP]
    clock = "gpu kernels" if kernels else "gpu time of ops"
    return {
        "clock": clock if cuda else "cpu ops (self time)",
        "steps": steps,
        "wall_s": wall_s,
        "busy_s": total_us / 1e6,
        "busy": total_us / 1e6 / wall_s if wall_s else None,
        "matmul_share": mm / total_us,
        "attention_share": att / total_us,
        "other_share": 1 - (mm + att) / total_us,
        "top_ops": [
            {"op": k, "share": t / op_total, "ms_per_step": t / 1e3 / steps} for k, t in top
        ],
    }
