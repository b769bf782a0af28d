"""DSpark's ``model.*`` options, with where each default comes from.

Sources checked (public text, read through the project's search tool):

- DeepSpec (DeepSeek's reference trainer), ``deepspec/modeling/dspark/loss.py``:
  ``loss = ce_alpha * CE + l1_alpha * L1 + confidence_alpha * BCE``; slot i weighs
  ``exp(-i / gamma)`` from i = 0; every term is a weighted mean over the valid slots
  (``eval_mask``, a contiguous prefix); the confidence target is ``1 - 0.5 * L1`` = 1 - TV,
  detached. Its "L1" term is ``sum |p_draft - p_target|`` = 2 TV.
- vllm-project/speculators PR #677 (``scripts/train.py``): ``--l1-loss-alpha`` 0.9 ("weight of
  the total-variation loss term"), ``--confidence-head-alpha`` 1.0; NVIDIA Model-Optimizer's
  DSpark reference (PR #2201) lists ce 0.1 / l1 (TVD) 0.9 / confidence 1.0 as DeepSpec's
  defaults. SpecForge PR #613: CE on the Markov-biased logits, confidence target ``1 - 0.5 L1``.
- speculators issue #757 (a DSpark ablation on Qwen3-8B): ``--markov-rank 256
  --markov-head-type vanilla --enable-confidence-head --confidence-head-with-markov
  --block-size 8``.

Not verified: DeepSpec's own ``loss_decay_gamma`` default; 4 is the brief's choice (the DFlash
paper pairs 4 with block size 8).
"""

from __future__ import annotations

from dataclasses import dataclass

from draftsmith.drafters.protocol.options import BlockOptions, HeadOptions, exclusive


@dataclass
class DSparkOptions(HeadOptions, BlockOptions):
    """A DFlash-style block drafted in one pass, then a Markov bias sampled left to right."""

    block_size: int = 8
    """DSpark: slots per block = drafts per block (the anchor slot predicts the first draft;
    serve with ``num_speculative_tokens`` = block_size)."""
    markov_rank: int = exclusive(256)
    """DSpark: rank r of the Markov head (``markov_w1`` V x r, ``markov_w2`` r -> V); 256 as in
    speculators' Qwen3-8B DSpark runs (issue #757)."""
    confidence_head: bool = True
    """DSpark: train the confidence head (vLLM's ``enable_confidence_head``, over
    ``[hidden ; markov_w1(previous token)]``)."""
    ce_loss_weight: float = 0.1
    """DSpark: weight of the cross-entropy on the true next token (DeepSpec / speculators #677:
    0.1)."""
    tv_loss_weight: float = 0.9
    """DSpark: weight of the total variation ``0.5 * sum |p_draft - p_target|`` against the
    target's distribution (0.9: speculators #677's "total-variation" weight; DeepSpec applies
    0.9 to the L1 distance, which is 2 TV: set 1.8 to match DeepSpec exactly)."""
    confidence_loss_weight: float = 1.0
    """DSpark: weight of the BCE of the confidence head against ``1 - TV`` (speculators #677 /
    DeepSpec: 1.0)."""
    position_decay_gamma: float = 4.0
    """DSpark: slot i (0 = the first draft) weighs ``exp(-i / gamma)`` in every term."""
    simulate_only: bool = exclusive(False)
    """DSpark: train for a target vLLM has no DSpark drafter for (a Llama, say), to compare
    simulated acceptance with other kinds on the same data; export and eval refuse the head.
    DFlash2: the same for a target vLLM cannot tap (from a given dataset)."""
