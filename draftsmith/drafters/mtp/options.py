"""The MTP kind's ``model.*`` options."""

from __future__ import annotations

from dataclasses import dataclass

from draftsmith.drafters.protocol.options import HeadOptions


@dataclass
class MTPOptions(HeadOptions):
    """Fine-tune the target's own first MTP layer, unrolled recursively over ``mtp_steps``."""

    mtp_steps: int = 3
    """MTP: recursive draft steps per training position, each reading the layer's previous
    output as vLLM does (serve with ``num_speculative_tokens`` = mtp_steps)."""
    mtp_step_decay: float | None = 0.6
    """MTP: FastMTP-style position weights, step k (0-based) weighing ``decay ** k``,
    normalised to sum 1 (FastMTP, Cai et al. 2025, arXiv:2509.18362); null: equal weights."""
