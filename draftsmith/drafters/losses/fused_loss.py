"""The draft loss on the GPU: a fused *linear* loss, chunked over tokens (``model.fused_loss``).

Same objective, index pairs and token weights as ``loss.ChunkedDraftLoss`` (soft
cross-entropy, TV, their blend: ``objective_weights``), computed so that the work is the
lm_head matmuls. Per chunk of tokens:

1. draft logits ``z = x @ W.T`` [n, V] and teacher logits ``u = h @ W_t.T`` [n, V] are torch
   matmuls in the compute dtype (bf16 under autocast: bf16 in and out, fp32 accumulation in
   cuBLAS);
2. a Triton kernel pair (``fused_kernels.py``) reads both once for their log-sum-exps and
   argmaxes (online softmax in fp32 registers), then again for the loss and the gradient wrt
   ``z``, which it writes over ``z`` in place (bf16);
3. the gradients are matmuls of that buffer: ``g @ W`` for the states, ``g.T @ x`` (summed
   over chunks in fp32) for a trained lm_head. The backward only scales them.

Why our own kernels: Liger-Kernel's fused linear cross-entropy and fused linear JSD cover the
KL objective but not total variation, which the acceptance-direct losses (``tv``, ``kl_tv``)
need; one kernel pair serves all three here.

Memory: the extra peak is the chunk's two [chunk, V] buffers in bf16 (2 x 2 bytes per
element), where the torch path holds fp32 [chunk, V] logits, their log-softmax, the
probabilities and their difference (4 bytes each). The teacher keeps no fp32
probabilities: ``LogitTeacher`` keeps the bf16 *logits* of the rows a batch needs when they fit
``teacher_cache`` elements (half the bytes of the torch path's fp32 probability cache, and
no softmax pass over it), so the K TTT steps share one teacher matmul; past that, or with
``teacher_cache`` 0, each chunk recomputes its teacher logits (one more matmul per chunk).

On CPU the torch path runs unchanged: ``fused_enabled`` picks this path only for CUDA
tensors with Triton importable (``auto``), or when asked (``on``; on CPU only under Triton's
interpreter, ``TRITON_INTERPRET=1``, which the tests use).
"""

from __future__ import annotations

import importlib.util
import os
from typing import Literal

import torch
from torch import Tensor

from draftsmith.core.errors import ConfigError
from draftsmith.drafters.losses.grads_in_forward import GradsInForward

FusedMode = Literal["auto", "on", "off"]


def triton_missing() -> str | None:
    """Why Triton cannot be used here (None when it can)."""
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed"
    try:
        import triton  # noqa: F401
    except Exception as err:  # a broken install: any import error means "not usable"
        return f"Triton does not import ({type(err).__name__}: {err})"
    return None


