"""Which targets work: vLLM's own model registry answers, and the answer is cached on disk."""

from __future__ import annotations

import json

import pytest

from draftsmith.core import targets
from draftsmith.core.targets import eagle3_refusal


@pytest.fixture()
def fresh_cache(tmp_path, monkeypatch):
    """An empty draftsmith cache and no in-process answers."""
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path))
    eagle3_refusal.cache_clear()
    yield tmp_path / "vllm-eagle3.json"
    eagle3_refusal.cache_clear()


@pytest.mark.parametrize(
    "arch",
    ["GraniteForCausalLM", "Qwen3MoeForCausalLM", "GptOssForCausalLM", "DeepseekV3ForCausalLM"],
)
def test_vllm_taps_these_families(arch, fresh_cache):
    pytest.importorskip("vllm")
    assert eagle3_refusal(arch) is None


def test_refusals_name_vllms_reason(fresh_cache):
    pytest.importorskip("vllm")
    version = targets._vllm_version()
    gemma3 = eagle3_refusal("Gemma3ForCausalLM")
    assert gemma3 == (
        f"vLLM {version} has no SupportsEagle3 for Gemma3ForCausalLM "
        "(vllm/model_executor/models/gemma3.py)"
    )
    assert eagle3_refusal("NoSuchForCausalLM") == (
        f"vLLM {version} does not know architecture NoSuchForCausalLM"
    )
    # Both answers are kept per vLLM version; a later process reads them without vLLM.
    cached = json.loads(fresh_cache.read_text())
    assert cached[version]["Gemma3ForCausalLM"] == gemma3 and len(cached[version]) == 2


def test_cached_answers_skip_vllm(fresh_cache, monkeypatch):
    version = targets._vllm_version()
    if version is None:
        pytest.skip("vLLM is not installed")
    fresh_cache.write_text(json.dumps({version: {"LlamaForCausalLM": None, "X": "no"}}))

    def no_vllm(*_):
        raise AssertionError("asked vLLM although the answer was cached")

    monkeypatch.setattr(targets, "_ask_vllm", no_vllm)
    assert eagle3_refusal("LlamaForCausalLM") is None and eagle3_refusal("X") == "no"


def test_extract_refuses_an_untappable_target(tmp_path, tiny_model_dir, fresh_cache, capsys):
    """The stage's one-line error carries vLLM's reason (before any engine starts)."""
    pytest.importorskip("vllm")
    import shutil

    from draftsmith.extract.main import main

    target = tmp_path / "gemma3"
    shutil.copytree(tiny_model_dir, target, ignore=shutil.ignore_patterns("*.safetensors"))
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(
        json.dumps(config | {"architectures": ["Gemma3ForCausalLM"]})
    )
    assert main(["--model", str(target), "--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no SupportsEagle3 for Gemma3ForCausalLM" in err
