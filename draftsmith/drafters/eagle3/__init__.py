"""EAGLE-3 (``model.kind: eagle3``), and P-EAGLE as its parallel-drafting option.

- ``head.py``: the head, weight for weight vLLM's ``Eagle3LlamaForCausalLM``.
- ``options.py``: its ``model.*`` options.
- ``parallel.py``: P-EAGLE's objective (``model.parallel_drafting``): all k drafts in one pass.
- ``export.py``: the directory vLLM serves (``vllm serve DIR``), and the checks of one.
- ``replica.py``: an exported head drafting as vLLM serves it (eval's expected acceptance).
- ``layouts.py`` / ``layouts_write.py``: heads published in other layouts read, and written
  for other consumers (``draftsmith convert``).

The serial objective is training-time test, shared with EAGLE-1 (``ttt_objective.py``); the
head reads the fused tapped states and drafts over a reduced vocabulary (``d2t``) whose
lm_head starts from the target's rows.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from draftsmith.core.console import say
from draftsmith.core.errors import ConfigError, DatasetError
from draftsmith.core.targets import TargetInfo, eos_ids
from draftsmith.drafters.attention.masks import check_window
from draftsmith.drafters.eagle3.export import (
    check_eagle3_head,
    eagle3_config,
    eagle3_tensors,
    export_eagle3,
)
from draftsmith.drafters.eagle3.head import Eagle3Head, eagle3_from_target
from draftsmith.drafters.eagle3.options import Eagle3Options
from draftsmith.drafters.eagle3.parallel import parallel_drafting_loss
from draftsmith.drafters.headfiles.directory import HeadError
from draftsmith.drafters.losses.loss import TTTLoss
from draftsmith.drafters.losses.ttt_objective import unrolled_loss
from draftsmith.drafters.protocol import Built, Drafter, Trainee, TrainingData
from draftsmith.drafters.protocol.batch import Batch
from draftsmith.drafters.target.init_layers import init_from_target
from draftsmith.drafters.target.vocab import (
    choose_mask_token,
    default_draft_vocab_size,
    draft_vocab,
)
from draftsmith.drafters.target.weights import TargetWeights

ARCHITECTURES = (
    "Eagle3LlamaForCausalLM",
    "LlamaForCausalLMEagle3",
    "Eagle3Speculator",
    "Eagle3Qwen3ForCausalLM",
)


class Eagle3(Drafter):
    """EAGLE-3: fused low/mid/high target states, training-time test, a reduced vocabulary."""

    name = "eagle3"
    title = "EAGLE-3"
    Options = Eagle3Options
    # P-EAGLE is the same architecture; its config says so (speculators_model_type "peagle").
    methods = {"eagle3": ARCHITECTURES, "peagle": ARCHITECTURES}
    head_class = Eagle3Head
    options: Eagle3Options

    def check_options(self) -> None:
        opt = self.options
        check_window(opt.sliding_window, opt.ttt_steps, "model.ttt_steps",
                     "the last draft step must still see the context")  # fmt: skip

    def sequence_halo(self) -> int | None:
        """Serial TTT splits a row across ranks (teacher rows ``ttt_steps`` past a shard);
        P-EAGLE's one pass does not."""
        if self.options.compile == "on":
            raise ConfigError(
                "model.compile: on with data.sequence_parallel > 1 (its all-to-alls inside the "
                "compiled unroll are untested); set model.compile auto or off"
            )
        return None if self.options.parallel_drafting else self.options.ttt_steps

    def build(self, target: TargetInfo, data: TrainingData, weights: TargetWeights) -> Built:
        opt = self.options
        if opt.init_from is not None:
            return self.published(target, data, weights)
        mask_id = None
        if opt.parallel_drafting:
            mask_id, spare = choose_mask_token(target, data, opt.mask_token_id)
            how = "a spare id past the tokenizer" if spare else "an id unused in the responses"
            say(f"train: P-EAGLE mask token {mask_id} ({how}), trained mask_hidden")
        aux = data.aux_layer_ids
        if data.teacher_layer_id in aux:
            n = target.num_hidden_layers
            raise DatasetError(f"data.aux_layers: {aux} must not include layer {n}")
        vocab = target.vocab_size
        default = default_draft_vocab_size(vocab)
        size = default if opt.draft_vocab_size is None else opt.draft_vocab_size
        if size < 1:
            raise ConfigError(
                f"model.draft_vocab_size: {size}; give a positive size or null (the target's "
                f"vocabulary up to {default:,} ids)"
            )
        if size > vocab:  # a draft vocabulary larger than the target's is the target's
            say(f"train: model.draft_vocab_size {size} > the target's vocabulary {vocab}: "
                f"using all {vocab} ids")  # fmt: skip
            size = vocab
        options: dict[str, Any] = dict(
            num_layers=opt.num_layers,
            draft_vocab_size=size,
            num_aux_states=len(aux),
            norm_before_fc=opt.norm_before_fc,
            fc_norm=opt.fc_norm,
            norm_output=opt.norm_output,
        )
        if opt.parallel_drafting:
            options.update(parallel_drafting=True, mask_token_id=mask_id)
        if opt.sliding_window is not None:  # the Qwen3 draft: the one vLLM windows
            options.update(qk_norm=True, sliding_window=opt.sliding_window)
        head = eagle3_from_target(target.config, **options)
        head.set_embeddings(weights.embed)
        info: dict[str, Any] = {"head_kwargs": head.init_kwargs, "layer_ids": aux}
        if opt.init_from_target:
            info["init_from_target_layers"] = init_from_target(head, target, weights.norm)
        return Built(head, {}, info)

    def published(self, target: TargetInfo, data: TrainingData, weights: TargetWeights) -> Built:
        """``init_from``: the published head, checked against the target and the data."""
        from draftsmith.drafters.eagle3.layouts import fit_to_target, read_head

        opt, where = self.options, f"model.init_from: {self.options.init_from}"
        try:
            head, facts = read_head(opt.init_from, target.config)
            fit_to_target(head, facts, target)
        except HeadError as err:
            raise ConfigError(f"{where}: {str(err).removeprefix('head: ')}") from err
        if facts.layer_ids != data.aux_layer_ids:
            raise ConfigError(
                f"{where} taps layers {facts.layer_ids}, the dataset feeds {data.aux_layer_ids}; "
                f"set data.aux_layers {facts.layer_ids} (extract them if the dataset lacks them)"
            )
        kept = head.init_kwargs
        asked = {"num_layers": opt.num_layers, "draft_vocab_size": opt.draft_vocab_size}
        asked |= {n: getattr(opt, n) for n in ("norm_before_fc", "fc_norm", "norm_output")}
        defaults = Eagle3Options()
        for name, value in asked.items():
            if value != getattr(defaults, name) and value != kept[name]:
                raise ConfigError(
                    f"model.{name}: {value}, but {where} has {kept[name]}; leave it at its "
                    "default to keep the published head's"
                )
        if opt.parallel_drafting or opt.init_from_target:
            raise ConfigError(
                f"{where}: starts a serial EAGLE-3 head from its own weights; set "
                "model.parallel_drafting and model.init_from_target false"
            )
        head.set_embeddings(weights.embed)
        if opt.sliding_window is not None:  # trained with it; export says if vLLM ignores it
            head.sliding_window = head.init_kwargs["sliding_window"] = opt.sliding_window
        say(f"train: starting from the {facts.layout} head {opt.init_from} (taps "
            f"{facts.layer_ids}, {head.draft_vocab_size:,} draft ids)")  # fmt: skip
        started = {"path": str(Path(opt.init_from).absolute()), "layout": facts.layout}
        info = {"head_kwargs": head.init_kwargs, "layer_ids": list(data.aux_layer_ids)}
        return Built(head, {}, {**info, "init_from": started})

    def fit_to_data(self, trainee: Trainee, target: TargetInfo, data: TrainingData) -> dict:
        """The draft vocabulary: the most frequent loss-masked ids (EOS kept); the draft
        lm_head starts from their target rows (frozen unless ``train_lm_head``)."""
        head = trainee.head
        counts = data.train_token_counts(target.vocab_size)
        if self.options.init_from is None:
            ids = draft_vocab(counts, head.draft_vocab_size, eos_ids(target.config))
            head.set_draft_vocab(ids)
            with torch.no_grad():
                head.lm_head.weight.copy_(trainee.target_lm_head[ids.to(trainee.device)])
        else:  # a published head keeps its vocabulary and its trained lm_head
            ids = head.draft_to_target(torch.arange(head.draft_vocab_size, device=head.d2t.device))
            ids = ids.cpu()
        head.lm_head.weight.requires_grad_(self.options.train_lm_head)
        covered = counts[ids].sum().item() / max(counts.sum().item(), 1)
        say(f"train: draft vocabulary of {ids.numel():,} ids covers {covered:.2%} of the "
            "loss tokens")  # fmt: skip
        return {"draft_vocab_coverage": round(covered, 6)}

    def loss(self, trainee: Trainee, batch: Batch) -> tuple[Tensor, TTTLoss]:
        opt, head = self.options, trainee.head
        if opt.parallel_drafting:  # P-EAGLE: one pass drafts every position
            return parallel_drafting_loss(trainee, opt, batch)
        ids = head.draft_to_target(torch.arange(head.draft_vocab_size, device=trainee.device))
        teacher_weight, to_draft = trainee.target_lm_head[ids], head.target_to_draft_index()
        teacher = trainee.teacher(batch)
        out, _ = unrolled_loss(
            trainee, opt, batch, batch["aux_states"], teacher, teacher_weight, to_draft
        )
        return out.loss, out

    def walk_length(self) -> int:
        return self.options.ttt_steps

    def restore(self, head: nn.Module, state: dict[str, Tensor] | None) -> None:
        """The target-to-draft map (``t2d``, not saved) from the saved ``d2t``."""
        if state is None:  # FSDP / DeepSpeed load the weights and d2t themselves
            d2t = head.d2t
        elif "head.d2t" in state:  # (a full-vocabulary head stores no d2t)
            d2t = state["head.d2t"]
        else:
            return
        head.set_draft_vocab(d2t + torch.arange(d2t.numel(), device=d2t.device))

    @classmethod
    def head_from_target(cls, target_config: dict[str, Any], **head_options: Any):
        return eagle3_from_target(target_config, **head_options)

    @classmethod
    def head_config(cls, head, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return eagle3_config(head, *args, **kwargs)

    @classmethod
    def head_tensors(cls, head, dtype: torch.dtype) -> dict[str, Tensor]:
        return eagle3_tensors(head, dtype)

    @classmethod
    def export(cls, head, target, out_dir, **kwargs: Any) -> Path:
        return export_eagle3(head, target, out_dir, **kwargs)

    @classmethod
    def method_of(cls, config: dict[str, Any]) -> str | None:
        if config.get("speculators_model_type") == "peagle":
            return "peagle"
        arch = (config.get("architectures") or ["?"])[0]
        if arch == "LlamaForCausalLM" and "draft_vocab_size" in config:
            return "eagle3"  # the SafeAILab EAGLE layout (EAGLE-1 heads name no draft vocab)
        return super().method_of(config) and "eagle3"

    @classmethod
    def check_head(cls, head, method, config, shapes, target) -> None:
        check_eagle3_head(head, method, config, shapes, target)

    @classmethod
    def replica(cls, head_dir: str, method: str, target: TargetInfo):
        from draftsmith.drafters.eagle3.replica import Eagle3Replica

        return Eagle3Replica(head_dir, method, target)

    @classmethod
    def speculative_config(cls, method: str, head_dir: str, k: int) -> dict[str, Any]:
        spec = super().speculative_config("eagle3", head_dir, k)
        if method == "peagle":  # P-EAGLE is vLLM's eagle3 drafting in parallel
            spec["parallel_drafting"] = True
        return spec
