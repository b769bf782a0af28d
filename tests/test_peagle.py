"""P-EAGLE (parallel-drafting EAGLE-3): the mask by hand, the one-pass forward against running
each block alone as vLLM does, and the export. A tiny head trained and served in vLLM with
``parallel_drafting`` through ``draftsmith pipeline``: ``test_kinds.py``."""

from __future__ import annotations

import pytest
import torch

from draftsmith.drafters import head_config, head_tensors
from draftsmith.drafters.attention.layers import sdpa_attend
from draftsmith.drafters.attention.ttt import shift_tokens
from draftsmith.drafters.eagle3.head import Eagle3Head
from draftsmith.drafters.eagle3.parallel import parallel_forward, parallel_mask, parallel_targets


def two_docs():
    """One packed row of 8: doc 0 = positions 0..4 (prompt 0..1), doc 1 = 5..7 (prompt 5)."""
    doc_ids = torch.tensor([[0, 0, 0, 0, 0, 1, 1, 1]])
    position_ids = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2]])
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 0, 1, 1]], dtype=torch.bool)
    return doc_ids, position_ids, loss_mask


def tiny_head(**kw) -> Eagle3Head:
    options = dict(hidden_size=128, num_heads=2, num_kv_heads=1, head_dim=64,
                   intermediate_size=256, vocab_size=300, draft_vocab_size=300,
                   num_aux_states=3, parallel_drafting=True, mask_token_id=299)  # fmt: skip
    return Eagle3Head(**{**options, **kw})


def test_parallel_mask_and_targets_by_hand():
    doc_ids, _, loss_mask = two_docs()
    anchors, keep = torch.tensor([[1, 5]]), torch.tensor([[True, True]])
    mask = parallel_mask(anchors, keep, doc_ids, num_masks=2)[0, 0].int()  # [8 + 4, 8 + 4]
    # Real slots: causal inside their document, blind to every mask slot.
    assert mask[4, :].tolist() == [1, 1, 1, 1, 1, 0, 0, 0] + [0] * 4
    assert mask[6, :].tolist() == [0, 0, 0, 0, 0, 1, 1, 0] + [0] * 4
    # Block at anchor 1: real slots 0..1 of doc 0, then its own slots causally.
    assert mask[8, :].tolist() == [1, 1, 0, 0, 0, 0, 0, 0] + [1, 0, 0, 0]
    assert mask[9, :].tolist() == [1, 1, 0, 0, 0, 0, 0, 0] + [1, 1, 0, 0]
    # Block at anchor 5: doc 1 up to position 5 only; never block 0.
    assert mask[11, :].tolist() == [0, 0, 0, 0, 0, 1, 0, 0] + [0, 0, 1, 1]
    valid, pos = parallel_targets(anchors, keep, loss_mask, doc_ids, num_drafts=3)
    # Anchor 1 drafts x3, x4 (response) and x5 (doc 1): the last is not its target.
    assert pos[0, 0].tolist() == [3, 4, 5] and valid[0, 0].tolist() == [True, True, False]
    # Anchor 5 drafts x7; x8, x9 lie past the row.
    assert valid[0, 1].tolist() == [True, False, False]
    dropped = parallel_targets(anchors, torch.tensor([[False, True]]), loss_mask, doc_ids, 3)[0]
    assert not dropped[0, 0].any()


def test_one_pass_equals_each_block_alone():
    """Packing every block into one pass changes nothing: each block's drafts equal a pass
    over its document's real slots up to the anchor followed by its mask slots, causal (what
    vLLM's draft KV cache holds), and the real slots equal a plain EAGLE-3 step."""
    torch.manual_seed(0)
    head = tiny_head().eval()
    doc_ids, position_ids, loss_mask = two_docs()
    input_ids = torch.randint(0, 290, (1, 8))
    aux = torch.randn(1, 8, 3 * 128)
    batch = dict(input_ids=input_ids, position_ids=position_ids, doc_ids=doc_ids, aux_states=aux)
    anchors, keep = torch.tensor([[2, 6]]), torch.tensor([[True, True]])
    with torch.no_grad():
        out = parallel_forward(head, batch, anchors, keep, num_drafts=3)  # [1, 8 + 4, H]
        shifted = shift_tokens(input_ids, doc_ids, 1)
        for j, (a, start) in enumerate([(2, 0), (6, 5)]):
            ids = torch.cat([shifted[:, start : a + 1], torch.tensor([[299, 299]])], dim=1)
            hidden = torch.cat(
                [
                    head.combine_hidden_states(aux[:, start : a + 1]),
                    head.combine_hidden_states(head.mask_hidden[None, None]).expand(1, 2, -1),
                ],
                dim=1,
            )
            pos = torch.arange(a - start + 3)[None]
            alone = head(ids, hidden, pos, sdpa_attend())[0]  # causal
            torch.testing.assert_close(out[:, 8 + 2 * j : 10 + 2 * j], alone[:, -2:])
            torch.testing.assert_close(out[:, start : a + 1], alone[:, : a - start + 1])


def test_export_writes_vllms_peagle_format():
    head = tiny_head()
    target = {"architectures": ["LlamaForCausalLM"], "hidden_size": 128, "vocab_size": 300,
              "num_hidden_layers": 6, "num_attention_heads": 2}  # fmt: skip
    config = head_config(head, "eagle3", target, [1, 3, 5], 3, "tiny")
    assert config["architectures"] == ["Eagle3LlamaForCausalLM"]  # vLLM's class for both
    assert config["mask_token_id"] == 299
    assert config["speculators_model_type"] == "peagle"
    tensors = head_tensors(head, "eagle3", torch.float32)
    assert tensors["mask_hidden"].shape == (1, 3 * 128)
    plain = head_config(tiny_head(parallel_drafting=False), "eagle3", target, [1, 3, 5], 3, "t")
    assert plain["speculators_model_type"] == "eagle3" and "mask_token_id" not in plain
    with pytest.raises(Exception, match="mask_token_id"):
        tiny_head(mask_token_id=None)


def test_parallel_drafting_needs_eagle3():
    from draftsmith.core.errors import ConfigError
    from draftsmith.train.module import DraftModule

    with pytest.raises(ConfigError, match="model.parallel_drafting"):
        DraftModule(kind="dflash", parallel_drafting=True)
    with pytest.raises(ConfigError, match="model.loss_vocab_size"):  # DFlash's option only
        DraftModule(kind="eagle3", loss_vocab_size=1024)
