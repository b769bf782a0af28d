"""DSpark: a DFlash-style block drafted in one pass plus a low-rank Markov head sampled left to
right, and a confidence head (``model.kind: dspark``; vLLM's ``method: dspark``).

- ``model.py``: the drafter, op for op what vLLM 0.32 loads as ``Qwen3DSparkModel``.
- ``blocks.py``: training blocks in vLLM's anchor-as-first layout, the valid prefix.
- ``objective.py``: the CE + TV + confidence objective and the validation walk (T = 0, 1).
- ``export.py``: the directory vLLM loads (``to``: vLLM's layout, or speculators').
- ``speculators.py``: vllm-project/speculators' DSpark layout, written and read back.
- ``replica.py``: an exported drafter drafting as vLLM serves it (eval simulates with it).
- ``options.py``: the options and where their defaults come from.

Targets: vLLM 0.32 has a Qwen3-layer DSpark drafter (``Qwen3DSparkModel``), built here, and a
Gemma 4 one (``Gemma4DSparkModel``, Gemma 4 draft layers), not built here; any other target
is refused when the kind first sees it (``check_target``). vLLM serves DSpark only in its V2
GPU model runner, so a DSpark head cannot be served on the CPU build: eval simulates it there
(``cpu_serving``, ``replica``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import Tensor

from draftsmith.core.console import say
from draftsmith.core.errors import ConfigError
from draftsmith.core.targets import TargetInfo
from draftsmith.drafters.dspark.export import ARCHITECTURE, LAYOUTS, export_dspark
from draftsmith.drafters.dspark.model import DSparkDrafter, dspark_from_target
from draftsmith.drafters.dspark.objective import dspark_loss
from draftsmith.drafters.dspark.options import DSparkOptions
from draftsmith.drafters.dspark.speculators import ARCHITECTURE as SPECULATORS_ARCHITECTURE
from draftsmith.drafters.headfiles.directory import check_block_taps
from draftsmith.drafters.losses.loss import TTTLoss
from draftsmith.drafters.protocol import Built, Drafter, Trainee, TrainingData
from draftsmith.drafters.protocol.batch import Batch
from draftsmith.drafters.target.vocab import choose_mask_token
from draftsmith.drafters.target.weights import TargetWeights

# Target architectures -> the vLLM DSpark class this kind exports for them.
SUPPORTED = {"Qwen3ForCausalLM": ARCHITECTURE, "Qwen3MoeForCausalLM": ARCHITECTURE}
NOT_BUILT = {"Gemma4ForCausalLM", "Gemma4ForConditionalGeneration"}  # Gemma4DSparkModel


def check_target(target: TargetInfo) -> None:
    """Refuse, in one line, a target vLLM has no DSpark drafter of this kind's for."""
    if target.architecture in SUPPORTED:
        return
    why = (
        "vLLM's Gemma4DSparkModel has Gemma 4 draft layers, which this kind does not build"
        if target.architecture in NOT_BUILT
        else "vLLM 0.32 has no DSpark drafter for it"
    )
    raise ConfigError(
        f"model.kind dspark: the target's architecture {target.architecture} is not supported "
        f"({why}); supported: {', '.join(SUPPORTED)}; use model.kind dflash for this target "
        "(or model.simulate_only true to compare simulated acceptance without serving)"
    )


def target_layer_ids(aux_layer_ids: list[int], num_hidden_layers: int) -> list[int]:
    """Draftsmith layer ids (state after k layers) -> vLLM's 0-based ``target_layer_ids``."""
    bad = [k for k in aux_layer_ids if not 1 <= k <= num_hidden_layers]
    if bad:
        raise ConfigError(
            f"data.aux_layers: {aux_layer_ids} holds {bad}; DSpark taps decoder layer outputs, "
            f"ids 1..{num_hidden_layers} (id 0 is the embeddings): drop them from data.aux_layers"
        )
    return [k - 1 for k in aux_layer_ids]


