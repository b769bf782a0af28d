"""Sliding-window heads: the masks by hand (vLLM's convention: a window of w holds the query's
own position and the w - 1 before it; a TTT step k query sits k positions after its stream's
token; a DFlash block sees w - 1 either side), every attention path equal under a window, the
exported fields vLLM reads, and the line when vLLM would serve a head without its window."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import flex_attention as torch_flex

from draftsmith import drafters
from draftsmith.core.errors import ConfigError
from draftsmith.drafters.attention.block_layout import block_mask
from draftsmith.drafters.attention.blockwise import prefix_attention
from draftsmith.drafters.attention.masks import RowMask
from draftsmith.drafters.attention.ttt import document_causal_mask, ttt_unroll
from draftsmith.drafters.attention.ttt_flex import ttt_block_mask
from draftsmith.drafters.dflash.export import dflash_config
from draftsmith.drafters.dflash.model import DFlashDrafter
from draftsmith.drafters.eagle3.export import eagle3_config
from draftsmith.drafters.eagle3.head import Eagle3Head
from draftsmith.drafters.eagle3.parallel import parallel_forward, parallel_mask
from draftsmith.drafters.eagle3.parallel_mask import ParallelMask
from draftsmith.drafters.headfiles.windows import window_note

H, V = 64, 200
DOC = torch.tensor([[0] * 6 + [1] * 3])  # documents of 6 and 3 tokens


def grid(rows: list[str]) -> list[list[int]]:
    return [[int(c) for c in row] for row in rows]


def test_row_mask_by_hand() -> None:
    """Window 3: each query sees itself and the 2 before it in its document; at TTT step 1
    a query sits one position later, so it sees its own token and the one before."""
    step0 = grid(["100000000", "110000000", "111000000", "011100000", "001110000",
                  "000111000", "000000100", "000000110", "000000111"])  # fmt: skip
    step1 = grid(["100000000", "110000000", "011000000", "001100000", "000110000",
                  "000011000", "000000100", "000000110", "000000011"])  # fmt: skip
    mask = RowMask(DOC, window=3)
    assert mask.dense()[0, 0].int().tolist() == step0
    assert mask.at_step(1).dense()[0, 0].int().tolist() == step1
    assert torch.equal(mask.dense(), document_causal_mask(DOC, 3))
    assert torch.equal(RowMask(DOC).dense(), document_causal_mask(DOC))
    # Blocks of 4 queries skip the keys none of them sees: block 4..7 starts at key 2.
    assert list(mask.spans(4)) == [(0, 4, 0), (4, 8, 2), (8, 9, 6)]
    assert torch.equal(mask.block(4, 8, 2), mask.dense()[:, :, 4:8, 2:8])


def test_blockwise_attention_with_a_window_equals_sdpa() -> None:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 9, 8, generator=g, dtype=torch.float64) for _ in range(3))
    mask = RowMask(DOC, window=3).at_step(1)
    out, _ = prefix_attention(q, k, v, mask, block=4)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask.dense())
    torch.testing.assert_close(out, ref)


def test_flex_mask_with_a_window_by_hand() -> None:
    """Step 2 over (step 0, 1, 2) keys: the step-0 window ends 2 earlier; the step-1 key of a
    stream is 1 position behind (seen at window 3), the step-2 key is the query's own."""
    mod = torch_flex.create_mask(ttt_block_mask(DOC, 2, window=3).mask_mod, 1, 1, 9, 27, "cpu")
    eye = torch.eye(9, dtype=torch.bool)
    want = torch.cat([RowMask(DOC, 3).at_step(2).dense()[0, 0], eye, eye], dim=-1)
    assert torch.equal(mod[0, 0], want)
    narrow = torch_flex.create_mask(ttt_block_mask(DOC, 2, 1).mask_mod, 1, 1, 9, 27, "cpu")
    assert not narrow[0, 0, :, 9:18].any()  # window 1: the step-1 key of step 2 is out
    assert torch.equal(narrow[0, 0, :, 18:], eye)


def windowed_head() -> Eagle3Head:
    torch.manual_seed(0)
    head = Eagle3Head(hidden_size=H, num_heads=4, num_kv_heads=2, head_dim=16,
                      intermediate_size=96, vocab_size=V, num_layers=2, qk_norm=True,
                      sliding_window=4).double()  # fmt: skip
    head.set_embeddings(torch.randn(V, H))
    return head


