"""DFlash2's ``model.*`` options: DFlash's, plus the convolution, the selector and its loss.

Where the defaults come from (public text, read through the project's search tool):

- vllm-project/speculators #1006 (``models/dflash2/config.py``, ``core.py``, ``metrics.py``):
  ``conv_kernel_size`` 2, ``conv_group_size`` 16, ``selector_rank`` 256, ``selector_top_k`` 16;
  ``loss = unary_loss + selector_loss_alpha * selector_loss`` with ``selector_loss_alpha`` 1.0,
  the selector loss a K-way cross-entropy over the unary top-K with the same per-slot decay
  as the DFlash loss, the gold token put in the weakest candidate's place when missing.
- SpecForge #772 (``training.dflash2_selector_loss_alpha``, the gold token inserted when it is
  missing from the top-K) and #793 (``training.dflash2_selector_stop_gradient``: the selector
  loss reaches the selector only).
- NVIDIA Model-Optimizer #2216: the convolution starts as the identity so that a DFlash
  checkpoint can warm-start a DFlash2 run.
- The published drafter (z-lab / Inco AI, ``z-lab/Qwen3.8-27B-DFlash2``): block 8, kernel 2,
  group 16, rank 256, top-16, 5 sliding-window layers (window 2048; not built here).
"""

from __future__ import annotations

from dataclasses import dataclass

from draftsmith.drafters.dflash.options import DFlashOptions
from draftsmith.drafters.protocol.options import exclusive


@dataclass
class DFlash2Options(DFlashOptions):
    """DFlash's block, its sublayers wrapped in a grouped dynamic convolution, and a
    candidate selector walked over each slot's top-K ids."""

    conv_kernel_size: int = exclusive(2)
    """DFlash2: taps of each grouped dynamic convolution (2: the slot and the one before it;
    taps never cross the block's start)."""
    conv_group_size: int = exclusive(16)
    """DFlash2: channels sharing one dynamic coefficient; must divide the hidden size."""
    selector_rank: int = exclusive(256)
    """DFlash2: rank r of the selector's predecessor / successor codebooks (V x r each)."""
    selector_top_k: int = exclusive(16)
    """DFlash2: K, the candidates per slot the selector chooses among (vLLM's q at T > 0 lives
    on them)."""
    selector_loss_weight: float = 1.0
    """DFlash2: weight of the selector's K-way cross-entropy beside the DFlash loss
    (speculators' ``selector_loss_alpha``, 1.0)."""
    selector_stop_gradient: bool = False
    """DFlash2: the selector's loss trains the selector only, not the drafter's states (SpecForge
    #793's ``dflash2_selector_stop_gradient``; off as there)."""
    init_from_dflash: str | None = exclusive(None)
    """DFlash2: an exported DFlash head directory (``draftsmith export`` of a ``model.kind
    dflash`` checkpoint trained on the same data.aux_layers) whose weights start this drafter;
    the convolutions start as the identity, so training starts from that DFlash drafter."""
    simulate_only: bool = exclusive(False)
    """DFlash2: train for a target vLLM cannot tap (from a given dataset), to compare simulated
    acceptance with other kinds on the same data; export refuses the head."""
