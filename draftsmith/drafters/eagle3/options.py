"""EAGLE-3's ``model.*`` options (P-EAGLE is EAGLE-3 with ``parallel_drafting``)."""

from __future__ import annotations

from dataclasses import dataclass

from draftsmith.drafters.protocol.options import (
    BlockOptions,
    TTTOptions,
    WindowOptions,
    exclusive,
)


@dataclass
class Eagle3Options(TTTOptions, BlockOptions, WindowOptions):
    """Fused low/mid/high target states, a reduced draft vocabulary."""

    draft_vocab_size: int | None = None
    """EAGLE-3 draft vocabulary: the most frequent loss-masked tokens of the dataset (EOS
    always kept). Default: the full vocabulary up to 32k ids, else 32k."""
    train_lm_head: bool = True
    """EAGLE-3: train the draft lm_head (it starts from the target's rows)."""
    norm_before_fc: bool = exclusive(False)
    """EAGLE-3: one RMSNorm over the fused tapped states before ``fc`` (vLLM's
    ``norm_before_fc``, weight ``input_norm.weight``)."""
    fc_norm: bool = exclusive(False)
    """EAGLE-3: one RMSNorm per tapped state before ``fc`` (vLLM's ``fc_norm``, weights
    ``fc_norm.{i}.weight``); after ``norm_before_fc`` when both are on."""
    norm_output: bool = exclusive(False)
    """EAGLE-3.1 (speculators' default, with the two norms above): each draft step feeds the
    next its final-normed state instead of the pre-norm sum (vLLM's ``norm_output``). Off:
    3.0 measured level or ahead at the demo's budget (2026-11-26, SmolLM2, 727 steps,
    tokens/step at best k=4: MT-Bench 1.332 vs 3.1's 1.336, HumanEval 1.328 vs 1.294;
    ``make study-eagle31``)."""
    init_from: str | None = exclusive(None)
    """A published EAGLE-3 head to fine-tune, in any layout ``draftsmith convert`` reads
    (SafeAILab EAGLE, speculators, ModelOpt, SGLang / SpecForge, ours). It is checked against
    the target and the dataset's taps; its layers, draft vocabulary and norms are kept (an
    option set to something else is refused). Null: start from random weights."""
    parallel_drafting: bool = exclusive(False)
    """EAGLE-3: train a P-EAGLE head that drafts all ``ttt_steps`` tokens in one pass (vLLM's
    ``parallel_drafting``; ``eagle3/parallel.py``), with ``num_anchors`` mask blocks per row and
    the mask token chosen as for DFlash (``mask_token_id``)."""
