"""torch.compile of the TTT unroll (``model.compile``), chosen per TTT setting.

``on`` compiles ``ttt.ttt_unroll`` (every draft step's forward, and through AOTAutograd its
backward) wherever the states are; ``off`` runs it eagerly; ``auto`` compiles in a
single-process CUDA run where a measurement said compiling wins (``COMPILE_GAIN``, the nearest
measured ``ttt_steps``; a tie goes to the smaller), never on CPU (the eager path, unchanged)
and never under several processes (DDP, FSDP, DeepSpeed: not measured; ``on`` forces it).
``python -m draftsmith.train.bench_attention`` re-measures the table on a GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
import torch.distributed as dist

from draftsmith.drafters.ttt import ttt_unroll

CompileMode = Literal["auto", "on", "off"]

# Throughput of the compiled training step over the eager one, per ttt_steps: H100, the
# Llama-3.1-8B shape, rows of 2,048 tokens, bf16 autocast, frozen lm_head; measured
# 2026-11-26 on main aee9164 (whole step compiled; ../shared/notes/gpu.md, issue 43).
COMPILE_GAIN: dict[int, float] = {3: -0.38, 7: 0.13}

_compiled: dict[str, Callable] = {}


def compile_wins(ttt_steps: int, gains: dict[int, float] = COMPILE_GAIN) -> bool:
    """Whether compiling won at the measured ``ttt_steps`` nearest this one."""
    nearest = min(gains, key=lambda k: (abs(k - ttt_steps), k))
    return gains[nearest] > 0


def use_compile(
    mode: CompileMode, ttt_steps: int, device: torch.device | str, world_size: int | None = None
) -> bool:
    """``model.compile`` resolved for a run of ``ttt_steps`` on ``device`` with ``world_size``
    processes (None: torch.distributed's, 1 when it is not initialised)."""
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"compile must be 'auto', 'on' or 'off', got {mode!r}")
    if mode == "auto":
        if world_size is None:
            world_size = (
                dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
            )
        return torch.device(device).type == "cuda" and world_size == 1 and compile_wins(ttt_steps)
    return mode == "on"


def compiled_unroll(backend: str = "inductor") -> Callable[..., list[torch.Tensor]]:
    """``ttt_unroll`` under ``torch.compile`` (one per backend and process)."""
    if backend not in _compiled:
        _compiled[backend] = torch.compile(ttt_unroll, backend=backend)
    return _compiled[backend]


def unroll_for(mode: CompileMode, ttt_steps: int, device: torch.device | str) -> Callable:
    """The unroll a run uses: ``ttt_unroll``, compiled or not (``use_compile``)."""
    return compiled_unroll() if use_compile(mode, ttt_steps, device) else ttt_unroll
