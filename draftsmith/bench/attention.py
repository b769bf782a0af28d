"""Time the TTT attention paths and torch.compile per TTT setting (the device benchmark of
``model.attention`` and ``model.compile``).

For each ``ttt_steps`` setting, each attention path and compile off/on, times full optimizer
steps (TTT unroll, chunked loss, backward, AdamW) of the EAGLE-3 head ``draftsmith train``
builds for the target, on one packed row of random states with the target's shapes, and
reports tokens/s, peak memory and the compiled step's gain over the eager one: the numbers
``drafters/attention/ttt_compile.py``'s ``COMPILE_GAIN`` table holds (paste ``compile_gain``).

    python -m draftsmith.bench.attention --model configs/targets/llama3.1-8b \\
        --random_weights true --ttt_steps [3,7] --attention [efficient,flex]
"""

from __future__ import annotations

import json
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch

from draftsmith.core.config import parse_config, to_dict
from draftsmith.core.errors import ConfigError, exit_code
from draftsmith.core.targets import read_target
from draftsmith.drafters import from_target_config
from draftsmith.drafters.attention.ttt import AttentionImpl, ttt_unroll
from draftsmith.drafters.attention.ttt_compile import compiled_unroll
from draftsmith.drafters.losses.loss import ttt_loss
from draftsmith.drafters.target.weights import load_target_weights


@dataclass
class BenchAttentionConfig:
    """Time TTT steps per attention path and compile setting (random states, real shapes)."""

    model: str = "smollm2-135m"
    """Target model (directory, hub id or short name)."""
    random_weights: bool = False
    """Random embeddings and lm_head with the target's shapes (a config.json is enough)."""
    ttt_steps: list[int] = field(default_factory=lambda: [3, 7])
    """The TTT settings to time."""
    attention: list[AttentionImpl] = field(default_factory=lambda: ["efficient", "flex"])
    """The attention paths to time (as ``model.attention``)."""
    compile: list[bool] = field(default_factory=lambda: [False, True])
    """Eager and/or compiled unroll (as ``model.compile`` off / on)."""
    row_tokens: int = 2048
    """Tokens per packed row."""
    draft_vocab_size: int = 32000
    """Draft vocabulary size."""
    train_lm_head: bool = False
    """Train the draft lm_head; false (frozen, the default of a large target) skips it."""
    steps: int = 5
    """Timed optimizer steps per setting (after two warm-up steps, which compile)."""


def time_setting(cfg: BenchAttentionConfig, ttt: int, attention: str, compiled: bool) -> dict:
    """Tokens/s and peak memory of ``cfg.steps`` optimizer steps at one setting."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    target = read_target(cfg.model)
    head = from_target_config(target.config, "eagle3", draft_vocab_size=cfg.draft_vocab_size)
    if cfg.random_weights:
        embed = torch.randn(target.vocab_size, target.hidden_size) * 0.02
        lm_head = torch.randn(target.vocab_size, target.hidden_size) * 0.02
    else:
        weights = load_target_weights(target)
        embed, lm_head = weights.embed, weights.lm_head
    head.set_embeddings(embed)
    head.set_draft_vocab(torch.arange(cfg.draft_vocab_size))
    teacher_w = lm_head[: cfg.draft_vocab_size].to(device)
    with torch.no_grad():
        head.lm_head.weight.copy_(teacher_w)
    head.lm_head.weight.requires_grad_(cfg.train_lm_head)
    head.to(device)
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=1e-4)
    t, gen = cfg.row_tokens, torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.draft_vocab_size, (1, t), generator=gen).to(device)
    aux = torch.randn(1, t, 3 * target.hidden_size, generator=gen).to(device)
    teacher = torch.randn(1, t, target.hidden_size, generator=gen).to(device)
    pos, doc = torch.arange(t, device=device)[None], torch.zeros(1, t, dtype=torch.long).to(device)
    mask = torch.ones(1, t, dtype=torch.bool, device=device)
    unroll = compiled_unroll() if compiled else ttt_unroll
    autocast = torch.autocast("cuda", torch.bfloat16) if device == "cuda" else nullcontext()

    def step() -> None:
        with autocast:
            states = unroll(head, ids, aux, pos, doc, ttt, attention)
            out = ttt_loss(states, head.logits_weight, teacher, teacher_w, mask, doc)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    start = time.perf_counter()
    step(), step()  # warm-up: the compiled graphs are built here
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    warmup = time.perf_counter() - start
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(cfg.steps):
        step()
    sync()
    seconds = time.perf_counter() - start
    row = {"ttt_steps": ttt, "attention": attention, "compile": compiled}
    row |= {"tokens_per_s": round(t * cfg.steps / seconds, 1), "warmup_s": round(warmup, 1)}
    if device == "cuda":
        row["peak_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    return row


def run(cfg: BenchAttentionConfig) -> dict:
    rows = []
    for ttt in cfg.ttt_steps:
        for attention in cfg.attention:
            for compiled in cfg.compile:
                rows.append(time_setting(cfg, ttt, attention, compiled))
                print(json.dumps(rows[-1]), file=sys.stderr)
    gain: dict[str, dict[int, float]] = {}
    for row in rows:
        if row["compile"]:
            same = (row["ttt_steps"], row["attention"])
            eager = next(r for r in rows if (r["ttt_steps"], r["attention"]) == same)
            if not eager["compile"]:
                speed = row["tokens_per_s"] / eager["tokens_per_s"] - 1
                gain.setdefault(row["attention"], {})[row["ttt_steps"]] = round(speed, 3)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {"config": to_dict(cfg), "device": device, "rows": rows, "compile_gain": gain}


def main(args: list[str] | None = None) -> int:
    return exit_code("bench_attention", lambda: _main(args))


def _main(args: list[str] | None) -> int:
    cfg = parse_config(BenchAttentionConfig, args, prog="bench_attention")
    if cfg.steps < 1 or cfg.row_tokens < 1 or min(cfg.ttt_steps, default=0) < 1:
        raise ConfigError(
            f"steps={cfg.steps}, row_tokens={cfg.row_tokens}, ttt_steps={cfg.ttt_steps}: "
            "each must be at least 1"
        )
    print(json.dumps(run(cfg), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
