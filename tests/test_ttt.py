"""Training-time test: causality, document isolation, and efficient == dense attention."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import LargestTensor

from draftsmith.drafters.attention.layers import repeat_kv
from draftsmith.drafters.attention.ttt import (
    PrefixAttention,
    TTTAttention,
    document_causal_mask,
    masked_logsumexp,
    prefix_attention,
    shift_tokens,
    ttt_unroll,
)
from draftsmith.drafters.eagle1.head import Eagle1Head
from draftsmith.drafters.eagle3.head import Eagle3Head

H, V, K = 64, 300, 4
DIMS = dict(hidden_size=H, num_heads=4, num_kv_heads=2, head_dim=32, intermediate_size=128)


def eagle3(num_layers: int = 2) -> Eagle3Head:
    torch.manual_seed(0)
    head = Eagle3Head(**DIMS, vocab_size=V, draft_vocab_size=150, num_layers=num_layers)
    head.set_embeddings(torch.randn(V, H))
    return head


def eagle1() -> Eagle1Head:
    torch.manual_seed(0)
    head = Eagle1Head(**DIMS, vocab_size=V, num_layers=2)
    head.set_embeddings(torch.randn(V, H))
    return head


def packed_batch(width: int = 3 * H):
    """Two rows of 20 tokens: row 0 packs documents of 7, 8 and 5 tokens, row 1 is one doc."""
    torch.manual_seed(1)
    doc = torch.tensor([[0] * 7 + [1] * 8 + [2] * 5, [3] * 20])
    pos = torch.stack(
        [torch.cat([torch.arange(7), torch.arange(8), torch.arange(5)]), torch.arange(20)]
    )
    return torch.randint(1, V, (2, 20)), torch.randn(2, 20, width), pos, doc


def test_prefix_attention_matches_sdpa_and_skips_unseen_blocks() -> None:
    """Blockwise (out, lse) equal SDPA's output and the masked log-sum-exp, gradients
    included (float64 gradcheck), with documents and blocks that start mid-document."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 70, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 2, 70, 8, generator=g, dtype=torch.float64) for _ in range(2))
    k.requires_grad_(True), v.requires_grad_(True)
    doc = torch.tensor([[0] * 30 + [1] * 40, [5] * 10 + [6] * 25 + [7] * 35])
    mask = document_causal_mask(doc)
    out, lse = prefix_attention(q, k, v, mask, block=16)
    kr, vr = repeat_kv(k, 2), repeat_kv(v, 2)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, kr, vr, attn_mask=mask))
    torch.testing.assert_close(lse, masked_logsumexp(q, kr, mask))
    # Gradients on a smaller case of the same kind (gradcheck costs a forward per input
    # element): blocks of 8 over 20 tokens, documents that start inside blocks.
    small = [t.detach()[:, : t.shape[1] // 2, :20, :4].clone().requires_grad_() for t in (q, k, v)]
    small_doc = torch.tensor([[0] * 7 + [1] * 13, [5] * 3 + [6] * 9 + [7] * 8])
    small_mask = document_causal_mask(small_doc)
    assert torch.autograd.gradcheck(lambda *x: prefix_attention(*x, small_mask, 8), small)
    # The last block (queries 64..69) skips the keys no row can see: document 7 of
    # row 1 starts at 35, document 1 of row 0 at 30, so the batch skips keys 0..29.
    assert list(PrefixAttention._blocks(mask[1:], 16))[-1] == (64, 70, 35)
    assert list(PrefixAttention._blocks(mask, 16))[-1] == (64, 70, 30)


def test_shift_tokens_and_mask() -> None:
    ids = torch.tensor([[10, 11, 12, 13, 14]])
    doc = torch.tensor([[0, 0, 0, 1, 1]])
    assert shift_tokens(ids, doc, 1).tolist() == [[11, 12, 0, 14, 0]]
    assert shift_tokens(ids, doc, 2, pad_id=7).tolist() == [[12, 7, 7, 7, 7]]
    mask = document_causal_mask(doc)[0, 0].int()
    assert mask.tolist() == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],
        [0, 0, 0, 1, 0],
        [0, 0, 0, 1, 1],
    ]


def test_masked_logsumexp_blocks_and_grad() -> None:
    torch.manual_seed(0)
    q = torch.randn(2, 3, 10, 8, requires_grad=True)
    k = torch.randn(2, 3, 10, 8, requires_grad=True)
    mask = document_causal_mask(torch.tensor([[0] * 4 + [1] * 6, [2] * 10]))
    lse = masked_logsumexp(q, k, mask, block=3)
    scores = (q @ k.transpose(-1, -2)) / 8**0.5
    ref = scores.masked_fill(~mask, float("-inf")).logsumexp(-1)
    torch.testing.assert_close(lse, ref)
    g = torch.randn_like(lse)
    gq, gk = torch.autograd.grad((lse * g).sum(), (q, k))
    rq, rk = torch.autograd.grad((ref * g).sum(), (q, k))
    torch.testing.assert_close(gq, rq)
    torch.testing.assert_close(gk, rk)


