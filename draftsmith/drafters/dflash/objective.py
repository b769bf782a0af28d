"""``model.kind: dflash`` inside ``DraftModule``: building the drafter and its objective.

The functions take the ``DraftModule`` (typed as a LightningModule: this module is below it).

``DraftModule`` dispatches here (``setup`` -> ``build_dflash``, ``forward_loss`` ->
``dflash_forward_loss``); the drafter is ``dflash.DFlashDrafter``, the blocks, mask and loss
are ``dflash_blocks``.

Context layers: the data module's ``aux_layers`` (default: every tapped layer but the last).
Draftsmith's layer id ``k`` is the residual stream after ``k`` decoder layers; vLLM's
``dflash_config.target_layer_ids`` are 0-based layer indices whose output it taps (it adds 1),
so ``target_layer_id = k - 1`` and id 0 (the embeddings) cannot be a context layer.

Mask token: ``model.mask_token_id`` when given; else the first id past the tokenizer when the
target's vocabulary is padded beyond it (a spare id no text ever produces); else the highest
id that never occurs as a response token in the dataset. The mask slots' input vector is
trained (``mask_embedding.pt`` in the export) unless ``model.train_mask_embedding: false``;
with the default (null) it is trained unless the id is spare and the target's row of it is
non-zero (a zero row would make every mask slot's query zero, blind to its position).
"""

from __future__ import annotations

import torch
from lightning.pytorch import LightningModule
from torch import Tensor

from draftsmith.core.console import say
from draftsmith.core.errors import ConfigError, DatasetError
from draftsmith.core.targets import TargetInfo, eos_ids
from draftsmith.drafters.acceptance import acceptance_from_counts
from draftsmith.drafters.dflash.blocks import (
    accepted_lengths,
    anchor_candidates,
    block_inputs,
    block_loss,
    block_mask,
    default_gamma,
    sample_anchors,
    served_walk,
    slot_validity,
)
from draftsmith.drafters.dflash.model import dflash_from_target
from draftsmith.drafters.loss import TTTLoss
from draftsmith.drafters.target_weights import load_target_weights
from draftsmith.train.data import EagleDataModule, draft_vocab


def target_layer_ids(aux_layer_ids: list[int], num_hidden_layers: int) -> list[int]:
    """Draftsmith layer ids (state after k layers) -> vLLM's 0-based ``target_layer_ids``."""
    bad = [k for k in aux_layer_ids if not 1 <= k <= num_hidden_layers]
    if bad:
        raise DatasetError(
            f"data.aux_layers: {aux_layer_ids} holds {bad}; DFlash taps decoder layer outputs, "
            f"ids 1..{num_hidden_layers} (id 0 is the embeddings): drop them from data.aux_layers"
        )
    return [k - 1 for k in aux_layer_ids]


def tokenizer_size(target: TargetInfo) -> int | None:
    """How many ids the target's tokenizer has (None when it cannot be read)."""
    try:
        from transformers import AutoTokenizer

        return len(AutoTokenizer.from_pretrained(target.path))
    except Exception:  # no tokenizer files: no spare id is known
        return None


def choose_mask_token(
    target: TargetInfo, dm: EagleDataModule, requested: int | None
) -> tuple[int, bool]:
    """(mask token id, whether it is a spare id past the tokenizer); module docstring."""
    vocab = target.vocab_size
    if requested is not None:
        if not 0 <= requested < vocab:
            raise ConfigError(
                f"model.mask_token_id: {requested} is outside the target's vocabulary "
                f"0..{vocab - 1}; give an id in it or null to choose one"
            )
        n = tokenizer_size(target)
        return requested, n is not None and requested >= n
    n = tokenizer_size(target)
    if n is not None and n < vocab:
        return n, True
    counts = dm.train_token_counts(vocab)
    unused = (counts == 0).nonzero().flatten()
    return int(unused[-1] if unused.numel() else counts.argmin()), False


def build_dflash(module: LightningModule, target: TargetInfo, dm: EagleDataModule) -> None:
    """Build the drafter for ``target`` and the frozen target tensors it shares."""
    hp = module.hparams
    if hp.init_from_target:
        raise ConfigError("model.init_from_target: not available for model.kind dflash; set false")
    if hp.loss_decay_gamma is not None and hp.loss_decay_gamma <= 0:
        raise ConfigError(
            f"model.loss_decay_gamma: {hp.loss_decay_gamma}; give a positive decay (slot i "
            "weighs exp(-(i - 1) / gamma)) or null for the paper's choice"
        )
    if hp.block_size < 2 or hp.num_anchors < 1:
        raise ConfigError(
            f"model.block_size {hp.block_size} / model.num_anchors {hp.num_anchors}: a block "
            "holds the anchor and at least one draft (block_size >= 2), num_anchors >= 1"
        )
    ids = target_layer_ids(dm.aux_layer_ids, target.num_hidden_layers)
    mask_id, spare = choose_mask_token(target, dm, hp.mask_token_id)
    weights = load_target_weights(target)
    trained = hp.train_mask_embedding
    if trained is None:
        trained = not (spare and bool(weights.embed[mask_id].abs().sum() > 0))
    head = dflash_from_target(
        target.config,
        target_layer_ids=ids,
        mask_token_id=mask_id,
        num_layers=hp.num_layers,
        block_size=hp.block_size,
        train_mask_embedding=trained,
    )
    head.set_embeddings(weights.embed)
    module.norm_eps = weights.norm_eps
    module.register_buffer("target_lm_head", weights.lm_head, persistent=False)
    module.register_buffer("target_norm", weights.norm, persistent=False)
    if hp.loss_vocab_size is None:
        module.loss_lm_head = None
    else:
        if not 0 < hp.loss_vocab_size <= target.vocab_size:
            raise ConfigError(
                f"model.loss_vocab_size: {hp.loss_vocab_size}; give 1..{target.vocab_size} "
                "(the target's vocabulary) or null for all of it"
            )
        counts = dm.train_token_counts(target.vocab_size)
        kept = draft_vocab(counts, hp.loss_vocab_size, eos_ids(target.config))
        covered = counts[kept].sum().item() / max(counts.sum().item(), 1)
        module.register_buffer("loss_lm_head", weights.lm_head[kept], persistent=False)
        say(f"train: DFlash loss over the {kept.numel():,} most frequent ids ({covered:.2%} "
            "of the loss tokens); drafting and validation over all ids")  # fmt: skip
    module.head = head
    kind = "spare id past the tokenizer" if spare else "an id unused in the responses"
    kind = "model.mask_token_id" if hp.mask_token_id is not None else kind
    say(f"train: DFlash mask token {mask_id} ({kind}), "
        f"{'trained' if trained else 'target'} embedding; target_layer_ids {ids}")  # fmt: skip
    module.info.update(
        kind="dflash",
        target=target.path,
        head_kwargs=head.init_kwargs,
        layer_ids=list(dm.aux_layer_ids),
        mask_token_id=mask_id,
        mask_token_spare=spare,
    )


