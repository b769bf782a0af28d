"""The fused draft loss under Triton's interpreter against the torch path, run as a script.

``tests/test_fused_loss.py`` runs this file in a subprocess with ``TRITON_INTERPRET=1`` (the
interpreter must be chosen before the kernels are defined, and must not leak into other
tests) and asserts on what it prints: one JSON object per case, with the relative errors
(``max |fused - torch| / max |torch|``) and whether the argmaxes agree exactly.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
assert os.environ.get("TRITON_INTERPRET") == "1", "run by tests/test_fused_loss.py"

from draftsmith.drafters.dflash.blocks import block_loss  # noqa: E402
from draftsmith.drafters.losses.fused_kernels import fused_rows  # noqa: E402
from draftsmith.drafters.losses.fused_loss import FusedDraftLoss, LogitTeacher  # noqa: E402
from draftsmith.drafters.losses.loss import (  # noqa: E402
    ChunkedDraftLoss,
    Teacher,
    chunk_objective,
    objective_weights,
    ttt_loss,
)

OBJECTIVES = {"kl": (1.0, 0.0), "tv": (0.0, 1.0), "kl_tv": objective_weights("kl_tv", 0.3)}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| in float64."""
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


def kernel_cases():
    """``fused_rows`` against ``chunk_objective`` on one chunk: rows of a bigger teacher
    tensor in shuffled order, non-uniform row weights, blocks smaller than the vocabulary."""
    for n, v, block in ((5, 37, 16), (17, 300, 64)):
        for dname, dtype in DTYPES.items():
            for loss, weights in OBJECTIVES.items():
                g = torch.Generator().manual_seed(n * v)
                z = (torch.randn(n, v, generator=g) * 3).to(dtype)
                u = (torch.randn(n + 4, v, generator=g) * 3).to(dtype)
                u_rows = torch.randperm(n + 4, generator=g)[:n]
                w = torch.rand(n, generator=g) + 0.1
                p = u[u_rows].float().softmax(-1)
                ref_loss, ref_grad = chunk_objective(z.float(), p, weights, need_grad=True)
                ref_grad = ref_grad * w[:, None]
                ref_top = z.float().argmax(-1), u[u_rows].float().argmax(-1)
                buf = z.clone()
                row_loss, z_top, u_top = fused_rows(buf, u, u_rows, w, weights, True, block)
                yield {
                    "group": "kernel", "case": f"n{n}-v{v}-{dname}-{loss}", "dtype": dname,
                    "loss": rel(row_loss, ref_loss), "grad": rel(buf, ref_grad),
                    "argmax": bool(torch.equal(z_top, ref_top[0])
                                   and torch.equal(u_top, ref_top[1])),
                }  # fmt: skip


def function_cases():
    """``FusedDraftLoss`` against ``ChunkedDraftLoss`` with the same arguments: non-uniform
    token weights, a chunk size that leaves a ragged last chunk, teacher rows cached or not,
    both gradients (states, lm_head)."""
    n_rows, h, ht, v, pairs, chunk = 40, 24, 20, 300, 29, 7
    for dname, dtype in DTYPES.items():
        for loss, weights in OBJECTIVES.items():
            for cache in (0, 2**28):
                g = torch.Generator().manual_seed(7)
                states = torch.randn(n_rows, h, generator=g).to(dtype).requires_grad_(True)
                weight = (torch.randn(v, h, generator=g) * 0.3).to(dtype).requires_grad_(True)
                t_states = torch.randn(n_rows, ht, generator=g).to(dtype)
                t_weight = (torch.randn(v, ht, generator=g) * 0.5).to(dtype)
                d_idx = torch.randperm(n_rows, generator=g)[:pairs]
                t_idx = torch.randint(0, n_rows, (pairs,), generator=g)
                tok_w = torch.rand(pairs, generator=g) + 0.1
                rows = t_idx.unique()
                out = {}
                for name, fn, teacher in (
                    ("torch", ChunkedDraftLoss, Teacher(t_states, t_weight, rows, chunk, cache)),
                    ("fused", FusedDraftLoss,
                     LogitTeacher(t_states, t_weight, rows, dtype, chunk, cache)),
                ):  # fmt: skip
                    total, d_top, t_top = fn.apply(states, weight, teacher, d_idx, t_idx, tok_w,
                                                   chunk, (True, True), weights)  # fmt: skip
                    grads = torch.autograd.grad(total, [states, weight])
                    out[name] = (total, d_top, t_top, *grads)
                (a, ad, at, ags, agw), (b, bd, bt, bgs, bgw) = out["fused"], out["torch"]
                yield {
                    "group": "function", "case": f"{dname}-{loss}-cache{int(bool(cache))}",
                    "dtype": dname, "loss": rel(a.detach(), b.detach()),
                    "grad_states": rel(ags, bgs), "grad_weight": rel(agw, bgw),
                    "argmax": bool(torch.equal(ad, bd) and torch.equal(at, bt)),
                    "grad_dtypes": [str(ags.dtype), str(agw.dtype)],
                }  # fmt: skip