@pytest.mark.parametrize("make_head", [eagle3, eagle1])
def test_efficient_matches_dense_outputs_and_grads(make_head) -> None:
    head = make_head().double()  # float64: the two paths agree to rounding, tightly
    ids, hs, pos, doc = packed_batch(3 * H if isinstance(head, Eagle3Head) else H)
    hs = hs.double().requires_grad_(True)
    results = []
    for impl in ("dense", "efficient", "blockwise"):
        head.zero_grad()
        states = ttt_unroll(head, ids, hs, pos, doc, K, impl=impl)
        weights = torch.randn(
            K, *states[0].shape, generator=torch.Generator().manual_seed(2)
        ).double()
        loss = sum((s * w).sum() for s, w in zip(states, weights, strict=True))
        (g_hs,) = torch.autograd.grad(loss, hs, retain_graph=True)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in head.named_parameters() if p.grad is not None}
        results.append((states, g_hs, grads))
    (dense, g_dense, gp_dense), *others = results
    for eff, g_eff, gp_eff in others:
        assert len(eff) == K
        for a, b in zip(dense, eff, strict=True):
            torch.testing.assert_close(a, b)
        torch.testing.assert_close(g_dense, g_eff)
        assert set(gp_dense) == set(gp_eff)
        assert "fc.weight" in gp_eff or isinstance(head, Eagle1Head)
        for name in gp_dense:
            torch.testing.assert_close(gp_dense[name], gp_eff[name], msg=name)
    # The later steps differ from step 0 (the feedback state and diagonal keys are in use).
    assert not torch.allclose(eff[0], eff[1])


@pytest.mark.parametrize("impl", ["dense", "efficient", "blockwise"])
def test_no_step_sees_the_future(impl: str) -> None:
    """Step k of stream t reads states h_<=t and tokens x_<=t+k+1, nothing later."""
    head = eagle3()
    ids, hs, pos, _ = packed_batch()
    ids, hs, pos = ids[1:], hs[1:], pos[1:]
    doc = torch.zeros_like(ids)
    with torch.no_grad():
        base = ttt_unroll(head, ids, hs, pos, doc, K, impl=impl)
        for p in (3, 9, 15):
            ids2 = ids.clone()
            ids2[0, p] = (ids2[0, p] + 1) % V
            hs2 = hs.clone()
            hs2[0, p] += 1.0
            tok = ttt_unroll(head, ids2, hs, pos, doc, K, impl=impl)
            st = ttt_unroll(head, ids, hs2, pos, doc, K, impl=impl)
            for k in range(K):
                first_token_reader = max(p - k - 1, 0)  # stream t reads x_{t+k+1} at step k
                torch.testing.assert_close(
                    tok[k][0, :first_token_reader], base[k][0, :first_token_reader]
                )
                assert not torch.allclose(
                    tok[k][0, first_token_reader], base[k][0, first_token_reader]
                )
                torch.testing.assert_close(st[k][0, :p], base[k][0, :p])
                assert not torch.allclose(st[k][0, p], base[k][0, p])


@pytest.mark.parametrize("impl", ["dense", "efficient", "blockwise"])
def test_documents_are_isolated(impl: str) -> None:
    head = eagle3()
    ids, hs, pos, doc = packed_batch()
    with torch.no_grad():
        base = ttt_unroll(head, ids, hs, pos, doc, K, impl=impl)
        ids2, hs2 = ids.clone(), hs.clone()
        middle = doc[0] == 1
        ids2[0, middle] = (ids2[0, middle] + 5) % V
        hs2[0, middle] = torch.randn_like(hs2[0, middle])
        other = ttt_unroll(head, ids2, hs2, pos, doc, K, impl=impl)
        for k in range(K):
            torch.testing.assert_close(other[k][0, ~middle], base[k][0, ~middle])
            torch.testing.assert_close(other[k][1], base[k][1])
            assert not torch.allclose(other[k][0, middle], base[k][0, middle])
            # Each packed document equals the same document run on its own.
            for d in (0, 1, 2):
                sel = doc[0] == d
                alone = ttt_unroll(
                    head,
                    ids[:, sel][:1],
                    hs[:, sel][:1],
                    pos[:, sel][:1],
                    doc[:, sel][:1],
                    K,
                    impl=impl,
                )
                torch.testing.assert_close(alone[k][0], base[k][0, sel], atol=1e-5, rtol=1e-4)


def _largest_at_step(impl: str, step: int, t: int = 64) -> int:
    torch.manual_seed(0)
    attend = TTTAttention(document_causal_mask(torch.zeros(1, t, dtype=torch.long)), impl)
    q, kv = torch.randn(1, 4, t, 32), [torch.randn(1, 2, t, 32) for _ in range(step + 1)]
    for j in range(step):
        attend.step = j
        attend(0, q, kv[j], kv[j])
    attend.step = step
    with LargestTensor() as mode:
        attend(0, q, kv[step], kv[step])
    return mode.largest


def test_efficient_memory_does_not_grow_with_steps() -> None:
    assert _largest_at_step("efficient", 6) == _largest_at_step("efficient", 2)
    assert _largest_at_step("blockwise", 6) == _largest_at_step("blockwise", 2)
    assert _largest_at_step("dense", 6) > _largest_at_step("dense", 2)
    assert _largest_at_step("efficient", 6) < _largest_at_step("dense", 6)
