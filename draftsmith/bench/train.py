"""`draftsmith bench-train`: training throughput and peak memory of a head's TTT step.

Times full optimizer steps (TTT unroll, chunked loss, backward, AdamW) of the head that
``draftsmith train`` builds for the target, on packed rows of random states with the
target's shapes, so no dataset is needed. Reports tokens/s, peak memory (CUDA allocator
peak on GPU, process peak RSS on CPU) and, on GPU, model FLOPs utilisation against bf16 peak.
The head's speed levers are options as in training (``model.fused_loss``,
``model.attention``, ``model.compile``), and the figures say what each resolved to here.

    draftsmith bench-train --model smollm2-135m --ttt_steps 7 --row_tokens 2048
    draftsmith bench-train --model configs/targets/llama3.1-8b --random_weights true
    draftsmith bench-train ... --data DIR --order shards --num_workers 1   # with the loader
    draftsmith bench-train ... --fused_loss off --attention efficient --compile off  # old path

``configs/targets/*`` hold only the config.json of large targets: with ``--random_weights``
the shared tensors are random with the target's shapes (throughput does not depend on values).
With ``--data`` the rows come from a dataset through the training loader instead (in
``order`` samples or shards, from a cold page cache by default), and the time includes
whatever the step waits for it: whether the loader keeps up with the GPU. A dataset of the
target's shapes without a target: ``draftsmith bench-loader --keep true``.
"""

from __future__ import annotations

import itertools
import json
import resource
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from draftsmith.bench.flops import peak_tflops
from draftsmith.core.config import parse_config, to_dict
from draftsmith.core.errors import ConfigError, exit_code
from draftsmith.core.outputs import check_output, json_from
from draftsmith.core.targets import read_target
from draftsmith.drafters import from_target_config
from draftsmith.drafters.attention.ttt import AttentionImpl, resolve_attention, ttt_unroll
from draftsmith.drafters.attention.ttt_compile import CompileMode, compiled_unroll, use_compile
from draftsmith.drafters.losses.fused_loss import FusedMode, fused_enabled
from draftsmith.drafters.losses.loss import ttt_loss
from draftsmith.drafters.target.weights import load_target_weights


@dataclass
class BenchTrainConfig:
    """Time training steps of an EAGLE-3 head for a target (random states, real shapes)."""

    model: str = "smollm2-135m"
    """Target model (directory, hub id or short name)."""
    ttt_steps: int = 7
    """K, draft steps unrolled per batch."""
    row_tokens: int = 2048
    """Tokens per packed row."""
    batch_size: int = 1
    """Rows per step."""
    draft_vocab_size: int = 16384
    """Draft vocabulary size."""
    train_lm_head: bool = True
    """Train the draft lm_head (as ``model.train_lm_head``); false skips its gradient."""
    random_weights: bool = False
    """Random embeddings and lm_head with the target's shapes (a directory with only a
    config.json is enough)."""
    steps: int = 5
    """Timed optimizer steps (after one warm-up step)."""
    loss_chunk_size: int = 1024
    """Tokens per chunk of logits in the loss."""
    attention: AttentionImpl = "auto"
    """TTT attention (as ``model.attention``): auto (blockwise on CPU; on CUDA flex
    when the unroll is compiled, else efficient), blockwise, efficient, dense or flex (trains
    on CUDA only)."""
    fused_loss: FusedMode = "auto"
    """The loss's fused Triton path (as ``model.fused_loss``): auto (on CUDA with Triton),
    on (refused where it cannot run) or off (the torch path)."""
    compile: CompileMode = "auto"
    """torch.compile of the TTT unroll (as ``model.compile``): auto (one-process CUDA runs
    where ``ttt_compile.COMPILE_GAIN`` says it wins at this TTT), on or off."""
    data: str | None = None
    """A dataset directory to take the rows from through the training loader (its states
    must have the target's hidden size); null = random rows made once, no loader."""
    order: Literal["samples", "shards"] = "samples"
    """With ``data``: the loader's order (as ``data.order``; streaming trains in shards)."""
    num_workers: int = 2
    """With ``data``: DataLoader worker processes (as ``data.num_workers``)."""
    cold: bool = True
    """With ``data``: drop the shards from the page cache first (a large dataset's case)."""
    output: str | None = None
    """Optional JSON file for the figures (an existing file bench-train did not write is
    refused; see `overwrite`)."""
    overwrite: bool = False
    """Replace `output` even if bench-train did not write it."""


