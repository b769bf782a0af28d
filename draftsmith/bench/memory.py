"""Peak memory of one training step against the row length: does it grow linearly?

For each drafter kind and row length, one training step (the kind's objective: forward,
chunked loss, backward) of the head ``draftsmith train`` builds, on one packed row of random
states (one document, loss on its second half: no document boundary to skip keys by), and
the peak memory above what the process held before the step: on CPU the resident set's high
water mark (``VmHWM``, reset through ``/proc/self/clear_refs``; glibc maps every block of
64 KiB or more afresh, so the resident set follows the tensors alive), on CUDA
``max_memory_allocated``. Rows print as they finish, then the table (JSON) with each step's
bytes per token and the bytes each added token added since the previous length: flat when
memory grows linearly (a [T, T] tensor doubles it with every doubling of T).

    python -m draftsmith.bench.memory                       # the tiny target's shape, CPU
    python -m draftsmith.bench.memory --kinds [eagle3] --rows [2048,8192] --attention efficient
    python -m draftsmith.bench.memory --model smollm2-135m --storage_dtype bfloat16

It also prints what a sample costs on disk per token for the target (hidden states of the
tapped layers x the storage dtype, token ids and loss mask).
"""

from __future__ import annotations

import json
import re
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from draftsmith import drafters
from draftsmith.core.config import parse_config, to_dict
from draftsmith.core.errors import ConfigError, exit_code
from draftsmith.core.memory import map_large_allocations
from draftsmith.core.targets import read_target
from draftsmith.dataset.shards import TORCH_STORAGE_DTYPES, bytes_per_token

# The conftest tiny target (tests/conftest.py: TINY) with SmolLM2's vocabulary.
TINY = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=8, num_attention_heads=2,
            num_key_value_heads=1, head_dim=64, max_position_embeddings=65536,
            vocab_size=49152, rms_norm_eps=1e-5, rope_theta=10000.0)  # fmt: skip


@dataclass
class BenchMemoryConfig:
    """Peak memory of one training step per drafter kind and row length."""

    model: str | None = None
    """Target whose shape the head takes (directory, hub id or short name; its config.json is
    enough: weights are random). Null: the tests' tiny target (hidden 128, 8 layers)."""
    kinds: list[str] = field(default_factory=lambda: ["eagle3", "dflash"])
    """Drafter kinds to measure (``model.kind``)."""
    rows: list[int] = field(default_factory=lambda: [2048, 4096, 8192, 16384, 32768])
    """Row lengths (``data.row_tokens``)."""
    ttt_steps: int = 3
    """EAGLE-3's TTT steps."""
    attention: str = "auto"
    """``model.attention`` of the TTT kinds (``efficient`` shows the [T, T] mask's growth)."""
    draft_vocab_size: int = 2048
    """EAGLE-3's draft vocabulary (the tiny recipe's)."""
    sliding_window: int | None = None
    """``model.sliding_window`` of every kind (null: full attention)."""
    storage_dtype: str = "bfloat16"
    """Storage dtype for the bytes-on-disk line (float32, bfloat16, float16, fp8_e4m3)."""