def interpreted() -> bool:
    """Triton's interpreter is on (``TRITON_INTERPRET=1``): kernels run on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def fused_enabled(mode: str, device: torch.device) -> bool:
    """Whether ``model.fused_loss`` = ``mode`` runs the fused path for tensors on ``device``.

    ``auto``: on CUDA with Triton importable; ``off``: never; ``on``: always, refusing a
    machine where it cannot run (no CUDA device, no Triton).
    """
    if mode == "off":
        return False
    if mode == "auto":
        return device.type == "cuda" and triton_missing() is None
    if mode != "on":
        raise ConfigError(f"model.fused_loss: {mode!r} is not one of 'auto', 'on', 'off'")
    missing = triton_missing()
    if device.type != "cuda" and not interpreted():
        missing = f"the states are on {device.type}, not CUDA" + (f"; {missing}" if missing else "")
    if missing:
        raise ConfigError(
            f"model.fused_loss: 'on' needs CUDA tensors and Triton ({missing}); "
            "set model.fused_loss to 'auto' or 'off' on this machine"
        )
    return True


def compute_dtype(states: Tensor) -> torch.dtype:
    """The dtype logits are computed in: autocast's when it is on for ``states``' device."""
    kind = states.device.type
    if torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return states.dtype


class LogitTeacher:
    """The teacher's logits over the draft vocabulary in the compute dtype, row by row.

    Row p of ``states`` [M, Ht] (final-normed target states) has logits ``states[p] @
    weight.T`` ([draft_vocab, Ht] rows of the target's lm_head). The rows a batch needs
    (``rows``) are computed once when they fit ``cache_elements``; otherwise per call.
    """

    def __init__(
        self,
        states: Tensor,
        weight: Tensor,
        rows: Tensor,
        dtype: torch.dtype,
        chunk_size: int = 1024,
        cache_elements: int = 2**28,
    ) -> None:
        self.dtype, self.source = dtype, weight
        self.states, self.weight = states, weight.detach().to(dtype)  # [V, Ht]
        self.logits: Tensor | None = None
        if 0 < rows.numel() * weight.shape[0] <= cache_elements:
            self.slot = torch.full((states.shape[0],), -1, dtype=torch.long, device=rows.device)
            self.slot[rows] = torch.arange(rows.numel(), device=rows.device)
            self.logits = torch.cat([self._compute(c) for c in rows.split(chunk_size)])  # [R, V]

    def _compute(self, index: Tensor) -> Tensor:
        with torch.no_grad(), torch.autocast(self.states.device.type, enabled=False):
            return self.states[index].to(self.dtype) @ self.weight.T  # [n, V]

    def __call__(self, index: Tensor) -> tuple[Tensor, Tensor]:
        """index [n] rows -> (logits [R, V], [n] the row of each index in them)."""
        if self.logits is None:
            return self._compute(index), torch.arange(index.numel(), device=index.device)
        return self.logits, self.slot[index]


class FusedDraftLoss(GradsInForward):
    """``ChunkedDraftLoss`` with the same arguments, the teacher a ``LogitTeacher``: the loss
    of each chunk by the Triton kernel pair (module docstring)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        states: Tensor,  # [N, H] draft logits inputs (flattened)
        weight: Tensor,  # [V, H] draft lm_head
        teacher: LogitTeacher,
        draft_index: Tensor,  # [P] distinct rows of `states`
        teacher_index: Tensor,  # [P] rows of the teacher
        token_weight: Tensor,  # [P] float
        chunk_size: int,
        need_grad: tuple[bool, bool],  # (states, weight): grads are computed in forward
        objective: tuple[float, float] = (1.0, 0.0),
    ) -> tuple[Tensor, Tensor, Tensor]:
        from draftsmith.drafters.losses.fused_kernels import fused_rows  # imports Triton

        dt = teacher.dtype
        # [V, H]: one cast per call, none when already dt or shared with the teacher (MTP,
        # DFlash: the target's lm_head is both).
        w_c = teacher.weight if weight is teacher.source else weight.detach().to(dt)
        grad_states = torch.zeros_like(states) if need_grad[0] else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if need_grad[1] else None
        total = torch.zeros((), dtype=torch.float32, device=states.device)
        draft_top1 = torch.empty_like(draft_index)
        teacher_top1 = torch.empty_like(draft_index)
        with torch.autocast(states.device.type, enabled=False):
            for start in range(0, draft_index.numel(), chunk_size):
                part = slice(start, start + chunk_size)
                di = draft_index[part]
                x = states[di].to(dt)  # [n, H]
                z = x @ w_c.T  # [n, V] compute dtype; becomes the gradient wrt z
                u, u_rows = teacher(teacher_index[part])  # [R, V], [n]
                w = token_weight[part]
                row_loss, draft_top1[part], teacher_top1[part] = fused_rows(
                    z, u, u_rows, w, objective, need_grad[0] or need_grad[1]
                )
                total += (w.to(torch.float32) * row_loss).sum()
                if need_grad[0]:  # indices are distinct within a call: plain assignment
                    grad_states[di] = (z @ w_c).to(states.dtype)
                if need_grad[1]:  # per chunk in dt (fp32 accumulation), summed in fp32
                    grad_weight += z.T @ x
        return GradsInForward.finish(ctx, need_grad, grad_states, grad_weight, weight, total,
                                     draft_top1, teacher_top1)  # fmt: skip
