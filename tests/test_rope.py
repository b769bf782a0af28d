"""Rope kinds: the head's rotary embedding equals the one vLLM builds from the exported config.

For each kind a target config (the rope part copied from a real family) gives a head
(``from_target_config``) and its exported ``config.json`` (``head_config``). vLLM reads that
file with its own config loader (``get_config``, then the ``EAGLEConfig`` wrapper of the
speculative config) and builds the rotary embedding as its Llama draft layer does
(``llama.py`` ``LlamaAttention._init_rotary_emb``: ``get_rope(head_dim, max_position=
max_position_embeddings, rope_parameters=config.rope_parameters, is_neox_style=True)``), on CPU,
without an engine. Both rotate the same q/k at positions up to the end of vLLM's cache.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from draftsmith.core.errors import ConfigError
from draftsmith.drafters import from_target_config, head_config
from draftsmith.drafters.attention.layers import RotaryEmbedding
from draftsmith.drafters.attention.llama import target_rope

BASE = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 8,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "vocab_size": 384,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
}


def _factors(n: int, top: float) -> list[float]:
    return [1.0 + (top - 1.0) * i / (n - 1) for i in range(n)]


# name -> target config overrides (rope fields as the family's config.json writes them).
CASES = {
    "default": {"rope_theta": 500000.0},
    "linear": {"rope_theta": 10000.0, "rope_scaling": {"type": "linear", "factor": 4.0}},
    "dynamic": {"rope_theta": 10000.0, "rope_scaling": {"type": "dynamic", "factor": 2.0}},
    "llama3 (Llama-3.1)": {
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    },
    "yarn (gpt-oss)": {
        "max_position_embeddings": 131072,
        "rope_theta": 150000.0,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "original_max_position_embeddings": 4096,
            "truncate": False,
        },
    },
    "yarn (DeepSeek, mscale)": {
        "hidden_size": 112,
        "head_dim": None,  # hidden / heads = 56, as DeepSeek-V3's 7168 / 128
        "max_position_embeddings": 163840,
        "rope_theta": 10000.0,
        "rope_scaling": {
            "type": "yarn",
            "factor": 40.0,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 0.707,
            "original_max_position_embeddings": 4096,
        },
    },
    "yarn (Qwen3 long context, rope_parameters)": {
        "head_dim": 128,
        "max_position_embeddings": 131072,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 1000000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 32768,
        },
    },
    "longrope (Phi-4-mini, partial 0.75)": {
        "head_dim": 128,
        "max_position_embeddings": 131072,
        "original_max_position_embeddings": 4096,
        "partial_rotary_factor": 0.75,
        "rope_theta": 10000.0,
        "rope_scaling": {
            "type": "longrope",
            "short_factor": _factors(48, 1.5),
            "long_factor": _factors(48, 30.0),
        },
    },
    "longrope short (max = original)": {
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "rope_scaling": {
            "rope_type": "longrope",
            "short_factor": _factors(32, 1.5),
            "long_factor": _factors(32, 30.0),
            "original_max_position_embeddings": 4096,
            "short_mscale": 1.1,
            "long_mscale": 1.3,
        },
    },
    "partial 0.25 (Qwen3-Next)": {
        "head_dim": 256,
        "max_position_embeddings": 262144,
        "partial_rotary_factor": 0.25,
        "rope_theta": 10000000.0,
    },
}


def target(overrides: dict) -> dict:
    config = {**BASE, **overrides}
    return {k: v for k, v in config.items() if v is not None}


def vllm_rope(head_dir: Path):
    """(vLLM's rotary embedding for the draft, its hf config), as the engine would build it."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope
    from vllm.transformers_utils.config import get_config
    from vllm.transformers_utils.configs.eagle import EAGLEConfig

    hf = EAGLEConfig(get_config(str(head_dir), trust_remote_code=False), method="eagle3")
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    with set_current_vllm_config(VllmConfig()):  # vLLM's custom ops read it when built
        rope = get_rope(
            head_dim,
            max_position=getattr(hf, "max_position_embeddings", 8192),
            rope_parameters=getattr(hf, "rope_parameters", None),
            is_neox_style=True,
        )
    return rope, hf


@pytest.mark.parametrize("name", list(CASES))
def test_head_rope_equals_vllm_draft_rope(name, tmp_path, monkeypatch):
    pytest.importorskip("vllm")
    from vllm.model_executor.layers.rotary_embedding import phi3_long_rope_scaled_rope

    cfg = target(CASES[name])
    # vLLM's LongRoPE picks its factors by the engine's max_model_len: the target's length.
    engine = SimpleNamespace(
        model_config=SimpleNamespace(max_model_len=cfg["max_position_embeddings"])
    )
    monkeypatch.setattr(phi3_long_rope_scaled_rope, "get_current_vllm_config", lambda: engine)
    head = from_target_config(cfg, "eagle3")
    config = head_config(head, "eagle3", cfg, None, 3, "verifier")
    (tmp_path / "config.json").write_text(json.dumps(config))
    rope, hf = vllm_rope(tmp_path)
    assert hf.max_position_embeddings == cfg["max_position_embeddings"]

    n_heads, hd = head.layer_kwargs["num_heads"], head.head_dim
    top = cfg["max_position_embeddings"] - 1
    pos = torch.cat([torch.arange(64), torch.linspace(64, top, 192).long()])
    g = torch.Generator().manual_seed(0)
    q = torch.randn(len(pos), n_heads * hd, generator=g)
    k = torch.randn(len(pos), hd, generator=g)
    forward = getattr(rope, "forward_native", rope.forward)
    ref_q, ref_k = forward(pos, q.clone(), k.clone())

    def ours(x: torch.Tensor) -> torch.Tensor:  # [T, n * hd] -> rotated [T, n * hd]
        x = x.view(1, len(pos), -1, hd).transpose(1, 2)  # [1, n, T, hd]
        return head.rotary(x, pos[None]).transpose(1, 2).reshape(len(pos), -1)

    torch.testing.assert_close(ours(q), ref_q, atol=2e-6, rtol=0)
    torch.testing.assert_close(ours(k), ref_k, atol=2e-6, rtol=0)
    assert head.rotary.rotary_dim == getattr(rope, "rotary_dim", hd)


def test_target_rope_normalises_families() -> None:
    theta, scaling = target_rope(target(CASES["longrope (Phi-4-mini, partial 0.75)"]))
    assert theta == 10000.0 and scaling is not None
    assert scaling["rope_type"] == "longrope" and scaling["partial_rotary_factor"] == 0.75
    assert scaling["original_max_position_embeddings"] == 4096  # the top-level field
    theta, scaling = target_rope(target(CASES["yarn (DeepSeek, mscale)"]))
    assert scaling is not None and scaling["rope_type"] == "yarn" and "type" not in scaling
    # su is longrope; M-RoPE sections are dropped; nested per-layer-type rope gives full attention
    assert target_rope({"rope_scaling": {"type": "su", "short_factor": [1.0]}})[1] == {
        "rope_type": "longrope",
        "short_factor": [1.0],
    }
    mrope = {"rope_type": "default", "rope_theta": 5e6, "mrope_section": [24, 20, 20]}
    assert target_rope({"rope_parameters": mrope}) == (5e6, None)
    nested = {"full_attention": {"rope_type": "default", "rope_theta": 1e6}}
    nested["sliding_attention"] = {"rope_type": "default", "rope_theta": 1e4}
    assert target_rope({"rope_parameters": nested}) == (1e6, None)
    assert target_rope({"rope_theta": 1e4, "rotary_pct": 0.5}) == (
        1e4,
        {"rope_type": "default", "partial_rotary_factor": 0.5},
    )


def test_unsupported_rope_is_a_config_error() -> None:
    for scaling in (
        {"rope_type": "proportional"},
        {"rope_type": "dynamic", "alpha": 1000.0},
        {"rope_type": "deepseek_yarn", "factor": 4.0},
    ):
        with pytest.raises(ConfigError, match="rope"):
            RotaryEmbedding(64, 1e4, scaling)


def test_exported_rope_fields_for_vllm(tmp_path) -> None:
    cfg = target(CASES["longrope (Phi-4-mini, partial 0.75)"])
    config = head_config(from_target_config(cfg, "eagle3"), "eagle3", cfg, None, 3, "v")
    assert config["max_position_embeddings"] == 131072
    assert config["original_max_position_embeddings"] == 4096
    assert config["partial_rotary_factor"] == 0.75
    params = config["rope_parameters"]
    assert params["rope_type"] == "longrope" and params["rope_theta"] == 10000.0
    assert params["original_max_position_embeddings"] == 4096
    assert params["partial_rotary_factor"] == 0.75 and len(params["long_factor"]) == 48
    assert config["transformer_layer_config"]["rope_parameters"] == params
