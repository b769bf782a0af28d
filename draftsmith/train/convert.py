"""`draftsmith convert`: a published EAGLE-3 head, in any common layout, for a named consumer.

    draftsmith convert --head yuhuili/EAGLE3-LLaMA3.1-Instruct-8B-local --to sglang \\
        --output outputs/heads/llama-eagle3-sglang --model meta-llama/Llama-3.1-8B-Instruct

The head is read by ``drafters/eagle3/layouts.py`` (EAGLE, speculators, ModelOpt, SGLang /
SpecForge or ours) and written by ``drafters/eagle3/layouts_write.py`` in the names and
config keys the consumer's loader reads. ``--model`` checks the head against the target
(hidden size, vocabulary, tapped layers, vocabulary map) and gives the default taps
``[2, N // 2, N - 3]`` to a head that names none. The serving command is printed.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from draftsmith.core.config import parse_config
from draftsmith.core.console import say
from draftsmith.core.errors import exit_code
from draftsmith.core.outputs import check_output
from draftsmith.core.targets import read_target
from draftsmith.drafters.eagle3.layouts import HeadFacts, fit_to_target, read_head
from draftsmith.drafters.eagle3.layouts_write import CARD_MARK, serve_command, write_head
from draftsmith.drafters.headfiles import HeadError

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class ConvertConfig:
    """Read an EAGLE-3 head in any common layout and write it for one consumer."""

    head: str
    """The head directory (config.json and *.safetensors or pytorch_model.bin), in the
    SafeAILab EAGLE, speculators, ModelOpt, SGLang / SpecForge or draftsmith layout."""
    to: Literal["vllm", "vllm-ascend", "sglang", "trtllm", "eagle", "speculators"]
    """The consumer: vllm, vllm-ascend (vllm's files, Ascend's limits checked), sglang,
    trtllm (also Dynamo), eagle (SafeAILab EAGLE), speculators (``vllm serve DIR`` alone)."""
    output: str
    """Directory to write: config.json, model.safetensors, README.md. A directory convert
    wrote is replaced; anything else is refused."""
    model: str | None = None
    """The target: checks the head's hidden size, vocabulary, tapped layers and vocabulary
    map against it, and gives the default taps [2, N // 2, N - 3] to a head naming none.
    Needed when the head names no taps, or ships no lm_head."""
    num_speculative_tokens: int = 3
    """k in the printed serving command (and ``vllm serve DIR``'s default for speculators)."""
    tensor_parallel_size: int = 1
    """The target's tensor parallelism (vllm, vllm-ascend: checked with the draft's)."""
    draft_tensor_parallel_size: int | None = None
    """The draft's tensor parallelism: 1 or tensor_parallel_size (None: the target's)."""
    dtype: Literal["bfloat16", "float16", "float32", "source"] = "source"
    """Weight dtype on disk; source keeps the head's own."""
    overwrite: bool = False
    """Replace `output` even if it is a file or a directory convert did not write."""


def converted_dir(path: Path) -> bool:
    """An ``own`` test: a head directory ``draftsmith convert`` wrote."""
    readme = path / "README.md"
    try:
        return readme.is_file() and CARD_MARK in readme.read_text(errors="replace")
    except OSError:
        return False


def check_parallelism(cfg: ConvertConfig) -> None:
    """vLLM (and vLLM Ascend) run the draft with TP 1 or the target's TP."""
    tp, draft = cfg.tensor_parallel_size, cfg.draft_tensor_parallel_size
    if tp < 1 or (draft is not None and draft not in (1, tp)):
        raise HeadError(
            f"draft_tensor_parallel_size: {draft} with tensor_parallel_size {tp}; "
            f"{cfg.to} runs the draft with TP 1 or the target's ({tp})"
        )


def convert(cfg: ConvertConfig) -> tuple[Path, HeadFacts, str]:
    """Read, check and write the head: (the written directory, the head's facts, the
    target the serving command names)."""
    check_parallelism(cfg)
    target = read_target(cfg.model) if cfg.model else None
    head, facts = read_head(Path(cfg.head), target.config if target else None)
    if target is not None:
        fit_to_target(head, facts, target)
        target_config, verifier = target.config, target.path
    else:
        if facts.layer_ids is None:
            raise HeadError(
                f"head: {cfg.head} names no tapped layers; give --model TARGET so the "
                "default [2, N // 2, N - 3] can be written"
            )
        if facts.lm_head_from_target:
            raise HeadError(
                f"head: {cfg.head} ships no lm_head; give --model TARGET to take its rows"
            )
        k = head.init_kwargs
        target_config = {
            "vocab_size": head.vocab_size,
            "hidden_size": k["target_hidden_size"],
            "num_hidden_layers": max(facts.layer_ids),
            "max_position_embeddings": k["max_position_embeddings"],
        }
        verifier = facts.verifier or "TARGET"
    dtype = facts.dtype if cfg.dtype == "source" else DTYPES[cfg.dtype]
    out = write_head(
        head,
        facts,
        cfg.to,
        Path(cfg.output),
        target_config,
        verifier=verifier,
        num_speculative_tokens=cfg.num_speculative_tokens,
        dtype=dtype,
        target_layers=target is not None,
    )
    return out, facts, verifier


def run_stage(cfg: ConvertConfig) -> int:
    check_output(cfg.output, "output", converted_dir, overwrite=cfg.overwrite)
    out, facts, verifier = convert(cfg)
    taps = f"{facts.layer_ids}" + (" (defaulted)" if facts.layer_ids_defaulted else "")
    say(f"converted: {facts.layout} head -> {cfg.to} at {out} (taps {taps})")
    tp = (cfg.tensor_parallel_size, cfg.draft_tensor_parallel_size)
    print(serve_command(cfg.to, out, verifier, facts, cfg.num_speculative_tokens, tp))
    return 0


def main(args: list[str] | None = None) -> int:
    prog = "draftsmith convert"
    return exit_code(prog, lambda: run_stage(parse_config(ConvertConfig, args, prog=prog)))


if __name__ == "__main__":
    sys.exit(main())
