"""torch.compile of the TTT unroll (``model.compile``): when it runs, and the compiled unroll.

``on`` compiles ``ttt.ttt_unroll`` (every draft step's forward, and through AOTAutograd its
backward) wherever the states are; ``off`` runs it eagerly; ``auto`` compiles in a
single-process CUDA run where a measurement said compiling wins (``COMPILE_GAIN``, the nearest
measured ``ttt_steps``; a tie goes to the smaller), never on CPU (the eager path, unchanged)
and never under several processes (DDP, FSDP, DeepSpeed: not measured; ``on`` forces it).
``model.attention: auto`` is flex where the unroll is compiled on CUDA, the efficient SDPA
path on CUDA otherwise and blockwise on CPU (``ttt.resolve_attention``). ``python -m
draftsmith.bench.attention`` and ``make bench-gpu`` re-measure both on a GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
import torch.distributed as dist

from draftsmith.drafters.attention.ttt import ttt_unroll

CompileMode = Literal["auto", "on", "off"]

# Throughput of the training step with the TTT unroll compiled over the eager one, per
# ttt_steps: H200, the Llama-3.1-8B shape, rows of 2,048 tokens, bf16 autocast, frozen lm_head,
# torch loss, efficient attention; `make bench-gpu` on 2026-11-27, commit 8cc20c2 (its levers
# table: compile 44,477 vs old 30,132 tok/s at TTT 3, 21,776 vs 10,358 at TTT 7). The first
# measurement (H100, 2026-11-26, aee9164: -38% at 3, +13% at 7) compiled the whole step.
COMPILE_GAIN: dict[int, float] = {3: 0.48, 7: 1.10}

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
