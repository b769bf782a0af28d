"""Chunked draft loss (soft cross-entropy, TV, their blend): exactness, bounded memory,
masks, accuracy, acceptance."""

from __future__ import annotations

import pytest
import torch
from helpers import LargestTensor

from draftsmith.drafters.losses.acceptance import simulated_acceptance_length, step_validity
from draftsmith.drafters.losses.loss import (
    chunk_objective,
    objective_weights,
    teacher_argmax,
    ttt_loss,
)

B, T, H, HT, VD, K = 2, 32, 48, 40, 300, 3


def inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    states = [torch.randn(B, T, H, generator=g, requires_grad=True) for _ in range(K)]
    weight = torch.randn(VD, H, generator=g).mul(0.3).requires_grad_(True)
    teacher = torch.randn(B, T, HT, generator=g)
    teacher_weight = torch.randn(VD, HT, generator=g) * 0.5
    loss_mask = torch.rand(B, T, generator=g) > 0.3
    doc = torch.tensor([[0] * 12 + [1] * 20, [2] * 32])
    return states, weight, teacher, teacher_weight, loss_mask, doc


def dense_objective(logits, p, loss="kl", tv_weight=0.5):
    """The per-token objective on full logits [..., V], differentiated by autograd."""
    ce = -(p * logits.log_softmax(-1)).sum(-1)
    tv = 0.5 * (logits.softmax(-1) - p).abs().sum(-1)
    return {"kl": ce, "tv": tv, "kl_tv": (1 - tv_weight) * ce + tv_weight * tv}[loss]


def reference_loss(
    states, weight, teacher, teacher_weight, loss_mask, doc, decay=0.8, loss="kl", tv_weight=0.5
):
    """Plain full-logits implementation of the documented alignment (stream t, step k:
    draft states[k][t] vs teacher row t+k+1, label x_{t+k+2})."""
    total = 0.0
    for k, s in enumerate(states):
        n = T - k - 2
        logits = s[:, :n] @ weight.T  # [B, n, V]
        p = (teacher[:, k + 1 : k + 1 + n] @ teacher_weight.T).softmax(-1)
        per_token = dense_objective(logits, p, loss, tv_weight)  # [B, n]
        valid = loss_mask[:, k + 2 :] & (doc[:, k + 2 :] == doc[:, :n])
        total = total + decay**k * (per_token * valid).sum() / valid.sum()
    return total


@pytest.mark.parametrize("loss", ["kl", "tv", "kl_tv"])
@pytest.mark.parametrize("teacher_cache", [0, 2**28])
@pytest.mark.parametrize("chunk_size", [7, 64, 10_000])
def test_chunked_matches_reference_loss_and_grads(
    chunk_size: int, teacher_cache: int, loss: str
) -> None:
    """Same loss and gradients as autograd on full logits, for every objective, with the
    teacher computed once per batch or per step."""
    states, weight, teacher, tw, mask, doc = inputs()
    out = ttt_loss(
        states, weight, teacher, tw, mask, doc, chunk_size=chunk_size,
        teacher_cache=teacher_cache, loss=loss, tv_weight=0.3,
    )  # fmt: skip
    grads = torch.autograd.grad(out.loss, [*states, weight])
    ref = reference_loss(states, weight, teacher, tw, mask, doc, loss=loss, tv_weight=0.3)
    ref_grads = torch.autograd.grad(ref, [*states, weight])
    torch.testing.assert_close(out.loss, ref)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r)
    decay = torch.tensor([0.8**k for k in range(K)])
    torch.testing.assert_close(out.loss.detach(), (decay * out.step_loss).sum())


