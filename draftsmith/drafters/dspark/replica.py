"""An exported DSpark drafter drafting as vLLM serves it (``Drafter.replica``).

vLLM (``v1/worker/gpu/spec_decode/dspark/speculator.py``, anchor-as-first): after the target
emitted ``x[t+1]`` the drafter's context is the target's tapped states of tokens ``0..t`` and
its query one block ``[x[t+1], MASK x (k - 1)]`` at positions ``t+1 .. t+k``; slot ``j``
drafts ``x[t+j+2]`` from ``lm_head(h_j) + markov_w2(markov_w1(prev_j))``, ``prev_j`` the token
before it: the anchor for slot 0, then the previous draft (``_sample_sequential``). While
drafts ``0..j-1`` were accepted they are the served tokens, so ``prev_j = x[t+j+1]``. The
confidence head changes no draft (vLLM reads it only with adaptive verification, off by
default); a block attends within itself both ways, so its drafts depend on k.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from torch import Tensor

from draftsmith.core.targets import TargetInfo
from draftsmith.drafters.dspark.model import DSparkDrafter
from draftsmith.drafters.headfiles.directory import HeadError

BUILT = {"markov_head_type": "vanilla", "sample_from_anchor": True}


def read_dspark(head_dir: str | Path) -> DSparkDrafter:
    """The drafter of a directory ``export_dspark`` wrote (vLLM's layout or speculators')."""
    from draftsmith.drafters.attention.llama import target_sizes
    from draftsmith.drafters.dspark.speculators import read_speculators
    from draftsmith.drafters.headfiles.read import check_tensors, read_head_files

    config, tensors = read_head_files(head_dir)
    if config.get("speculators_model_type"):
        return read_speculators(head_dir)[0]
    for name, ours in BUILT.items():
        if config.get(name, ours) != ours:
            raise HeadError(
                f"head: {head_dir} has {name} {config[name]!r}; draftsmith's DSpark replica "
                f"builds {name} {ours!r} only"
            )
    sizes = target_sizes(config)
    del sizes["max_position_embeddings"]
    try:
        head = DSparkDrafter(
            **sizes,
            target_hidden_size=config.get("target_hidden_size"),
            target_layer_ids=list(config["target_layer_ids"]),
            mask_token_id=int(config["mask_token_id"]),
            num_layers=int(config.get("num_hidden_layers", 1)),
            block_size=int(config["block_size"]),
            markov_rank=int(config["markov_rank"]),
            confidence_head=bool(config.get("enable_confidence_head", True)),
        )
    except KeyError as missing:
        raise HeadError(
            f"head: {head_dir}/config.json lacks {missing}; give the directory "
            "`draftsmith export` wrote for a DSpark drafter"
        ) from None
    state = {n: v for n, v in head.state_dict().items() if n != "embed_tokens"}
    check_tensors("vLLM DSpark", state, tensors)
    head.load_state_dict({n: v.float() for n, v in tensors.items()}, strict=False)
    return head


class DSparkReplica:
    """A :class:`~draftsmith.drafters.protocol.Replica` of an exported DSpark drafter."""

    def __init__(self, head_dir: str, target: TargetInfo) -> None:
        from draftsmith.drafters.target.weights import load_target_weights

        self.head = read_dspark(head_dir).float().eval()
        weights = load_target_weights(target)
        self.head.set_embeddings(weights.embed)  # the mask slots read the target's row
        self.lm_head = weights.lm_head
        self.layer_ids = [i + 1 for i in sorted(self.head.target_layer_ids)]

    @torch.no_grad()
    def draft_logits(self, tokens: Tensor, states: Tensor, k: int) -> Iterator[Tensor]:
        """See :class:`~draftsmith.drafters.protocol.Replica`."""
        from draftsmith.drafters.attention.block_layout import block_states

        slots = block_states(self.head, tokens, states, k)  # [L, k, H]
        n = tokens.numel()
        for j in range(k):
            prev = tokens[(torch.arange(n) + j + 1).clamp(max=n - 1)]  # x[t+j+1]
            yield self.head.logits(slots[:, j], prev, self.lm_head)
