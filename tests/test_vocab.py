"""Tied embeddings and padded vocabularies: the shared tensors and the exported head fit vLLM.

Targets such as Qwen3-0.6B, Llama-3.2-1B and SmolLM2 tie their lm_head to the embeddings (the
checkpoint has no ``lm_head.weight``); Qwen's configs give ``vocab_size`` rows past the
tokenizer's ids (151936 for 151665 tokens). vLLM sizes the draft's vocabulary from the
target's config, so the head's must be the config's, padding included. Serving such heads
in vLLM is the family matrix's part (tests/test_families.py: tied llama and qwen3, padded
qwen2 and gpt_oss, each with a reduced draft vocabulary).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from draftsmith.core.targets import read_target
from draftsmith.drafters import export_head, from_target_config
from draftsmith.drafters.target.weights import load_target_weights

PAD = 64


def head_for(target, kind: str = "eagle3", **options):
    """A random head built the way the trainer builds it: shared tensors from the target."""
    torch.manual_seed(0)
    weights = load_target_weights(target)
    head = from_target_config(target.config, kind, **options)
    head.set_embeddings(weights.embed)
    if kind == "eagle":
        head.set_lm_head(weights.lm_head)
    return head, weights


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_padded_vocab_heads_export_the_configs_vocab(tmp_path, make_tiny_llama, tokenizer, tied):
    out = make_tiny_llama(tmp_path / "target", tie_word_embeddings=tied, pad_vocab=PAD)
    checkpoint = load_file(out / "model.safetensors")
    assert ("lm_head.weight" in checkpoint) is not tied
    target = read_target(str(out))
    vocab = len(tokenizer) + PAD
    assert target.vocab_size == vocab

    head, weights = head_for(target)
    assert weights.embed.shape == weights.lm_head.shape == (vocab, target.hidden_size)
    expected = checkpoint["model.embed_tokens.weight" if tied else "lm_head.weight"]
    assert torch.equal(weights.lm_head, expected)
    full = export_head(head, "eagle3", target, tmp_path / "full")
    config = json.loads((full / "config.json").read_text())
    tensors = load_file(full / "model.safetensors")
    assert config["vocab_size"] == config["draft_vocab_size"] == vocab
    assert config["tie_word_embeddings"] is False  # the head's own lm_head, never tied
    assert tensors["lm_head.weight"].shape == (vocab, target.hidden_size)
    assert "d2t" not in tensors and not any("embed_tokens" in k for k in tensors)

    # A reduced draft vocabulary holds real token ids only; d2t maps into the padded range.
    reduced, _ = head_for(target, draft_vocab_size=1000)
    ids = torch.cat([torch.arange(999), torch.tensor([len(tokenizer) - 1])])
    reduced.set_draft_vocab(ids)
    small = export_head(reduced, "eagle3", target, tmp_path / "small")
    config = json.loads((small / "config.json").read_text())
    d2t = load_file(small / "model.safetensors")["d2t"]
    assert config["vocab_size"] == vocab and config["draft_vocab_size"] == 1000
    assert torch.equal(torch.arange(1000) + d2t, ids)

    # EAGLE-1 uses the target's lm_head (the embeddings when tied): never exported.
    eagle1, _ = head_for(target, "eagle")
    assert torch.equal(eagle1.lm_head, expected)
    e1 = export_head(eagle1, "eagle", target, tmp_path / "e1")
    assert "lm_head.weight" not in load_file(e1 / "model.safetensors")