def test_every_ttt_path_agrees_under_a_window_and_the_window_matters() -> None:
    head = windowed_head()
    doc = torch.tensor([[0] * 11 + [1] * 9])
    pos = torch.cat([torch.arange(11), torch.arange(9)])[None]
    ids = torch.randint(1, V, (1, 20), generator=torch.Generator().manual_seed(1))
    hs = torch.randn(1, 20, 3 * H, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    outs = {
        impl: torch.stack(ttt_unroll(head, ids, hs, pos, doc, 3, impl, window=4))
        for impl in ("dense", "efficient", "blockwise")
    }
    for impl in ("efficient", "blockwise"):
        torch.testing.assert_close(outs[impl], outs["dense"], msg=impl)
    full = torch.stack(ttt_unroll(head, ids, hs, pos, doc, 3, "blockwise"))
    # Stream 2's step 0 sees 3 keys either way; stream 9's step 0 sees 4 of its 10.
    torch.testing.assert_close(full[0, :, 2], outs["dense"][0, :, 2])
    assert (full[0, :, 9] - outs["dense"][0, :, 9]).abs().max() > 1e-3


def test_block_masks_by_hand() -> None:
    """DFlash, window 3, blocks of 2 at anchors 4 and 7 (document 1 starts at 6): slot i at
    a + i sees its document's context keys a + i - 2 .. a - 1 and both slots; P-EAGLE,
    window 3, 2 mask slots at anchor 4 (positions 5, 6): real key 4 and, for the first slot,
    3; the slots causally."""
    anchors, keep = torch.tensor([[4, 7]]), torch.tensor([[True, True]])
    mask = block_mask(anchors, keep, DOC, 2, window=3)[0, 0].int().tolist()
    assert mask == grid(["0011000001100", "0001000001100", "0000001000011", "0000001000011"])
    full = block_mask(anchors, keep, DOC, 2)[0, 0]
    assert full[0, :4].all() and full[2, 6] and not full[2, 5]
    peagle = parallel_mask(torch.tensor([[4]]), torch.tensor([[True]]), DOC, 2, window=3)
    assert peagle[0, 0, 9:].int().tolist() == grid(["00011000010", "00001000011"])
    assert torch.equal(peagle[0, 0, :9, :9], document_causal_mask(DOC, 3)[0, 0])


def target_config() -> dict:
    return {"hidden_size": H, "num_hidden_layers": 8, "vocab_size": V,
            "max_position_embeddings": 2048, "architectures": ["Qwen3ForCausalLM"]}  # fmt: skip


def test_export_writes_the_fields_vllm_windows_by() -> None:
    """EAGLE-3 with a window: vLLM's Qwen3 EAGLE-3 draft (q/k norms), every layer sliding,
    ``use_sliding_window`` (transformers' Qwen3Config drops the window without it); DFlash:
    the same, its window in ``dflash_config`` too and the block still non-causal."""
    config = eagle3_config(windowed_head(), target_config(), [2, 4, 6], 3, "target")
    assert config["architectures"] == ["Eagle3Qwen3ForCausalLM"]
    assert config["model_type"] == config["transformer_layer_config"]["model_type"] == "qwen3"
    assert config["layer_types"] == ["sliding_attention"] * 2 and config["sliding_window"] == 4
    assert config["use_sliding_window"] and window_note(config) is None
    from transformers import Qwen3Config

    read = Qwen3Config(**{k: v for k, v in config.items() if k != "model_type"})
    assert read.sliding_window == 4 and read.layer_types == ["sliding_attention"] * 2
    drafter = DFlashDrafter(hidden_size=H, num_heads=4, head_dim=16, intermediate_size=96,
                            vocab_size=V, target_layer_ids=[1, 3], mask_token_id=5,
                            num_layers=2, sliding_window=16)  # fmt: skip
    flash = dflash_config(drafter, target_config())
    assert flash["layer_types"] == ["sliding_attention"] * 2 and flash["use_sliding_window"]
    assert flash["dflash_config"]["swa_window_size"] == 16
    assert flash["dflash_config"]["causal"] is False and window_note(flash) is None
    full = Eagle3Head(hidden_size=H, num_heads=4, intermediate_size=96, vocab_size=V)
    plain = eagle3_config(full, target_config(), [2, 4, 6], 3, "target")
    assert "layer_types" not in plain and plain["architectures"] == ["Eagle3LlamaForCausalLM"]


def test_an_exported_windowed_head_reads_back_with_its_window(tmp_path) -> None:
    """What eval's torch replica and ``model.init_from`` read: the Qwen3 head, its q/k
    norms and its window, drafting as the trained head does."""
    import json

    from safetensors.torch import save_file

    from draftsmith.drafters.eagle3.export import eagle3_tensors
    from draftsmith.drafters.eagle3.layouts import read_head

    head = windowed_head()
    config = eagle3_config(head, target_config(), [2, 4, 6], 3, "target")
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file(eagle3_tensors(head, torch.float64), str(tmp_path / "model.safetensors"))
    read, facts = read_head(tmp_path, target_config())
    assert facts.layout == "draftsmith" and read.sliding_window == 4
    assert read.init_kwargs["qk_norm"] and read.init_kwargs["sliding_window"] == 4
    read.set_embeddings(head.embed_tokens.float())
    doc = torch.zeros(1, 12, dtype=torch.long)
    pos, ids = torch.arange(12)[None], torch.randint(1, V, (1, 12))
    hs = torch.randn(1, 12, 3 * H, dtype=torch.float64)
    want = ttt_unroll(head, ids, hs, pos, doc, 2, window=4)
    got = ttt_unroll(read.double(), ids, hs, pos, doc, 2, window=read.sliding_window)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)


