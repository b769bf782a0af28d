"""``make bench-extract``: what capturing states costs, measured side by side in one run.

    draftsmith bench-extract [--data [mt_bench]] [--limit 80] [--max_new_tokens 256]

(a) plain vLLM generation of the replies; (b) the same replies written by the target
with capture on (draftsmith extract, regenerate), as an overhead ratio; (c) states of
the same token sequences captured by vLLM without generation, against Hugging Face
transformers ``output_hidden_states`` (how the original EAGLE and Model Optimizer dump
states); (d) bytes per token on disk for bf16 and fp8, and files per 1000 samples.
Engine start-up is timed separately and left out of every rate.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from draftsmith.core.config import parse_config
from draftsmith.core.errors import ConfigError, exit_code
from draftsmith.core.outputs import check_output
from draftsmith.extract.config import EngineOptions, ExtractConfig


@dataclass
class BenchConfig:
    """Time extraction against plain generation and against transformers."""

    model: str = "smollm2-135m"
    """Target model (as in `draftsmith extract`)."""
    data: list[str] = field(default_factory=lambda: ["mt_bench"])
    """Prompt sources (as in `draftsmith extract`)."""
    limit: int = 80
    """Number of prompts."""
    max_new_tokens: int = 256
    """Reply length cap."""
    output: str = "outputs/bench-extract"
    """Where the benchmark datasets and `results.json` go (an earlier bench-extract's output
    is replaced; anything else is refused, see `overwrite`)."""
    overwrite: bool = False
    """Replace `output` even if bench-extract did not write it (it is deleted first)."""
    engine: EngineOptions = field(default_factory=EngineOptions)
    """vLLM engine options."""


def _plain_generation(cfg: BenchConfig, prompts: list[list[int]]) -> dict:
    from vllm import SamplingParams

    from draftsmith.core.engine import close_engine, plain_engine
    from draftsmith.core.targets import resolve_model

    t0 = time.monotonic()
    llm = plain_engine(resolve_model(cfg.model), cfg.engine, 2048)
    start = time.monotonic() - t0
    params = SamplingParams(temperature=0.0, max_tokens=cfg.max_new_tokens)
    t0 = time.monotonic()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    seconds = time.monotonic() - t0
    close_engine(llm)
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {
        "engine_start_s": start,
        "seconds": seconds,
        "output_tokens": out_tokens,
        "output_tok_s": out_tokens / seconds,
        "texts": [o.outputs[0].text for o in outs],
    }


def _extract(cfg: ExtractConfig) -> dict:
    from draftsmith.extract.main import run

    t0 = time.monotonic()
    man = run(cfg)
    total = time.monotonic() - t0
    seconds = sum(s["seconds"] for s in man["shards"])
    files = len(list(Path(cfg.output).glob("shard-*")))
    disk = sum(s["bytes"] for s in man["shards"])
    return {
        "total_s": total,
        "seconds": seconds,
        "samples": man["num_samples"],
        "tokens": man["num_tokens"],
        "loss_tokens": man["num_loss_tokens"],
        "disk_bytes": disk,
        "disk_bytes_per_token": disk / man["num_tokens"],
        "files_per_1000_samples": 1000 * files / man["num_samples"],
    }


def _hf_forward(dataset: str) -> dict:
    from transformers import AutoModelForCausalLM

    from draftsmith.dataset.reader import open_dataset
    from draftsmith.extract.verify import reference_states

    ds = open_dataset(dataset)
    model = AutoModelForCausalLM.from_pretrained(
        ds.manifest["target"]["path"], dtype=torch.float32
    ).eval()
    tokens, t0 = 0, time.monotonic()
    for i in range(len(ds)):
        ids = ds[i]["input_ids"]
        reference_states(model, ids, ds.manifest["layer_ids"])
        tokens += len(ids)
    seconds = time.monotonic() - t0
    return {"seconds": seconds, "tokens": tokens, "tok_s": tokens / seconds}


def run_bench(cfg: BenchConfig) -> dict:
    from draftsmith.conversations.sources import SkipLog, load_many
    from draftsmith.conversations.template import render_prompt
    from draftsmith.core.targets import load_tokenizer, resolve_model

    out = Path(cfg.output)
    if out.exists():
        import shutil

        shutil.rmtree(out)
    out.mkdir(parents=True)
    tok = load_tokenizer(resolve_model(cfg.model))
    convs = load_many(cfg.data, require_assistant=False, skips=SkipLog(), limit=cfg.limit)
    prompts = [
        render_prompt(tok, [m for m in c.messages if m["role"] != "assistant"][:2]) for c in convs
    ]
    plain = _plain_generation(cfg, prompts)

    # (b) the same prompts, replies written with capture on.
    base = ExtractConfig(
        model=cfg.model,
        data=cfg.data,
        limit=cfg.limit,
        regenerate=True,
        max_new_tokens=cfg.max_new_tokens,
        max_length=2048,
        samples_per_shard=len(convs),
        engine=cfg.engine,
    )
    regen = _extract(replace(base, output=str(out / "regen-bf16")))

    # (c) the plain run's replies as fixed conversations: capture only, then transformers.
    chats = out / "plain-replies.jsonl"
    with chats.open("w") as f:
        for conv, text in zip(convs, plain["texts"], strict=True):
            user = [m for m in conv.messages if m["role"] == "user"][0]
            msgs = [user, {"role": "assistant", "content": text}]
            f.write(json.dumps({"messages": msgs}) + "\n")
    fixed = _extract(
        replace(
            base,
            data=[str(chats)],
            regenerate=False,
            dtype="fp8_e4m3",
            output=str(out / "fixed-fp8"),
        )
    )
    hf = _hf_forward(str(out / "fixed-fp8"))

    results = {
        "model": cfg.model,
        "prompts": len(convs),
        "a_plain_generation": {k: v for k, v in plain.items() if k != "texts"},
        "b_extract_regenerate_bf16": regen,
        "b_overhead_ratio": regen["seconds"] / plain["seconds"],
        "c_vllm_capture_only_fp8": {**fixed, "tok_s": fixed["tokens"] / fixed["seconds"]},
        "c_hf_output_hidden_states": hf,
        "c_speedup_vs_hf": (fixed["tokens"] / fixed["seconds"]) / hf["tok_s"],
        "d_bytes_per_token": {
            "bfloat16": regen["disk_bytes_per_token"],
            "fp8_e4m3": fixed["disk_bytes_per_token"],
        },
        "d_files_per_1000_samples": regen["files_per_1000_samples"],
    }
    (out / "results.json").write_text(json.dumps(results, indent=2))
    return results


def main(args: list[str] | None = None) -> int:
    return exit_code("draftsmith bench-extract", lambda: _main(args))


def _main(args: list[str] | None) -> int:
    cfg = parse_config(BenchConfig, args, prog="draftsmith bench-extract")
    if cfg.limit < 1 or cfg.max_new_tokens < 1:
        raise ConfigError(
            f"limit={cfg.limit}, max_new_tokens={cfg.max_new_tokens}: each must be at least 1"
        )
    own = ("results.json", "regen-*", "fixed-*")
    check_output(cfg.output, "output", own, overwrite=cfg.overwrite)
    r = run_bench(cfg)
    a, b = r["a_plain_generation"], r["b_extract_regenerate_bf16"]
    c, hf = r["c_vllm_capture_only_fp8"], r["c_hf_output_hidden_states"]
    print(f"prompts: {r['prompts']} ({cfg.data}), replies up to {cfg.max_new_tokens} tokens")
    print(
        f"(a) plain vLLM generation: {a['output_tokens']} tokens in {a['seconds']:.1f} s "
        f"= {a['output_tok_s']:.1f} output tok/s (engine start {a['engine_start_s']:.1f} s)"
    )
    print(
        f"(b) generation + capture: {b['seconds']:.1f} s for {b['tokens']} stored tokens: "
        f"overhead ratio {r['b_overhead_ratio']:.3f} (time with capture / plain)"
    )
    print(
        f"(c) vLLM capture only: {c['tok_s']:.0f} tok/s; transformers output_hidden_states: "
        f"{hf['tok_s']:.0f} tok/s; speedup {r['c_speedup_vs_hf']:.2f}x"
    )
    print(
        f"(d) bytes/token on disk: bf16 {r['d_bytes_per_token']['bfloat16']:.0f}, "
        f"fp8 {r['d_bytes_per_token']['fp8_e4m3']:.0f}; files per 1000 samples: "
        f"{r['d_files_per_1000_samples']:.1f}"
    )
    print(f"results: {cfg.output}/results.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