def run_blocks(
    module: LightningModule,
    batch: dict[str, Tensor],
    teacher: Tensor,
    anchors: Tensor,
    keep: Tensor,
) -> tuple[TTTLoss, Tensor]:
    """Blocks at ``anchors`` [B, A] (``keep``), one drafter pass, the weighted loss;
    returns ``dflash_blocks.block_loss``'s (TTTLoss, correct [B, A, bs - 1])."""
    hp, head = module.hparams, module.head
    bs = hp.block_size
    ids, positions = block_inputs(
        batch["input_ids"], batch["position_ids"], anchors, bs, head.mask_token_id
    )
    mask = block_mask(anchors, keep, batch["doc_ids"], bs)
    drafts = head(ids, positions, batch["aux_states"], batch["position_ids"], mask)
    valid, target = slot_validity(anchors, keep, batch["loss_mask"], batch["doc_ids"], bs)
    gamma = hp.loss_decay_gamma or default_gamma(bs)
    lm_head = module.target_lm_head  # validation judges drafts over every id, as vLLM does
    if module.training and module.loss_lm_head is not None:
        lm_head = module.loss_lm_head  # draft and teacher restricted to the loss vocabulary
    return block_loss(drafts, lm_head, teacher, valid, target, gamma, hp.loss_chunk_size)


def dflash_forward_loss(
    module: LightningModule, batch: dict[str, Tensor]
) -> tuple[Tensor, TTTLoss]:
    """Training: ``num_anchors`` random blocks per row, one pass; the acceptance logged is the
    average over those anchors. Validation: a block at every candidate anchor (``num_anchors``
    per pass), and the acceptance of walking each response as vLLM does (``served_walk``):
    blocks see only the context before their anchor, so one block per position gives the
    drafts of every path vLLM could take."""
    teacher = module.teacher(batch)
    cand = anchor_candidates(batch["loss_mask"], batch["doc_ids"], batch["position_ids"])
    if module.training:
        out, _ = run_blocks(
            module, batch, teacher, *sample_anchors(cand, module.hparams.num_anchors)
        )
        return out.loss, out
    anchors, keep = sample_anchors(cand, cand.shape[1])  # every candidate, ascending
    accepted = torch.zeros_like(batch["input_ids"])  # [B, T]
    parts = []
    for start in range(0, anchors.shape[1], module.hparams.num_anchors):
        chunk = slice(start, start + module.hparams.num_anchors)
        out, correct = run_blocks(module, batch, teacher, anchors[:, chunk], keep[:, chunk])
        lengths = accepted_lengths(correct) * keep[:, chunk]  # [B, A]
        accepted.scatter_add_(1, anchors[:, chunk], lengths)  # unused slots add 0
        parts.append(out)
    seen, hit = served_walk(
        accepted, batch["loss_mask"], batch["doc_ids"], module.hparams.block_size - 1
    )
    return merge(parts, seen, hit)


def merge(parts: list[TTTLoss], seen: Tensor, hit: Tensor) -> tuple[Tensor, TTTLoss]:
    """One (loss, TTTLoss) from the passes over chunks of anchors, each weighted by its
    scored slots; acceptance from the served walk's counts."""
    dev = parts[0].loss.device
    counts = torch.stack([p.step_count for p in parts]).float().to(dev)  # [n, K]
    share = counts / counts.sum(0).clamp(min=1)
    total = counts.sum(1) / counts.sum().clamp(min=1)
    step_loss = sum(p.step_loss * w for p, w in zip(parts, share, strict=True))
    step_accuracy = sum(p.step_accuracy * w for p, w in zip(parts, share, strict=True))
    loss = sum(p.loss * float(w) for p, w in zip(parts, total, strict=True))
    out = TTTLoss(
        loss=loss,
        step_loss=step_loss,
        step_accuracy=step_accuracy,
        step_count=counts.sum(0).long(),
        acceptance_length=acceptance_from_counts(seen, hit).to(dev),
        chain_seen=seen.to(dev),
        chain_hit=hit.to(dev),
    )
    return loss, out
