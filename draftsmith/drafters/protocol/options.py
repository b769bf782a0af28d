"""Option groups drafter kinds share, and how a kind's options are read and documented.

A kind's ``Options`` dataclass composes these groups and adds its own fields. Each field is
typed and carries a docstring under it; ``field_docs`` reads those, so ``draftsmith train fit
--help`` shows them under ``model.*``.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Literal

from draftsmith.core.errors import ConfigError
from draftsmith.drafters.losses.fused_loss import FusedMode
from draftsmith.drafters.losses.loss import LossKind, objective_weights


def exclusive(default: Any) -> Any:
    """A field that changes what gets trained: set for a kind that lacks it, it is refused
    (``drafters.make``) instead of ignored with a note, as other kinds' options are."""
    return field(default=default, metadata={"exclusive": True})


@dataclass
class HeadOptions:
    """What every kind has."""

    num_layers: int = 1
    """Decoder layers in the head."""
    loss_chunk_size: int = 1024
    """Tokens per chunk of logits in the loss (bounds peak memory)."""
    fused_loss: FusedMode = "auto"
    """The draft loss's GPU path (``drafters/losses/fused_loss.py``): ``auto`` runs it when the
    states are on CUDA and Triton imports (bf16 logits, online softmax in a Triton kernel
    pair, no fp32 [tokens, vocab] tensor), else the torch path; ``on`` requires it; ``off``
    always runs the torch path (CPU always does under ``auto``). DSpark's loss ignores it."""


@dataclass
class TTTOptions(HeadOptions):
    """Heads unrolled with training-time test (``ttt.py``): EAGLE-3 and EAGLE-1."""

    ttt_steps: int = 7
    """K, draft steps unrolled per batch (training-time test); P-EAGLE: drafts per pass."""
    loss_decay: float = 0.8
    """Step k's loss weight is ``loss_decay ** k``."""
    loss: LossKind = "kl"
    """Per-token objective against the teacher: ``kl`` (soft cross-entropy), ``tv`` (total
    variation ``0.5 * sum |p_draft - p_teacher|``; a sampled draft token is accepted with
    probability 1 - TV) or ``kl_tv`` (``(1 - tv_weight) * kl + tv_weight * tv``)."""
    tv_weight: float = 0.5
    """``kl_tv``: the weight of TV, in [0, 1]."""
    init_from_target: bool = exclusive(False)
    """Start the draft's decoder layers as copies of the target's last ``num_layers`` layers,
    ``fc`` passing the deepest tapped layer through (EAGLE-1: the hidden half) and EAGLE-3's
    final norm as the target's (``target_init.py``). Needs the head's hidden size to equal the
    target's. Default: random init."""
    attention: Literal["auto", "blockwise", "efficient", "dense", "flex"] = "auto"
    """TTT attention: ``auto`` (blockwise on CPU; on CUDA flex when the unroll is compiled,
    else efficient), ``blockwise``, ``efficient`` (SDPA; O(T) per step), ``dense``
    (reference) or ``flex`` (torch's flex attention with a block mask of the packed documents
    and TTT diagonals, one fused kernel; trains on CUDA only, ``ttt_flex.py``)."""
    compile: Literal["auto", "on", "off"] = "auto"
    """torch.compile of the TTT unroll (``ttt_compile.py``): ``auto`` compiles in a
    one-process CUDA run where it was measured faster for the nearest ``ttt_steps``
    (2026-11-27, H200: +48% at 3, +110% at 7), never on CPU or under several processes;
    ``on`` always; ``off`` never. P-EAGLE's one pass ignores it."""

    def __post_init__(self) -> None:
        if self.ttt_steps < 1 or not 0 < self.loss_decay <= 1:
            raise ConfigError(
                f"model: need ttt_steps >= 1 and 0 < loss_decay <= 1; got "
                f"ttt_steps={self.ttt_steps}, loss_decay={self.loss_decay}"
            )
        objective_weights(self.loss, self.tv_weight)  # refuses an unknown loss, a bad tv_weight


@dataclass
class BlockOptions:
    """Kinds that draft a block of mask slots in one pass: DFlash, and P-EAGLE."""

    num_anchors: int = 128
    """DFlash and P-EAGLE: blocks per packed row, anchored at random response tokens."""
    mask_token_id: int | None = None
    """DFlash and P-EAGLE: the mask slots' token id; null: a spare id past the tokenizer,
    else one unused in the responses (``vocab.choose_mask_token``)."""


@dataclass
class WindowOptions:
    """Kinds whose draft attention vLLM windows: EAGLE-3 and P-EAGLE (served as vLLM's Qwen3
    EAGLE-3 draft), DFlash and DFlash2 (and any block kind that composes this group)."""

    sliding_window: int | None = exclusive(None)
    """Sliding-window attention of every draft layer, in tokens: a query sees the keys of
    the last ``sliding_window`` positions, its own included (vLLM's convention), in training
    (TTT steps and blocks alike) and in the exported ``layer_types`` / ``sliding_window``.
    EAGLE-3 / P-EAGLE heads with a window get Qwen3's q/k norms and export as
    ``Eagle3Qwen3ForCausalLM``, the EAGLE-3 draft whose window vLLM 0.32 applies (its Llama
    one ignores windows). Must exceed ``ttt_steps`` (DFlash: ``block_size``). Null: full
    attention. A flat acceptance over context length is the point (speculators #684: 1.58 /
    1.52 / 1.56 at 2k / 8k / 16k against full attention's 2.30 / 1.69 / 1.09)."""


def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each dataclass field of ``cls`` and its bases, one line each."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if klass is object or not hasattr(klass, "__dataclass_fields__"):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):  # defined where no source is kept
            continue
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for node, nxt in zip(body, body[1:], strict=False):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def defaults(cls: type) -> dict[str, Any]:
    """Each field's default (every option of a kind has one)."""
    out = {}
    for f in fields(cls):
        if f.default is not MISSING:
            out[f.name] = f.default
        elif f.default_factory is not MISSING:
            out[f.name] = f.default_factory()
        else:
            raise TypeError(f"{cls.__name__}.{f.name}: a drafter option needs a default")
    return out
