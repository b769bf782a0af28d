"""`draftsmith convert`: a published EAGLE-3 or EAGLE-1 head, in any common layout, for a
named consumer; a DSpark or DFlash2 head between the layouts draftsmith writes for it.

    draftsmith convert --head yuhuili/EAGLE3-LLaMA3.1-Instruct-8B-local --to sglang \\
        --output outputs/heads/llama-eagle3-sglang --model meta-llama/Llama-3.1-8B-Instruct

The kind is told by the files (``eagle1_layout``). An EAGLE-3 head is read by
``drafters/eagle3/layouts.py`` (EAGLE, speculators, ModelOpt, SGLang / SpecForge or ours) and
written by ``drafters/eagle3/layouts_write.py``; an EAGLE-1 head by ``drafters/eagle1/layouts.py``
(SafeAILab EAGLE, SGLang or ours) and ``drafters/eagle1/layouts_write.py`` (vllm, sglang,
eagle), each in the names and config keys the consumer's loader reads. ``--model`` checks the
head against the target (hidden size, vocabulary, shipped embeddings; for EAGLE-3 also tapped
layers and vocabulary map) and gives the default taps ``[2, N // 2, N - 3]`` to an EAGLE-3
head that names none. The serving command is printed.

Block heads (``convert_block``) are read and rewritten by their kind: DSpark from vLLM's or
speculators' layout to either (``drafters/dspark/export.py``), DFlash2 from vLLM's layout to
vLLM's (``drafters/dflash2/export.py``: a new dtype, checked against ``--model``, which these
need). A consumer draftsmith has no layout for is refused in one line.
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
from draftsmith.core.targets import TargetInfo, read_target
from draftsmith.drafters import Drafter, get, head_method, kind_of_method
from draftsmith.drafters.dflash2.export import read_vllm as read_dflash2
from draftsmith.drafters.dspark.export import read_dspark
from draftsmith.drafters.eagle1.layouts import eagle1_layout, fit_eagle1, read_eagle1
from draftsmith.drafters.eagle1.layouts_write import serve_command as eagle1_command
from draftsmith.drafters.eagle1.layouts_write import write_eagle1
from draftsmith.drafters.eagle3.layouts import fit_to_target, read_head
from draftsmith.drafters.eagle3.layouts_write import serve_command, write_head
from draftsmith.drafters.headfiles.directory import CARD_MARK, HeadError
from draftsmith.drafters.headfiles.read import HeadFacts, read_head_config, read_head_files

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
BLOCK_READERS = {"dspark": read_dspark, "dflash2": read_dflash2}  # kind -> its head's reader


@dataclass
class ConvertConfig:
    """Read an EAGLE-3 or EAGLE-1 head in any common layout and write it for one consumer (a
    DSpark or DFlash2 head: in a layout draftsmith writes for it)."""

    head: str
    """The head directory (config.json and *.safetensors or pytorch_model.bin). EAGLE-3: the
    SafeAILab EAGLE, speculators, ModelOpt, SGLang / SpecForge or draftsmith layout. EAGLE-1:
    the SafeAILab EAGLE, SGLang or draftsmith layout. DSpark: vLLM's or speculators' layout.
    DFlash2: vLLM's layout."""
    to: Literal["vllm", "vllm-ascend", "sglang", "trtllm", "eagle", "speculators"]
    """The consumer: vllm, vllm-ascend (vllm's files, Ascend's limits checked), sglang,
    trtllm (also Dynamo), eagle (SafeAILab EAGLE), speculators (``vllm serve DIR`` alone).
    EAGLE-1 heads: vllm, sglang and eagle. DSpark: vllm and speculators. DFlash2: vllm."""
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
    command that serves it)."""
    check_parallelism(cfg)
    target = read_target(cfg.model) if cfg.model else None
    if (kind := block_kind(read_head_config(cfg.head))) is not None:
        return convert_block(cfg, target, kind)
    files = read_head_files(cfg.head)
    if eagle1_layout(*files) is not None:
        return convert_eagle1(cfg, target, files)
    head, facts = read_head(Path(cfg.head), target.config if target else None, files)
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
    tp = (cfg.tensor_parallel_size, cfg.draft_tensor_parallel_size)
    return out, facts, serve_command(cfg.to, out, verifier, facts, cfg.num_speculative_tokens, tp)


def convert_eagle1(
    cfg: ConvertConfig, target: TargetInfo | None, files: tuple
) -> tuple[Path, HeadFacts, str]:
    """``convert`` for an EAGLE-1 head: it taps no layers and ships no lm_head, so it needs
    no target (one given is checked against)."""
    head, facts = read_eagle1(cfg.head, files)
    fit_eagle1(head, facts, target)
    if target is not None:
        target_config, verifier = target.config, target.path
    else:
        target_config = {
            "vocab_size": head.vocab_size,
            "hidden_size": head.hidden_size,
            "max_position_embeddings": head.init_kwargs["max_position_embeddings"],
        }
        verifier = facts.verifier or "TARGET"
    k, tp = cfg.num_speculative_tokens, (cfg.tensor_parallel_size, cfg.draft_tensor_parallel_size)
    dtype = facts.dtype if cfg.dtype == "source" else DTYPES[cfg.dtype]
    out = write_eagle1(
        head, facts, cfg.to, Path(cfg.output), target_config,
        verifier=verifier, num_speculative_tokens=k, dtype=dtype, tp=tp,
    )  # fmt: skip
    return out, facts, eagle1_command(cfg.to, out, verifier, k, tp)


def block_kind(config: dict) -> type[Drafter] | None:
    """The block kind (DSpark, DFlash2) a head's ``config.json`` is of, or None."""
    if config.get("speculators_model_type") == "dspark":
        return get("dspark")
    method = head_method(config)
    kind = kind_of_method(method, config) if method else None
    return kind if kind is not None and kind.name in BLOCK_READERS else None