@dataclass
class Prepared:
    """A head and its training step, built by :func:`prepare` and ready to be timed."""

    step: Callable[[], None]
    """One optimizer step on the next batch (TTT unroll, loss, backward, AdamW)."""
    head: torch.nn.Module
    device: str
    hidden_size: int
    """The target's hidden size H (the lm_head is [draft_vocab, H])."""
    real_tokens: torch.Tensor
    """Non-padding tokens of the batches stepped since the last reset (on ``device``)."""
    levers: dict = field(default_factory=dict)
    """What the speed levers resolved to (``resolve_levers``; empty for other trainers)."""
    warmup_s: float = 0.0
    """Seconds of the warm-up steps of the last ``time_steps`` (compiling happens there)."""


def resolve_levers(cfg: BenchTrainConfig, device: str) -> dict:
    """The speed levers ``cfg`` asks for, as a step on ``device`` runs them: ``fused_loss``
    and ``compile`` true or false, ``attention`` the path a training step picks
    (``ttt.resolve_attention``). A fused loss ``on`` where it cannot run is refused
    here (ConfigError), before the head is built."""
    dev = torch.device(device)
    compiled = use_compile(cfg.compile, cfg.ttt_steps, dev, world_size=1)
    return {
        "fused_loss": fused_enabled(cfg.fused_loss, dev),
        "attention": resolve_attention(cfg.attention, dev, compiled),
        "compile": compiled,
    }


def prepare(cfg: BenchTrainConfig) -> Prepared:
    """Build the head ``draftsmith train`` builds for ``cfg.model``, its optimizer and rows."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    levers = resolve_levers(cfg, device)
    target = read_target(cfg.model)
    head = from_target_config(target.config, "eagle3", draft_vocab_size=cfg.draft_vocab_size)
    if cfg.random_weights:  # made on the device: an 8B target's [128k, 4096] pair is slow on CPU
        shape = (target.vocab_size, target.hidden_size)
        embed = torch.randn(shape, device=device) * 0.02
        lm_head = torch.randn(shape, device=device) * 0.02
    else:
        weights = load_target_weights(target)
        embed, lm_head = weights.embed, weights.lm_head
    head.to(device)
    head.set_embeddings(embed)
    head.set_draft_vocab(torch.arange(cfg.draft_vocab_size))
    teacher_w = lm_head[: cfg.draft_vocab_size].to(device)
    del embed, lm_head
    with torch.no_grad():
        head.lm_head.weight.copy_(teacher_w)
    head.lm_head.weight.requires_grad_(cfg.train_lm_head)
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=1e-4)
    rows = loader_rows(cfg, device) if cfg.data else random_rows(cfg, target.hidden_size, device)
    real_tokens = torch.zeros((), dtype=torch.long, device=device)  # summed there: no sync
    autocast = torch.autocast("cuda", torch.bfloat16) if device == "cuda" else nullcontext()
    unroll = compiled_unroll() if levers["compile"] else ttt_unroll
    fused = "on" if levers["fused_loss"] else "off"

    def step() -> None:
        batch = next(rows)
        real_tokens.add_((batch["doc_ids"] >= 0).sum())
        with autocast:
            states = unroll(
                head, batch["input_ids"], batch["aux"], batch["positions"], batch["doc_ids"],
                cfg.ttt_steps, levers["attention"],
            )  # fmt: skip
            out = ttt_loss(
                states, head.logits_weight, batch["teacher"], teacher_w, batch["loss_mask"],
                batch["doc_ids"], chunk_size=cfg.loss_chunk_size, fused=fused,
            )  # fmt: skip
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return Prepared(step, head, device, target.hidden_size, real_tokens, levers)


def time_steps(bench: Prepared, steps: int, warmup: int = 1) -> float:
    """Seconds for ``steps`` steps after ``warmup`` warm-up steps (their seconds go to
    ``bench.warmup_s``: a compiled unroll is built there). The real-token count starts from
    zero after the warm-up, and on CUDA so does the allocator's peak (weights and optimizer
    state, still allocated, stay counted in it)."""
    start = time.perf_counter()
    for _ in range(warmup):
        bench.step()
    if bench.device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    bench.warmup_s = time.perf_counter() - start
    bench.real_tokens.zero_()
    start = time.perf_counter()
    for _ in range(steps):
        bench.step()
    if bench.device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def run(cfg: BenchTrainConfig) -> dict:
    bench = prepare(cfg)
    device, head, real_tokens = bench.device, bench.head, bench.real_tokens
    seconds = time_steps(bench, cfg.steps)
    tokens = cfg.batch_size * cfg.row_tokens * cfg.steps
    result = {
        "config": to_dict(cfg),
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "threads": torch.get_num_threads(),
        "levers": bench.levers,
        "tokens_per_s": tokens / seconds,
        "seconds_per_step": seconds / cfg.steps,
    }
    if cfg.data:  # padding excluded: what the loader delivered
        result["real_tokens"] = int(real_tokens)
        result["real_tokens_per_s"] = int(real_tokens) / seconds
    if device == "cuda":
        result["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
        result["mfu_bf16"] = mfu(head, cfg, tokens / seconds)
    else:
        result["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return result


def random_rows(cfg: BenchTrainConfig, hidden: int, device: str) -> Iterator[dict]:
    """One batch of random rows with the target's shapes, made once and given every step."""
    b, t, gen = cfg.batch_size, cfg.row_tokens, torch.Generator().manual_seed(0)
    batch = {
        "input_ids": torch.randint(0, cfg.draft_vocab_size, (b, t), generator=gen),
        "aux": torch.randn(b, t, 3 * hidden, generator=gen),
        "teacher": torch.randn(b, t, hidden, generator=gen),
        "positions": torch.arange(t).repeat(b, 1),
        "doc_ids": torch.zeros(b, t, dtype=torch.long),
        "loss_mask": torch.ones(b, t, dtype=torch.bool),
    }
    return itertools.repeat({k: v.to(device) for k, v in batch.items()})