def test_tv_gradient_formula_and_kl_unchanged() -> None:
    """The closed-form TV gradient is autograd's; ``kl`` is still the plain soft CE."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 11, generator=g, dtype=torch.float64, requires_grad=True)
    p = torch.randn(5, 11, generator=g, dtype=torch.float64).softmax(-1)
    for loss, weights in (("tv", (0.0, 1.0)), ("kl_tv", (0.75, 0.25)), ("kl", (1.0, 0.0))):
        assert objective_weights(loss, 0.25) == weights
        value, grad = chunk_objective(logits.detach(), p, weights, need_grad=True)
        ref = dense_objective(logits, p, loss, 0.25)
        (ref_grad,) = torch.autograd.grad(ref.sum(), logits)
        torch.testing.assert_close(value, ref.detach())
        torch.testing.assert_close(grad, ref_grad)
    # kl, explicit or default, is bit for bit the loss and gradient this module always had.
    states, weight, teacher, tw, mask, doc = inputs()
    default, kl = (
        ttt_loss(states, weight, teacher, tw, mask, doc, **kw) for kw in ({}, {"loss": "kl"})
    )
    assert torch.equal(default.loss, kl.loss)
    for a, b in zip(
        torch.autograd.grad(default.loss, states), torch.autograd.grad(kl.loss, states), strict=True
    ):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="model.loss: 'ce' is not one of"):
        objective_weights("ce")
    with pytest.raises(ValueError, match="model.tv_weight: 1.5"):
        objective_weights("kl_tv", 1.5)


def test_tv_is_zero_for_a_copy_and_at_most_one() -> None:
    states, weight, teacher, tw, mask, doc = inputs()
    with torch.no_grad():
        out = ttt_loss(states, weight, teacher, tw, mask, doc, loss="tv")
        assert ((out.step_loss > 0) & (out.step_loss <= 1)).all()
        copy = [torch.roll(teacher, -(k + 1), dims=1) for k in range(K)]
        perfect = ttt_loss(copy, tw, teacher, tw, mask, doc, loss="tv")
        torch.testing.assert_close(perfect.step_loss, torch.zeros(K), atol=1e-6, rtol=0)


def test_frozen_lm_head_gets_no_gradient() -> None:
    states, weight, teacher, tw, mask, doc = inputs()
    frozen = weight.detach()
    out = ttt_loss(states, frozen, teacher, tw, mask, doc)
    ref = reference_loss(states, frozen, teacher, tw, mask, doc)
    grads = torch.autograd.grad(out.loss, states), torch.autograd.grad(ref, states)
    for g, r in zip(*grads, strict=True):
        torch.testing.assert_close(g, r)
    assert frozen.grad is None


def test_mask_and_documents_are_respected() -> None:
    states, weight, teacher, tw, mask, doc = inputs()
    out = ttt_loss(states, weight, teacher, tw, mask, doc)
    grads = torch.autograd.grad(out.loss, states)
    for k in range(K):
        valid = step_validity(mask, doc, k)
        assert int(out.step_count[k]) == int(valid.sum()) > 0
        assert (grads[k][~valid] == 0).all() and (grads[k][valid] != 0).any()
        # The last stream of document 0 would predict a token of document 1: excluded.
        assert not valid[0, 11 - k - 1]
    # Streams without a valid target do not move the loss.
    with torch.no_grad():
        states2 = [s.clone() for s in states]
        invalid = ~step_validity(mask, doc, 0)
        states2[0][invalid] = torch.randn_like(states2[0][invalid])
        again = ttt_loss(states2, weight, teacher, tw, mask, doc)
    torch.testing.assert_close(again.loss, out.loss.detach())


def _peak(chunk_size: int, rows: int, loss: str = "kl") -> tuple[int, int]:
    """(largest tensor numel, numel saved for backward) of a loss forward + backward."""
    g = torch.Generator().manual_seed(0)
    states = [torch.randn(1, rows, H, generator=g, requires_grad=True)]
    weight = torch.randn(VD, H, generator=g, requires_grad=True)
    teacher, tw = torch.randn(1, rows, HT, generator=g), torch.randn(VD, HT, generator=g)
    mask, doc = torch.ones(1, rows, dtype=torch.bool), torch.zeros(1, rows, dtype=torch.long)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(
        lambda t: saved.append(t.numel()) or t, lambda t: t
    ):
        with LargestTensor() as mode:
            out = ttt_loss(
                states, weight, teacher, tw, mask, doc, chunk_size=chunk_size,
                teacher_cache=0, loss=loss,
            )  # fmt: skip
            out.loss.backward()
    return mode.largest, sum(saved)


@pytest.mark.parametrize("loss", ["kl", "kl_tv"])
def test_peak_memory_is_bounded_by_the_chunk(loss: str) -> None:
    """No tensor of tokens x vocab is ever built, nor kept for backward, when chunking."""
    rows, chunk = 256, 16
    largest, saved = _peak(chunk, rows, loss)
    largest_2x, saved_2x = _peak(chunk, 2 * rows, loss)
    # Largest tensors: the weights, [tokens, hidden] inputs/grads, one [chunk, vocab] block.
    for n, big in ((rows, largest), (2 * rows, largest_2x)):
        assert big == max(VD * H, VD * HT, n * H, chunk * VD) < n * VD / 2
    assert saved <= rows * H + VD * H  # only the gradient buffers
    assert saved_2x - saved == rows * H  # grows with tokens x hidden, never x vocab
    unchunked, _ = _peak(10_000, rows)
    assert unchunked >= (rows - 2) * VD  # the same loss without chunks does build it


def test_accuracy_and_full_vocab_teacher() -> None:
    states, weight, teacher, tw, mask, doc = inputs()
    with torch.no_grad():
        out = ttt_loss(states, weight, teacher, tw, mask, doc)
        for k in range(K):
            valid = step_validity(mask, doc, k)
            draft = (states[k] @ weight.T).argmax(-1)  # [B, T]
            target = torch.roll(teacher @ tw.T, -(k + 1), dims=1).argmax(-1)  # row t+k+1
            expected = (draft == target)[valid].float().mean()
            torch.testing.assert_close(out.step_accuracy[k], expected)
        # Full-vocab teacher argmax: target ids outside the draft vocab can never match.
        full_head = torch.cat([tw, torch.zeros(1, HT)])  # target vocab = draft vocab + 1 id
        full_head[-1] = teacher.reshape(-1, HT).mean(0) * 50  # this id wins often
        t2d = torch.cat([torch.arange(VD), torch.tensor([-1])])
        top1 = teacher_argmax(teacher, full_head, t2d, chunk_size=5)
        assert (top1 == -1).any() and (top1 >= 0).any()
        assert torch.equal(top1 >= 0, (teacher @ full_head.T).argmax(-1) < VD)
        out2 = ttt_loss(states, weight, teacher, tw, mask, doc, teacher_top1=top1)
        assert (out2.step_accuracy <= out.step_accuracy + 1e-6).all()
        # A draft that copies the teacher (same states and weights) is always right.
        copy = [torch.roll(teacher, -(k + 1), dims=1) for k in range(K)]
        perfect = ttt_loss(copy, tw, teacher, tw, mask, doc)
        assert (perfect.step_accuracy == 1).all()
        assert perfect.acceptance_length.item() == pytest.approx(1 + K)


def test_simulated_acceptance_hand_built() -> None:
    # Four streams, three drafts. Accepted prefixes: 3, 1, 0, 2 -> mean 1.5 -> tau 2.5.
    correct = torch.tensor([[1, 1, 0, 1], [1, 0, 1, 1], [1, 1, 1, 0]], dtype=torch.bool)
    valid = torch.ones_like(correct)
    # acc_0 = 3/4; acc_1 = 2/3 (streams 0, 1, 3 alive); acc_2 = 1/2 (streams 0, 3 alive)
    assert simulated_acceptance_length(correct, valid).item() == pytest.approx(2.5)
    valid[2, 3] = False  # stream 3 has no third target: acc_2 = 1/1 over stream 0 alone
    assert simulated_acceptance_length(correct, valid).item() == pytest.approx(1 + 0.75 + 0.5 + 0.5)
    assert simulated_acceptance_length(torch.zeros_like(correct), valid).item() == 1.0
    assert simulated_acceptance_length(torch.ones_like(correct), valid).item() == 4.0