def convert_block(
    cfg: ConvertConfig, target: TargetInfo | None, kind: type[Drafter]
) -> tuple[Path, HeadFacts, str]:
    """``convert`` for a block head: read by its kind, written by its kind's ``export``."""
    if cfg.to not in kind.layouts:
        raise HeadError(
            f"to: {cfg.to!r}; draftsmith writes {kind.title} heads as {' or '.join(kind.layouts)} "
            f"only (no {cfg.to} layout for them here)"
        )
    if target is None:
        raise HeadError(f"model: not given; a {kind.title} head is written for its target: give "
                        "--model TARGET")  # fmt: skip
    config = read_head_config(cfg.head)
    head = BLOCK_READERS[kind.name](cfg.head)
    source = DTYPES.get(str(config.get("torch_dtype", "float32")), torch.float32)
    dtype = source if cfg.dtype == "source" else DTYPES[cfg.dtype]
    layout = {"to": cfg.to} if cfg.to != "vllm" else {}
    k = cfg.num_speculative_tokens
    out = kind.export(head, target, Path(cfg.output), num_speculative_tokens=k, dtype=dtype,
                      **layout)  # fmt: skip
    facts = HeadFacts(
        layout="speculators" if "speculators_config" in config else "vLLM",
        source=cfg.head,
        layer_ids=[i + 1 for i in head.target_layer_ids],
        dtype=dtype,
        kind=kind.title,
    )
    return out, facts, kind.serve_hint(out, read_head_config(out))


def run_stage(cfg: ConvertConfig) -> int:
    check_output(cfg.output, "output", converted_dir, overwrite=cfg.overwrite)
    out, facts, command = convert(cfg)
    taps = f"{facts.layer_ids}" + (" (defaulted)" if facts.layer_ids_defaulted else "")
    if facts.kind == "EAGLE-1":
        taps = "none: EAGLE-1 reads the target's final state"
    say(f"converted: {facts.kind} {facts.layout} head -> {cfg.to} at {out} (taps {taps})")
    print(command)
    return 0


def main(args: list[str] | None = None) -> int:
    prog = "draftsmith convert"
    return exit_code(prog, lambda: run_stage(parse_config(ConvertConfig, args, prog=prog)))


if __name__ == "__main__":
    sys.exit(main())