class DSpark(Drafter):
    """DSpark semi-autoregressive block drafting (DeepSeek's DeepSpec; vLLM ``method: dspark``)."""

    name = "dspark"
    title = "DSpark"
    Options = DSparkOptions
    methods = {"dspark": (ARCHITECTURE, SPECULATORS_ARCHITECTURE)}
    layouts = LAYOUTS
    head_class = DSparkDrafter
    cpu_serving = False  # vLLM's V1 runner (the CPU build) refuses "dspark"
    options: DSparkOptions

    def check_options(self) -> None:
        opt = self.options
        if opt.block_size < 1 or opt.num_anchors < 1 or opt.markov_rank < 1:
            raise ConfigError(
                f"model.block_size {opt.block_size} / model.num_anchors {opt.num_anchors} / "
                f"model.markov_rank {opt.markov_rank}: each must be >= 1"
            )
        weights = (opt.ce_loss_weight, opt.tv_loss_weight, opt.confidence_loss_weight)
        if min(weights) < 0 or opt.position_decay_gamma <= 0:
            raise ConfigError(
                f"model.ce_loss_weight / tv_loss_weight / confidence_loss_weight {weights} and "
                f"model.position_decay_gamma {opt.position_decay_gamma}: give weights >= 0 and "
                "a positive gamma"
            )

    @classmethod
    def check_target(cls, target: TargetInfo, options: dict[str, Any]) -> None:
        if not options.get("simulate_only"):
            check_target(target)

    def build(self, target: TargetInfo, data: TrainingData, weights: TargetWeights) -> Built:
        opt = self.options
        if not opt.simulate_only:
            check_target(target)
        elif target.architecture not in SUPPORTED:
            say(f"train: dspark for {target.architecture}: simulated acceptance only (vLLM has "
                "no DSpark drafter for it; export will refuse the head)")  # fmt: skip
        ids = target_layer_ids(data.aux_layer_ids, target.num_hidden_layers)
        mask_id, spare = choose_mask_token(target, data, opt.mask_token_id)
        if not bool(weights.embed[mask_id].abs().sum() > 0):
            raise ConfigError(
                f"model.mask_token_id: the target's embedding row of mask token {mask_id} is "
                "zero, and vLLM's DSpark feeds that row to the mask slots; give an id whose "
                "row is not zero"
            )
        head = dspark_from_target(
            target.config, target_layer_ids=ids, mask_token_id=mask_id,
            num_layers=opt.num_layers, block_size=opt.block_size, markov_rank=opt.markov_rank,
            confidence_head=opt.confidence_head,
        )  # fmt: skip
        head.set_embeddings(weights.embed)
        info = {
            "head_kwargs": head.init_kwargs,
            "layer_ids": list(data.aux_layer_ids),
            "mask_token_id": mask_id,
            "mask_token_spare": spare,
        }
        return Built(head, {}, info)

    def loss(self, trainee: Trainee, batch: Batch) -> tuple[Tensor, TTTLoss]:
        return dspark_loss(trainee, self.options, batch)

    def walk_length(self) -> int:
        return self.options.block_size

    @classmethod
    def head_from_target(cls, target_config: dict[str, Any], **head_options: Any):
        return dspark_from_target(target_config, **head_options)

    @classmethod
    def export(cls, head, target, out_dir, **kwargs: Any) -> Path:
        check_target(target)
        return export_dspark(head, target, out_dir, **kwargs)

    @classmethod
    def check_head(
        cls, head: str, method: str, config: dict, shapes: dict[str, list[int]], target: TargetInfo
    ) -> None:
        check_target(target)
        if "aux_hidden_state_layer_ids" in config:  # the speculators layout: ids 1-based
            ids = [i - 1 for i in config["aux_hidden_state_layer_ids"]]
            check_block_taps(head, ids, "aux_hidden_state_layer_ids (- 1)", shapes, target)
            return
        check_block_taps(head, config.get("target_layer_ids"), "target_layer_ids", shapes, target)

    @classmethod
    def replica(cls, head_dir: str, method: str, target: TargetInfo):
        from draftsmith.drafters.dspark.replica import DSparkReplica

        return DSparkReplica(head_dir, target)

    @classmethod
    def serve_hint(cls, head_dir: Path, config: dict[str, Any]) -> str:
        """A DSpark drafter is given to the target's server (GPU: vLLM's V2 model runner);
        the speculators layout names the target and k itself."""
        if "speculators_config" in config:
            return f"vllm serve {head_dir}  (GPU only: V2 model runner)"
        spec = f'{{"method": "dspark", "model": "{head_dir}", "num_speculative_tokens": K}}'
        return f"vllm serve TARGET --speculative-config '{spec}'  (GPU only: V2 model runner)"