def caller_cases():
    """The callers with ``fused`` on and off: ``ttt_loss`` (EAGLE-3 / EAGLE-1 / MTP), DFlash's
    ``block_loss`` and P-EAGLE's ``parallel_loss``."""
    from test_loss import inputs

    for loss in OBJECTIVES:
        states, weight, teacher, tw, mask, doc = inputs()
        res = {}
        for fused in ("off", "on"):
            out = ttt_loss(states, weight, teacher, tw, mask, doc, chunk_size=7, loss=loss,
                           tv_weight=0.3, fused=fused)  # fmt: skip
            res[fused] = (out, torch.autograd.grad(out.loss, [*states, weight]))
        (a, ga), (b, gb) = res["on"], res["off"]
        yield {
            "group": "caller", "case": f"ttt_loss-{loss}", "dtype": "fp32",
            "loss": rel(a.loss.detach(), b.loss.detach()),
            "grad_states": max(rel(x, y) for x, y in zip(ga[:-1], gb[:-1], strict=True)),
            "grad_weight": rel(ga[-1], gb[-1]),
            "argmax": bool(torch.equal(a.step_accuracy, b.step_accuracy)
                           and torch.equal(a.chain_hit, b.chain_hit)),
        }  # fmt: skip
    g = torch.Generator().manual_seed(5)
    b_, a_, bs, t, h, v = 2, 3, 4, 16, 24, 300
    drafts = torch.randn(b_, a_ * bs, h, generator=g, requires_grad=True)
    lm_head = torch.randn(v, h, generator=g) * 0.4
    teacher = torch.randn(b_, t, h, generator=g)
    anchors = torch.randint(1, t - 1, (b_, a_, 1), generator=g)
    target = (anchors + torch.arange(bs)).clamp(max=t - 1)
    valid = (torch.rand(b_, a_, bs, generator=g) > 0.2) & (anchors + torch.arange(bs) < t)
    valid[:, :, 0] = False
    res = {}
    for fused in ("off", "on"):
        out, correct = block_loss(drafts, lm_head, teacher, valid, target, 4.0, 5, fused=fused)
        res[fused] = (out, correct, torch.autograd.grad(out.loss, drafts)[0])
    (a, ac, ag), (b, bc, bg) = res["on"], res["off"]
    yield {
        "group": "caller", "case": "dflash-block_loss", "dtype": "fp32",
        "loss": rel(a.loss.detach(), b.loss.detach()), "grad_states": rel(ag, bg),
        "grad_weight": 0.0, "argmax": bool(torch.equal(ac, bc)),
    }  # fmt: skip

    yield peagle_case()


def peagle_case() -> dict:
    """P-EAGLE's ``parallel_loss`` on a tiny head: loss and the head's gradients."""
    from test_peagle import tiny_head, two_docs

    from draftsmith.drafters.eagle3.options import Eagle3Options
    from draftsmith.drafters.eagle3.parallel import parallel_loss

    torch.manual_seed(0)
    head = tiny_head()
    doc_ids, position_ids, loss_mask = two_docs()
    batch = dict(
        input_ids=torch.randint(0, 290, (1, 8)),
        position_ids=position_ids,
        doc_ids=doc_ids,
        aux_states=torch.randn(1, 8, 3 * 128),
        loss_mask=loss_mask,
    )
    teacher = torch.randn(1, 8, 128)
    teacher_weight = torch.randn(300, 128) * 0.1
    anchors, keep = torch.tensor([[2, 5]]), torch.tensor([[True, True]])
    params = [p for p in head.parameters() if p.requires_grad]
    res = {}
    for fused in ("off", "on"):
        opt = Eagle3Options(
            ttt_steps=3, parallel_drafting=True, fused_loss=fused, loss_chunk_size=3
        )
        total, out = parallel_loss(head, opt, batch, teacher, teacher_weight, None, anchors, keep)
        res[fused] = (total, out, torch.autograd.grad(total, params, allow_unused=True))
    (a, ao, ag), (b, bo, bg) = res["on"], res["off"]
    pairs = [(x, y) for x, y in zip(ag, bg, strict=True) if y is not None and y.abs().max() > 0]
    assert pairs and all(x is not None for x, _ in pairs)
    return {
        "group": "caller", "case": "peagle-parallel_loss", "dtype": "fp32",
        "loss": rel(a.detach(), b.detach()), "grad_states": max(rel(x, y) for x, y in pairs),
        "grad_weight": 0.0, "argmax": bool(torch.equal(ao.chain_hit, bo.chain_hit)
                                           and torch.equal(ao.step_accuracy, bo.step_accuracy)),
    }  # fmt: skip


if __name__ == "__main__":
    torch.set_num_threads(1)
    for case in (*kernel_cases(), *function_cases(), *caller_cases()):
        print(json.dumps(case), flush=True)
