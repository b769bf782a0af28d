"""TTT attention through torch's flex attention with a block mask (``model.attention: flex``).

Step k of the unroll attends over the keys of steps 0..k laid end to end, ``(k+1) * T`` of
them: key ``j`` is row position ``j % T`` written by step ``j // T``. The mask is the TTT
mask of ``ttt.dense_step_attention`` as a function (``ttt_mask_mod``): a step-0 key is seen
by the queries at or after it in the same packed document, a key of a later step only by its
own stream's query (the diagonal). flex attention skips the key blocks no query of a block
sees and computes in one fused kernel: no [T, T] score tensor, no float32 round trip, no
separate log-sum-exp pass, and the same result as ``dense`` (the reference).

On CUDA flex attention is compiled (``torch.compile``: its eager form materialises the
scores). On CPU torch runs its forward only: a CPU unroll that needs gradients is refused.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from draftsmith.core.errors import ConfigError

_compiled: Callable[..., Tensor] | None = None


def ttt_mask_mod(
    doc_ids: Tensor, step: int = 0, window: int | None = None
) -> Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]:
    """The TTT mask over ``(k+1) * T`` keys as flex's ``mask_mod(b, h, q, kv) -> bool``.

    doc_ids [B, T]: the document of each packed position (no attention across documents);
    ``window``: the head's sliding window, for the queries of TTT step ``step`` (``masks.py``:
    a step-0 key ``step + q - pos <= window - 1`` behind, a step-j key while
    ``step - j <= window - 1``).
    """
    t = doc_ids.shape[1]

    def mask_mod(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        pos = kv % t  # the row position of key kv, written by step kv // t
        prefix = (kv < t) & (pos <= q) & (doc_ids[b, q] == doc_ids[b, pos])
        own = (kv >= t) & (pos == q)
        if window is not None:
            prefix = prefix & (q + step - pos <= window - 1)
            own = own & (step - kv // t <= window - 1)
        return prefix | own

    return mask_mod


def ttt_block_mask(doc_ids: Tensor, step: int, window: int | None = None) -> BlockMask:
    """The block mask of TTT step ``step`` (0-based): T queries, ``(step + 1) * T`` keys."""
    b, t = doc_ids.shape
    return create_block_mask(
        ttt_mask_mod(doc_ids, step, window), b, None, t, (step + 1) * t, device=doc_ids.device
    )


def _flex() -> Callable[..., Tensor]:
    """flex attention, compiled once per process on CUDA (the fused kernel)."""
    global _compiled
    if _compiled is None:
        _compiled = torch.compile(flex_attention)
    return _compiled


def flex_step_attention(
    q: Tensor, keys: list[Tensor], values: list[Tensor], block_mask: BlockMask
) -> Tensor:
    """Step-k attention in one flex call.

    q [B, n, T, hd]; keys/values: k+1 tensors [B, n_kv, T, hd] (step 0 first);
    ``block_mask`` from ``ttt_block_mask(doc_ids, k)``. Returns [B, n, T, hd].
    """
    k = keys[0] if len(keys) == 1 else torch.cat(keys, dim=2)  # [B, n_kv, (k+1)T, hd]
    v = values[0] if len(values) == 1 else torch.cat(values, dim=2)
    attend = _flex() if q.device.type == "cuda" else flex_attention
    try:
        return attend(q, k, v, block_mask=block_mask, enable_gqa=q.shape[1] != k.shape[1])
    except NotImplementedError as err:  # torch has no flex backward on CPU
        if "backward" not in str(err):
            raise
        raise ConfigError(
            f"model.attention: 'flex' on {q.device.type}: {err} Train with flex on CUDA, or "
            "set model.attention auto"
        ) from err