def test_a_window_vllm_would_not_apply_is_one_line() -> None:
    llama = {"architectures": ["Eagle3LlamaForCausalLM"], "model_type": "llama",
             "layer_types": ["sliding_attention"], "sliding_window": 128}  # fmt: skip
    note = window_note(llama)
    assert "sliding_window 128" in note and "llama_eagle3.py" in note and "\n" not in note
    qwen3 = {**llama, "architectures": ["Eagle3Qwen3ForCausalLM"], "model_type": "qwen3"}
    assert "use_sliding_window" in window_note(qwen3)
    assert window_note({**qwen3, "use_sliding_window": True}) is None
    flash = {"architectures": ["DFlashDraftModel"], "layer_types": ["sliding_attention"],
             "sliding_window": 64, "use_sliding_window": True, "dflash_config": {}}  # fmt: skip
    assert "causally" in window_note(flash)
    assert window_note({"architectures": ["Eagle3LlamaForCausalLM"]}) is None


def test_window_options_refused_in_one_line() -> None:
    with pytest.raises(ConfigError, match=r"model.sliding_window: 3 must exceed model.ttt_steps"):
        drafters.make("eagle3", {"ttt_steps": 3, "sliding_window": 3})
    with pytest.raises(ConfigError, match=r"model.sliding_window: 8 must exceed model.block_s"):
        drafters.make("dflash", {"sliding_window": 8})
    with pytest.raises(ConfigError, match=r"model.sliding_window: an option of model.kind"):
        drafters.make("eagle", {"sliding_window": 64})
    assert drafters.make("dflash", {"sliding_window": 9}).options.sliding_window == 9
    assert "its own included" in drafters.option_docs()["sliding_window"]  # in --help


@pytest.mark.parametrize("window", [None, 3])
def test_peagle_blockwise_mask_is_the_dense_one(window) -> None:
    """P-EAGLE's per-block mask (long rows) equals its dense mask, block by block, and no key
    before a block's first key is seen; a pass through either gives the same drafts."""
    doc = torch.tensor([[0] * 6 + [1] * 3, [2] * 9])
    anchors, keep = torch.tensor([[2, 7], [5, 0]]), torch.tensor([[True, True], [True, False]])
    mask = ParallelMask(anchors, keep, doc, 2, window)
    want = parallel_mask(anchors, keep, doc, 2, window)
    assert torch.equal(mask.dense(), want)
    for s, e, f in mask.spans(4):
        assert torch.equal(mask.block(s, e, f), want[:, :, s:e, f:e])
        assert not want[:, :, s:e, :f].any() and not want[:, :, s:e, e:].any()
    torch.manual_seed(0)
    head = Eagle3Head(hidden_size=H, num_heads=4, num_kv_heads=2, head_dim=16,
                      intermediate_size=96, vocab_size=V, parallel_drafting=True,
                      mask_token_id=7, sliding_window=window).double()  # fmt: skip
    head.set_embeddings(torch.randn(V, H))
    batch = {"input_ids": torch.randint(1, V, (2, 9)), "doc_ids": doc,
             "position_ids": torch.stack([torch.cat([torch.arange(6), torch.arange(3)]),
                                          torch.arange(9)]),
             "aux_states": torch.randn(2, 9, 3 * H, dtype=torch.float64)}  # fmt: skip
    out = {a: parallel_forward(head, batch, anchors, keep, 3, attention=a)
           for a in ("blockwise", "efficient")}  # fmt: skip
    torch.testing.assert_close(out["blockwise"], out["efficient"])
