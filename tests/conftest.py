"""Shared fixtures: the embedded SmolLM2 target and one tiny random Llama built from it.

The tiny model reuses SmolLM2's tokenizer and chat template (real BPE, real template)
with random weights small enough that a vLLM engine on 2 CPU cores starts quickly.
Its head_dim is 64 because vLLM's CPU attention rejects smaller heads.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

TINY = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=8,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=64,
    max_position_embeddings=2048,
)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The embedded SmolLM2-135M-Instruct directory (materialised once, cached)."""
    from draftsmith.targets import resolve_model

    return Path(resolve_model("smollm2-135m"))


@pytest.fixture(scope="session")
def tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


def build_tiny_llama(out: Path, tokenizer_dir: Path, seed: int = 0, **overrides) -> Path:
    """Write a random float32 Llama with the given tokenizer to `out`; return `out`."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(seed)
    config = LlamaConfig(
        **{**TINY, **overrides},
        vocab_size=len(tok),
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=True,
        dtype="float32",
    )
    model = LlamaForCausalLM(config)
    # Larger random weights than the default init give peaked next-token
    # distributions, so greedy text is not a single repeated token.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, smollm2_dir) -> Path:
    """A tiny random Llama (8 layers, hidden 128) with SmolLM2's tokenizer and template."""
    return build_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny-llama", smollm2_dir)
