"""DFlash2: DFlash's one-pass block plus a grouped dynamic convolution around every sublayer and
a low-rank candidate selector walked from the anchor (``model.kind: dflash2``; vLLM's
``method: dflash`` with a ``DFlash2DraftModel`` drafter).

DFlash2 (Inco AI / z-lab, August 2026) is literally DFlash plus parts, so this kind imports
``drafters/dflash`` explicitly: its drafter, blocks, loss, mask token, tapped layers and export
pieces; everything else lives here:

- ``conv.py``: the grouped two-tap dynamic depthwise convolution and the layer it wraps.
- ``selector.py``: the candidate selector ``S(p, c) = unary(c) + <A[p] * W h, B[c]>``.
- ``model.py``: the drafter (vLLM's ``DFlash2Qwen3ForCausalLM``), a DFlash warm start.
- ``objective.py``: DFlash's loss plus the selector's K-way cross-entropy; the walk at T = 0, 1.
- ``export.py``: the directory vLLM loads, read back for ``draftsmith convert``.
- ``replica.py``: an exported drafter drafting as vLLM serves it (eval simulates with it).
- ``options.py``: the options and where their defaults come from.

Sources: vLLM #52816 (``qwen3_dflash2.py``, ``spec_decode/dflash2/speculator.py``, read in the
installed vLLM 0.32), vllm-project/speculators #1006, SpecForge #772 and #793, NVIDIA
Model-Optimizer #2216, z-lab/dflash and its published ``Qwen3.8-27B-DFlash2`` config.

Serving: vLLM 0.32 runs DFlash2 drafts only in its V2 GPU model runner; its V1 runner (the CPU
build's) refuses them ("DFlash candidate-head drafts"), so ``cpu_serving`` is false. Targets:
the DFlash runtime's, any target vLLM can tap (``SupportsEagle3``, Llama included); a target
it cannot tap trains only with ``model.simulate_only`` from a given dataset.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import Tensor

from draftsmith.core.console import say
from draftsmith.core.errors import ConfigError
from draftsmith.core.targets import TargetInfo, text_config
from draftsmith.drafters.dflash import DFlash
from draftsmith.drafters.dflash2.export import ARCHITECTURE, SIZES, export_dflash2
from draftsmith.drafters.dflash2.model import DFlash2Drafter, dflash2_from_target, warm_start
from draftsmith.drafters.dflash2.objective import dflash2_loss
from draftsmith.drafters.dflash2.options import DFlash2Options
from draftsmith.drafters.losses.loss import TTTLoss
from draftsmith.drafters.protocol import Built, Trainee, TrainingData
from draftsmith.drafters.protocol.batch import Batch
from draftsmith.drafters.target.weights import TargetWeights


def check_target(target: TargetInfo, options: dict[str, Any]) -> None:
    """Refuse, in one line, a target vLLM 0.32's DFlash2 cannot draft for with ``options``
    (the ``model`` section): one vLLM cannot tap (unless ``simulate_only``), or one whose
    hidden size the convolution's groups do not divide."""
    group = int(options.get("conv_group_size", 16))
    hidden = text_config(target.config).get("hidden_size", target.hidden_size)
    if group < 1 or hidden % group:
        raise ConfigError(
            f"model.conv_group_size: {group} does not divide the target's hidden size {hidden} "
            "(vLLM's DFlash2 convolution groups the drafter's channels, as wide as the "
            "target's); give a divisor of it"
        )
    refusal = getattr(target, "eagle3_refusal", None)
    if refusal and not options.get("simulate_only"):
        raise ConfigError(
            f"model.kind dflash2: vLLM cannot tap the target's architecture "
            f"{target.architecture} ({refusal}), so its DFlash2 cannot draft for it; give "
            "model.simulate_only true (with a given dataset) to compare simulated acceptance"
        )


class DFlash2(DFlash):
    """DFlash2 block drafting with a candidate selector (vLLM ``method: dflash``)."""

    name = "dflash2"
    title = "DFlash2"
    Options = DFlash2Options
    methods = {"dflash": (ARCHITECTURE,)}
    head_class = DFlash2Drafter
    cpu_serving = False  # vLLM's V1 runner (the CPU build) refuses DFlash2 drafts
    options: DFlash2Options

    def check_options(self) -> None:
        super().check_options()
        opt = self.options
        small = {k: getattr(opt, k) for k in SIZES if getattr(opt, k) < 1}
        if small:
            raise ConfigError(f"model: {small}; each of {list(SIZES)} must be >= 1")
        if opt.conv_kernel_size > opt.block_size:
            raise ConfigError(
                f"model.conv_kernel_size: {opt.conv_kernel_size} taps reach past a block of "
                f"model.block_size {opt.block_size}; give at most {opt.block_size} (2: published)"
            )
        if opt.selector_loss_weight < 0:
            raise ConfigError(
                f"model.selector_loss_weight: {opt.selector_loss_weight}; give a weight >= 0"
            )

    @classmethod
    def check_target(cls, target: TargetInfo, options: dict[str, Any]) -> None:
        check_target(target, options)

    def head_options(self) -> dict[str, Any]:
        return {k: getattr(self.options, k) for k in SIZES}

    def build(self, target: TargetInfo, data: TrainingData, weights: TargetWeights) -> Built:
        opt = self.options
        check_target(target, vars(opt))
        if opt.selector_top_k > target.vocab_size:
            raise ConfigError(
                f"model.selector_top_k: {opt.selector_top_k} is more than the target's "
                f"vocabulary ({target.vocab_size}); give fewer (16: published)"
            )
        if opt.simulate_only and getattr(target, "eagle3_refusal", None):
            say(f"train: dflash2 for {target.architecture}: simulated acceptance only (vLLM "
                "cannot tap it; export will refuse the head)")  # fmt: skip
        built = super().build(target, data, weights)
        if opt.init_from_dflash:
            n = warm_start(built.head, opt.init_from_dflash)
            say(f"train: DFlash2 started from the DFlash head {opt.init_from_dflash} ({n} "
                "tensors; convolutions the identity)")  # fmt: skip
            built.info["init_from"] = {"dflash head": str(Path(opt.init_from_dflash).absolute())}
        return built

    def loss(self, trainee: Trainee, batch: Batch) -> tuple[Tensor, TTTLoss]:
        return dflash2_loss(trainee, self.options, batch)

    @classmethod
    def head_from_target(cls, target_config: dict[str, Any], **head_options: Any):
        return dflash2_from_target(target_config, **head_options)

    @classmethod
    def export(cls, head, target, out_dir, **kwargs: Any) -> Path:
        check_target(target, {"conv_group_size": head.conv_group_size})
        return export_dflash2(head, target, out_dir, **kwargs)

    @classmethod
    def replica(cls, head_dir: str, method: str, target: TargetInfo):
        from draftsmith.drafters.dflash2.replica import DFlash2Replica

        return DFlash2Replica(head_dir, target)

    @classmethod
    def serve_hint(cls, head_dir: Path, config: dict[str, Any]) -> str:
        """A DFlash2 drafter is given to the target's server (GPU: vLLM's V2 model runner)."""
        return super().serve_hint(head_dir, config) + "  (GPU only: V2 model runner)"
