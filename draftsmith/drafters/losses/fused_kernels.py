"""Triton kernels of the fused draft loss (``fused_loss.py``): one program per token row.

Given a chunk's draft logits ``z`` [n, V] and the teacher's logits ``u`` (rows ``u_rows`` [n]
of a [R, V] tensor), both in the compute dtype (bf16 on a GPU), with ``d = softmax(z)`` and
``t = softmax(u)``:

- ``_row_stats`` (pass 1): per row the log-sum-exps of ``z`` and ``u`` by online softmax
  (running maximum and rescaled running sum, in fp32 registers) and both argmaxes (the first
  index of the maximum, as ``torch.argmax``).
- ``_loss_grad`` (pass 2): per row ``ce_w * -sum_v t_v log d_v + tv_w * 0.5 * sum_v |d_v -
  t_v|`` and, when asked, the gradient of ``w_row`` times that wrt ``z``, written over ``z``
  in place (``chunk_objective`` in ``loss.py`` states the formulas). TV's gradient is
  normalised by ``sum_v d_v sign(d_v - t_v)``, known only after a whole row, so a TV
  objective reads the row once more before writing.

Nothing [n, V] is allocated here: per row the kernels keep a few fp32 scalars.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _row_stats(z_ptr, u_ptr, u_rows_ptr, stats_ptr, z_top_ptr, u_top_ptr, V, z_stride,
               u_stride, BLOCK: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    z_row = z_ptr + row * z_stride
    u_row = u_ptr + tl.load(u_rows_ptr + row) * u_stride
    z_max = tl.full([], float("-inf"), tl.float32)
    u_max = tl.full([], float("-inf"), tl.float32)
    z_sum = tl.full([], 0.0, tl.float32)
    u_sum = tl.full([], 0.0, tl.float32)
    z_top = tl.full([], 0, tl.int32)
    u_top = tl.full([], 0, tl.int32)
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        inside = offs < V
        z = tl.load(z_row + offs, mask=inside, other=float("-inf")).to(tl.float32)
        u = tl.load(u_row + offs, mask=inside, other=float("-inf")).to(tl.float32)
        zb, ub = tl.max(z, 0), tl.max(u, 0)
        # Strictly greater: an equal maximum in a later block keeps the earlier index.
        z_top = tl.where(zb > z_max, tl.argmax(z, 0) + start, z_top)
        u_top = tl.where(ub > u_max, tl.argmax(u, 0) + start, u_top)
        z_new, u_new = tl.maximum(z_max, zb), tl.maximum(u_max, ub)
        z_sum = z_sum * tl.exp(z_max - z_new) + tl.sum(tl.exp(z - z_new), 0)
        u_sum = u_sum * tl.exp(u_max - u_new) + tl.sum(tl.exp(u - u_new), 0)
        z_max, u_max = z_new, u_new
    tl.store(stats_ptr + 2 * row, z_max + tl.log(z_sum))
    tl.store(stats_ptr + 2 * row + 1, u_max + tl.log(u_sum))
    tl.store(z_top_ptr + row, z_top.to(tl.int64))
    tl.store(u_top_ptr + row, u_top.to(tl.int64))


@triton.jit
def _probs(z_row, u_row, offs, inside, z_lse, u_lse):
    """(d, t) over one block, 0 outside the row."""
    z = tl.load(z_row + offs, mask=inside, other=0.0).to(tl.float32)
    u = tl.load(u_row + offs, mask=inside, other=0.0).to(tl.float32)
    d = tl.where(inside, tl.exp(z - z_lse), 0.0)
    t = tl.where(inside, tl.exp(u - u_lse), 0.0)
    return z, d, t


@triton.jit
def _sign(x):
    return tl.where(x > 0, 1.0, tl.where(x < 0, -1.0, 0.0))


@triton.jit
def _loss_grad(z_ptr, u_ptr, u_rows_ptr, stats_ptr, w_ptr, loss_ptr, V, z_stride, u_stride,
               ce_w, tv_w, HAS_TV: tl.constexpr, NEED_GRAD: tl.constexpr,
               BLOCK: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    z_row = z_ptr + row * z_stride
    u_row = u_ptr + tl.load(u_rows_ptr + row) * u_stride
    z_lse = tl.load(stats_ptr + 2 * row)
    u_lse = tl.load(stats_ptr + 2 * row + 1)
    scale = tl.load(w_ptr + row)  # the row's token weight, folded into the gradient
    ce = tl.full([], 0.0, tl.float32)
    tv = tl.full([], 0.0, tl.float32)
    ds = tl.full([], 0.0, tl.float32)  # sum_v d_v sign(d_v - t_v)
    if HAS_TV:
        for start in range(0, V, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            _, d, t = _probs(z_row, u_row, offs, offs < V, z_lse, u_lse)
            tv += tl.sum(tl.abs(d - t), 0)
            ds += tl.sum(d * _sign(d - t), 0)
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        inside = offs < V
        z, d, t = _probs(z_row, u_row, offs, inside, z_lse, u_lse)
        ce += tl.sum(tl.where(inside, -t * (z - z_lse), 0.0), 0)
        if NEED_GRAD:
            g = ce_w * (d - t)
            if HAS_TV:
                g += 0.5 * tv_w * d * (_sign(d - t) - ds)
            tl.store(z_row + offs, (scale * g).to(z_ptr.dtype.element_ty), mask=inside)
    tl.store(loss_ptr + row, ce_w * ce + tv_w * 0.5 * tv)


def fused_rows(
    z: Tensor,
    u: Tensor,
    u_rows: Tensor,
    row_weight: Tensor,
    objective: tuple[float, float],
    need_grad: bool,
    block: int | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-row loss [n] float32, draft argmax [n] and teacher argmax [n] (long).

    z [n, V] draft logits (contiguous; overwritten by ``row_weight`` [n] times the gradient
    wrt z when ``need_grad``), u [R, V] teacher logits whose row ``u_rows[i]`` is row i's
    teacher, objective (cross-entropy weight, TV weight) from ``objective_weights``. ``block``:
    vocabulary entries per step of a program (a power of two; default min(V, 4096) rounded up).
    """
    n, v = z.shape
    loss = torch.empty(n, dtype=torch.float32, device=z.device)
    tops = torch.empty(2, n, dtype=torch.long, device=z.device)
    if n == 0:
        return loss, tops[0], tops[1]
    block = block or min(triton.next_power_of_2(v), 4096)
    stats = torch.empty(n, 2, dtype=torch.float32, device=z.device)
    rows = u_rows.to(torch.long).contiguous()
    _row_stats[(n,)](z, u, rows, stats, tops[0], tops[1], v, z.stride(0), u.stride(0),
                     BLOCK=block, num_warps=8)  # fmt: skip
    ce_w, tv_w = objective
    weight = row_weight.to(torch.float32).contiguous()
    _loss_grad[(n,)](z, u, rows, stats, weight, loss, v, z.stride(0), u.stride(0), float(ce_w),
                     float(tv_w), HAS_TV=bool(tv_w), NEED_GRAD=need_grad, BLOCK=block,
                     num_warps=8)  # fmt: skip
    return loss, tops[0], tops[1]