def loader_rows(cfg: BenchTrainConfig, device: str) -> Iterator[dict[str, torch.Tensor]]:
    """Batches of ``cfg.data`` from the training loader, endlessly, on ``device`` under
    bench-train's keys."""
    from draftsmith.core.memory import evict
    from draftsmith.train.data import StatesDataModule

    module = StatesDataModule(
        cfg.data, row_tokens=cfg.row_tokens, batch_size=cfg.batch_size, val_fraction=0.0,
        num_workers=cfg.num_workers, order=cfg.order,
        dtype="bfloat16" if device == "cuda" else "float32",  # as training: autocast on GPU
    )  # fmt: skip
    if cfg.cold:
        evict(Path(cfg.data).glob("shard-*.safetensors"))
    names = {"aux_states": "aux", "teacher_states": "teacher", "position_ids": "positions"}
    while True:  # as training moves them: a side stream, then decoded on the device
        for batch in module.train_dataloader():
            batch = module.model_batch(module.copy(batch, torch.device(device)))
            yield {names.get(k, k): v for k, v in batch.items()}


def mfu(head: torch.nn.Module, cfg: BenchTrainConfig, tokens_per_s: float) -> float | None:
    """Model FLOPs utilisation: 6 * params * tokens per TTT step (+ attention ignored)."""
    peak = peak_tflops(torch.cuda.get_device_name())
    if peak is None:
        return None
    dense = sum(p.numel() for p in head.parameters() if p.requires_grad)
    flops_per_token = 6 * dense * cfg.ttt_steps
    return flops_per_token * tokens_per_s / (peak * 1e12)


def main(args: list[str] | None = None) -> int:
    return exit_code("draftsmith bench-train", lambda: _main(args))


def _main(args: list[str] | None) -> int:
    cfg = parse_config(BenchTrainConfig, args, prog="draftsmith bench-train")
    if cfg.steps < 1 or cfg.row_tokens < 1 or cfg.batch_size < 1 or cfg.ttt_steps < 1:
        raise ConfigError(
            f"steps={cfg.steps}, row_tokens={cfg.row_tokens}, batch_size={cfg.batch_size}, "
            f"ttt_steps={cfg.ttt_steps}: each must be at least 1"
        )
    if cfg.output:
        own = json_from("bench-train")
        check_output(cfg.output, "output", own, overwrite=cfg.overwrite, is_file=True)
    result = {"command": "bench-train", **run(cfg)}
    print(json.dumps(result, indent=2))
    if cfg.output:
        with open(cfg.output, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