class Trainee:
    """What a kind's objective reads of the training loop (``DraftModule``)."""

    def __init__(self, head: torch.nn.Module, lm_head: torch.Tensor) -> None:
        self.head, self.target_lm_head = head, lm_head
        self.training, self.device, self.sequence_shard = True, lm_head.device, None

    def teacher(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        x = batch["teacher_states"]
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def peak_tracker(device: str):
    """(reset, read): the peak bytes held since ``reset``, above what was held at it."""
    if device == "cuda":
        base = [0]

        def reset_cuda() -> None:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base[0] = torch.cuda.memory_allocated()

        return reset_cuda, lambda: torch.cuda.max_memory_allocated() - base[0]

    def status(key: str) -> int:
        text = open("/proc/self/status").read()
        return int(re.search(rf"{key}:\s+(\d+)", text).group(1)) * 1024

    held = [0]

    def reset_cpu() -> None:
        with open("/proc/self/clear_refs", "w") as f:  # the high water mark := the resident set
            f.write("5")
        held[0] = status("VmRSS")

    return reset_cpu, lambda: status("VmHWM") - held[0]


def build(kind: str, config: dict[str, Any], cfg: BenchMemoryConfig, device: str):
    """The kind's head for the target's shape, random target tensors, and the kind."""
    gen = torch.Generator().manual_seed(0)
    vocab, hidden = config["vocab_size"], config["hidden_size"]
    embed = torch.randn(vocab, hidden, generator=gen) * 0.02
    lm_head = (torch.randn(vocab, hidden, generator=gen) * 0.02).to(device)
    window = cfg.sliding_window
    options: dict[str, Any] = {} if window is None else {"sliding_window": window}
    n = config["num_hidden_layers"]
    if kind == "dflash":
        head = drafters.get("dflash").head_from_target(
            config, target_layer_ids=[1, n // 2, n - 3], mask_token_id=0, **options
        )
        options["num_anchors"] = 128
    else:
        qwen3 = {} if window is None else {"qk_norm": True}  # the head vLLM windows
        head = drafters.get(kind).head_from_target(
            config, draft_vocab_size=cfg.draft_vocab_size, num_aux_states=3, **options, **qwen3
        )
        head.set_draft_vocab(torch.arange(cfg.draft_vocab_size))
        options |= {"ttt_steps": cfg.ttt_steps, "attention": cfg.attention}
    head.set_embeddings(embed)
    drafter = drafters.make(kind, options)
    return drafter, Trainee(head.to(device), lm_head)


def row_batch(config: dict[str, Any], row: int, device: str) -> dict[str, torch.Tensor]:
    """One packed row of random states: one document, loss on its second half."""
    gen = torch.Generator().manual_seed(1)
    hidden = config["hidden_size"]
    pos = torch.arange(row)[None]
    batch = {
        "input_ids": torch.randint(1, config["vocab_size"], (1, row), generator=gen),
        "aux_states": torch.randn(1, row, 3 * hidden, generator=gen),
        "teacher_states": torch.randn(1, row, hidden, generator=gen),
        "position_ids": pos,
        "doc_ids": torch.zeros(1, row, dtype=torch.long),
        "loss_mask": pos >= row // 2,
    }
    return {k: v.to(device) for k, v in batch.items()}


def measure(kind: str, config: dict[str, Any], cfg: BenchMemoryConfig) -> list[dict]:
    """One row per length: the step's peak memory and seconds, after one warm-up step at
    the shortest length (one-time allocations: kernels' caches, the allocator's arenas)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    drafter, trainee = build(kind, config, cfg, device)

    def step(batch: dict[str, torch.Tensor]) -> None:
        loss, _ = drafter.loss(trainee, batch)
        loss.backward()
        trainee.head.zero_grad(set_to_none=True)

    step(row_batch(config, min(cfg.rows), device))
    reset, read = peak_tracker(device)
    out: list[dict] = []
    for row in sorted(cfg.rows):
        batch = row_batch(config, row, device)
        reset()
        start = time.perf_counter()
        step(batch)
        seconds, peak = time.perf_counter() - start, read()
        del batch
        line = {"kind": kind, "row_tokens": row, "peak_mib": round(peak / 2**20, 1),
                "bytes_per_token": round(peak / row), "step_s": round(seconds, 2)}  # fmt: skip
        if out:  # the growth since the previous length, per added token: flat when linear
            grew = peak - out[-1]["peak_mib"] * 2**20
            line["added_bytes_per_added_token"] = round(grew / (row - out[-1]["row_tokens"]))
        out.append(line)
        print(json.dumps(line), file=sys.stderr, flush=True)
    return out


def disk_bytes_per_token(config: dict[str, Any], storage_dtype: str) -> dict[str, Any]:
    """A stored sample's bytes per token: 4 tapped layers (EAGLE-3's three and the teacher's)
    (``dataset.shards.bytes_per_token``) and a 64k-token sample's size."""
    per_token = bytes_per_token(4, config["hidden_size"], storage_dtype)
    sample = round(per_token * 65536 / 2**20, 1)
    return {"layers": 4, "hidden_size": config["hidden_size"], "storage_dtype": storage_dtype,
            "bytes_per_token": per_token, "mib_per_64k_sample": sample}  # fmt: skip


def run(cfg: BenchMemoryConfig) -> dict:
    if not torch.cuda.is_available():
        map_large_allocations()  # before anything is allocated: RSS follows the live tensors
    config = dict(TINY) if cfg.model is None else read_target(cfg.model).config
    if cfg.model is not None:
        from draftsmith.core.targets import text_config

        config = text_config(config)
    rows = [line for kind in cfg.kinds for line in measure(kind, config, cfg)]
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    disk = disk_bytes_per_token(config, cfg.storage_dtype)
    return {"config": to_dict(cfg), "device": device, "rows": rows, "disk": disk}


def main(args: list[str] | None = None) -> int:
    return exit_code("bench_memory", lambda: _main(args))


def _main(args: list[str] | None) -> int:
    cfg = parse_config(BenchMemoryConfig, args, prog="bench_memory")
    unknown = [k for k in cfg.kinds if k not in ("eagle3", "dflash")]
    if unknown or min(cfg.rows, default=0) < 1 or cfg.storage_dtype not in TORCH_STORAGE_DTYPES:
        raise ConfigError(
            f"kinds={cfg.kinds}, rows={cfg.rows}, storage_dtype={cfg.storage_dtype!r}: kinds "
            f"of eagle3 / dflash, rows >= 1, storage_dtype one of {sorted(TORCH_STORAGE_DTYPES)}"
        )
    print(json.dumps(run(cfg), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
