"""EAGLE-1 (``model.kind: eagle``): the target's final state and the next token's embedding,
fused by ``fc``, then Llama layers; logits from the target's own lm_head.

- ``head.py``: the head, weight for weight vLLM's ``EagleLlamaForCausalLM``.
- ``export.py``: the directory vLLM serves (``vllm serve DIR``).
- ``replica.py``: an exported head drafting as vLLM serves it (eval's expected acceptance).
- ``layouts.py`` / ``layouts_write.py``: published EAGLE-1 heads read and written for each
  consumer (``draftsmith convert``).

The objective is training-time test (``ttt_objective.py``) as in EAGLE-3, plus the EAGLE
paper's smooth-L1 regression of each step's output on the target's next (final-normed) state.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from draftsmith.core.errors import DatasetError
from draftsmith.core.targets import TargetInfo
from draftsmith.drafters.eagle1.export import (
    check_eagle1_head,
    eagle1_config,
    eagle1_tensors,
    export_eagle1,
)
from draftsmith.drafters.eagle1.head import Eagle1Head, eagle1_from_target
from draftsmith.drafters.losses.acceptance import step_validity
from draftsmith.drafters.losses.loss import TTTLoss
from draftsmith.drafters.losses.ttt_objective import unrolled_loss
from draftsmith.drafters.protocol import Built, Drafter, Trainee, TrainingData
from draftsmith.drafters.protocol.batch import Batch
from draftsmith.drafters.protocol.options import TTTOptions
from draftsmith.drafters.target.init_layers import init_from_target
from draftsmith.drafters.target.weights import TargetWeights


@dataclass
class Eagle1Options(TTTOptions):
    """The target's final state in, the target's lm_head out."""

    regression_weight: float = 1.0
    """EAGLE-1: weight of the smooth-L1 feature loss."""
    ce_weight: float = 0.1
    """EAGLE-1: weight of the cross-entropy (the EAGLE paper uses 0.1)."""


class Eagle1(Drafter):
    """EAGLE-1 (the EAGLE paper; vLLM's ``method: eagle``)."""

    name = "eagle"
    title = "EAGLE-1"
    Options = Eagle1Options
    # LlamaForCausalLM: SafeAILab's layout, served with an explicit --method eagle only (a
    # whole Llama model reads the same); method_of never guesses it.
    methods = {"eagle": ("EagleLlamaForCausalLM", "LlamaForCausalLMEagle", "LlamaForCausalLM")}
    head_class = Eagle1Head
    options: Eagle1Options

    def build(self, target: TargetInfo, data: TrainingData, weights: TargetWeights) -> Built:
        n = target.num_hidden_layers
        if data.aux_layer_ids != [n]:
            raise DatasetError(
                f"data.aux_layers: EAGLE-1 reads the target's last layer only; set "
                f"data.aux_layers [{n}] (got {data.aux_layer_ids})"
            )
        head = eagle1_from_target(target.config, num_layers=self.options.num_layers)
        head.set_embeddings(weights.embed)
        head.set_lm_head(weights.lm_head)
        info: dict[str, Any] = {"head_kwargs": head.init_kwargs, "layer_ids": None}
        if self.options.init_from_target:
            info["init_from_target_layers"] = init_from_target(head, target, weights.norm)
        return Built(head, {}, info)

    def loss(self, trainee: Trainee, batch: Batch) -> tuple[Tensor, TTTLoss]:
        opt = self.options
        teacher = trainee.teacher(batch)  # EAGLE-1 reads the target's final-normed state
        out, steps = unrolled_loss(
            trainee, opt, batch, teacher, teacher, trainee.target_lm_head, None
        )
        regression = self.regression(steps, teacher, batch)
        return opt.ce_weight * out.loss + opt.regression_weight * regression, out

    def regression(self, steps: list[Tensor], teacher: Tensor, batch: Batch) -> Tensor:
        """Smooth-L1 of step k's output at t on the target state at t+k+1."""
        total = teacher.new_zeros((), dtype=torch.float32)
        for k, out in enumerate(steps):
            valid = step_validity(batch["loss_mask"], batch["doc_ids"], k)  # [B, T]
            b, t = valid.nonzero(as_tuple=True)
            if b.numel():
                err = F.smooth_l1_loss(out[b, t].float(), teacher[b, t + k + 1].float())
                total = total + self.options.loss_decay**k * err
        return total

    def walk_length(self) -> int:
        return self.options.ttt_steps

    @classmethod
    def method_of(cls, config: dict[str, Any]) -> str | None:
        arch = (config.get("architectures") or ["?"])[0]
        return None if arch == "LlamaForCausalLM" else super().method_of(config)

    @classmethod
    def check_head(cls, head, method, config, shapes, target) -> None:
        check_eagle1_head(head, config, shapes)

    @classmethod
    def head_from_target(cls, target_config: dict[str, Any], **head_options: Any):
        return eagle1_from_target(target_config, **head_options)

    @classmethod
    def head_config(cls, head, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return eagle1_config(head, *args, **kwargs)

    @classmethod
    def head_tensors(cls, head, dtype: torch.dtype) -> dict[str, Tensor]:
        return eagle1_tensors(head, dtype)

    @classmethod
    def export(cls, head, target, out_dir, **kwargs: Any) -> Path:
        return export_eagle1(head, target, out_dir, **kwargs)

    @classmethod
    def replica(cls, head_dir: str, method: str, target: TargetInfo):
        from draftsmith.drafters.eagle1.replica import Eagle1Replica

        return Eagle1Replica(head_dir, target)
