"""Which targets work: vLLM's own model registry answers, and the answer is cached on disk."""

from __future__ import annotations

import json

import pytest

from draftsmith.core import targets, vllm_taps
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
    ["GraniteForCausalLM", "Qwen3MoeForCausalLM", "GptOssForCausalLM", "DeepseekV3ForCausalLM",
     "Qwen3NextForCausalLM", "MiMoForCausalLM", "Glm4MoeForCausalLM", "Ernie4_5_MoeForCausalLM"],
)  # fmt: skip
def test_vllm_taps_these_families(arch, fresh_cache):
    """The last three through draftsmith's plugin (core/vllm_taps.py), installed here."""
    pytest.importorskip("vllm")
    assert eagle3_refusal(arch) is None


def test_without_the_plugin_the_mtp_families_are_refused(fresh_cache, monkeypatch):
    """MiMo claims SupportsEagle3 in vLLM 0.32 but returns no states: without draftsmith's
    plugin (its entry point not installed) the three tapped families are refused, and the
    answers are kept apart from the plugin's."""
    pytest.importorskip("vllm")
    from draftsmith.core import vllm_fixes

    monkeypatch.setattr(vllm_fixes, "installed", lambda: False)
    said = eagle3_refusal("MiMoForCausalLM")
    assert said and "hands out no hidden states" in said and "`make setup`" in said
    assert eagle3_refusal("Glm4MoeForCausalLM") and eagle3_refusal("LlamaForCausalLM") is None
    version = targets._vllm_version()
    assert set(json.loads(fresh_cache.read_text())) == {f"{version} taps off"}


@pytest.mark.parametrize("n", range(1, 13))
def test_default_layer_ids_stay_inside_the_target(n):
    """Low, middle and high taps plus N, each once and within 0..N, whatever the depth (a
    two-layer target once got [-1, 1, 2])."""
    ids = targets.default_layer_ids(n)
    assert ids == sorted(set(ids)) and all(0 <= k <= n for k in ids) and ids[-1] == n
    targets.validate_layer_ids(ids, n)
    assert targets.default_layer_ids(2) == [0, 1, 2] and targets.default_layer_ids(8) == [
        2,
        4,
        5,
        8,
    ]


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
    key = f"{version} taps {vllm_taps.REVISION}"  # the plugin's classes were asked
    assert cached[key]["Gemma3ForCausalLM"] == gemma3 and len(cached[key]) == 2


def test_cached_answers_skip_vllm(fresh_cache, monkeypatch):
    version = targets._vllm_version()
    if version is None:
        pytest.skip("vLLM is not installed")
    key = f"{version} taps {vllm_taps.REVISION}"
    fresh_cache.write_text(json.dumps({key: {"LlamaForCausalLM": None, "X": "no"}}))

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
