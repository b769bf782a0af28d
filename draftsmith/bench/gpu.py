"""`draftsmith bench-gpu`: the device benchmark of GPU training in one call (issue 43).

For each target shape (random weights from ``configs/targets/*``), TTT setting and lm_head
(frozen, trained), one ``bench-train`` row: tokens/s, MFU two ways (``flops.py``: 6NT, and
the hardware's FLOPs with the frozen lm_head's forward and input gradient), peak memory and
a torch.profiler summary (``bench_profile.py``: matmul kernels against the rest, top 10
ops), under the speed levers' auto settings and the levers they resolved to. Then the levers
table: at the first target's shape, frozen lm_head, per TTT, the path before the levers
(``old``: torch loss, efficient attention, eager), each lever alone (``fused``, ``flex``,
``compile``), all of them, and ``auto`` where it differs, with the speed ratio to ``old``.
Then the training loader in shard order at the first target's shape with each worker
count, against the rate of the frozen head at the smallest TTT (3: the fastest step, the
hardest to feed), that step again with the loader in front of it (``gpu_loader.py``:
end-to-end tok/s beside the step-only figure), and last speculators' EAGLE-3 model at the
same shapes and TTT (``bench_speculators.py``; a row says so when speculators is missing).
Writes ``bench-gpu.json`` and ``bench-gpu.md`` to ``output`` ($OUT on the device machine),
again after every row, so a run cut short by its time limit still returns the rows it made.

    tools/bench_gpu.sh                         # on the device: carried wheels, then this
    draftsmith bench-gpu --ttt_steps '[7]' --lm_heads '[frozen]' --speculators false

Rows run one after another in this process; each frees its memory before the next, and a
row that fails (out of memory, a compile error) records its error, one that is refused (a
lever that cannot run on this device) its one-line reason, and the rest still run.
"""

from __future__ import annotations

import gc
import os
import resource
import sys
import traceback
from collections.abc import Callable
from datetime import UTC, datetime
from functools import partial
from pathlib import Path

import torch

from draftsmith.bench import speculators as bench_speculators
from draftsmith.bench.flops import StepFlops, peak_tflops
from draftsmith.bench.gpu_config import (
    COMPILE_ON_CPU,
    LEVER_OPTIONS,
    LEVERS,
    OWN,
    BenchGpuConfig,
    Options,
    check_config,
)
from draftsmith.bench.gpu_loader import end_to_end_rows, loader_rows
from draftsmith.bench.gpu_report import markdown
from draftsmith.bench.profile import profile_steps
from draftsmith.bench.train import (
    BenchTrainConfig,
    Prepared,
    prepare,
    resolve_levers,
    time_steps,
)
from draftsmith.core.config import parse_config, to_dict
from draftsmith.core.errors import ConfigError, exit_code
from draftsmith.core.files import write_json_atomic
from draftsmith.core.outputs import check_output


def output_dir(cfg: BenchGpuConfig) -> Path:
    return Path(cfg.output or os.environ.get("OUT") or "outputs/bench-gpu")


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def allow_recompiles(limit: int = 64) -> None:
    """Rows of other shapes, TTT settings and attention paths recompile the one compiled
    unroll (and flex attention); past dynamo's limit (8) it runs eagerly without a word, and
    a compile row would time eager code."""
    import torch._dynamo.config as dynamo

    name = "recompile_limit" if hasattr(dynamo, "recompile_limit") else "cache_size_limit"
    setattr(dynamo, name, max(getattr(dynamo, name), limit))


def measure(bench: Prepared, flops: StepFlops, cfg: BenchGpuConfig, peak: float | None) -> dict:
    """Time, then profile, ``bench``'s step; the figures of one row."""
    start_gib = torch.cuda.memory_allocated() / 2**30 if bench.device == "cuda" else None
    seconds = time_steps(bench, cfg.steps, cfg.warmup_steps)
    tokens_per_s = cfg.row_tokens * cfg.steps / seconds
    row = {
        "status": "ok",
        **({"levers": bench.levers} if bench.levers else {}),
        "tokens_per_s": tokens_per_s,
        "seconds_per_step": seconds / cfg.steps,
        "warmup_s": bench.warmup_s,
        "trainable_params": flops.trainable_params,
        "flops_per_token_6nt": flops.model,
        "flops_per_token_hw": flops.hardware,
        **flops.mfu(tokens_per_s, peak),
    }
    if bench.device == "cuda":
        row["allocated_at_start_gib"] = start_gib
        row["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    else:  # the process's peak so far: no per-row figure on CPU
        row["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    if cfg.profile_steps:
        row["profile"] = profile_steps(bench.step, cfg.profile_steps, bench.device)
    return row


def trainable(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters() if p.requires_grad)


def train_config(
    cfg: BenchGpuConfig, target: str, ttt: int, lm_head: str, options: Options
) -> BenchTrainConfig:
    """The bench-train configuration of a row; ``options``: (fused_loss, attention, compile)."""
    fused, attention, compile_ = options
    return BenchTrainConfig(
        model=target, ttt_steps=ttt, row_tokens=cfg.row_tokens,
        draft_vocab_size=cfg.draft_vocab_size, train_lm_head=lm_head == "trained",
        random_weights=True, steps=cfg.steps, loss_chunk_size=cfg.loss_chunk_size,
        attention=attention, fused_loss=fused, compile=compile_,
    )  # fmt: skip


def train_row(cfg: BenchGpuConfig, bcfg: BenchTrainConfig, peak: float | None) -> dict:
    bench = prepare(bcfg)
    lm = bench.head.logits_weight.numel()
    frozen = 0 if bcfg.train_lm_head else lm
    teacher = cfg.draft_vocab_size * bench.hidden_size
    flops = StepFlops(trainable(bench.head), frozen, teacher, bcfg.ttt_steps)
    return measure(bench, flops, cfg, peak)


def main_options(cfg: BenchGpuConfig) -> Options:
    return (cfg.fused_loss, cfg.attention, cfg.compile)


def draftsmith_row(cfg: BenchGpuConfig, target: str, ttt: int, lm_head: str, peak) -> dict:
    """A main row: the levers as ``cfg`` sets them (auto by default)."""
    return train_row(cfg, train_config(cfg, target, ttt, lm_head, main_options(cfg)), peak)


def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def lever_row(cfg: BenchGpuConfig, name: str, target: str, ttt: int, peak) -> dict:
    """A levers-table row (frozen lm_head). A fused loss ``on`` where it cannot run is
    refused before the head is built, flex's missing CPU backward at its first step."""
    bcfg = train_config(cfg, target, ttt, "frozen", LEVERS[name])
    levers = resolve_levers(bcfg, device())
    if levers["compile"] and device() == "cpu":
        return {"status": COMPILE_ON_CPU, "levers": levers}
    return train_row(cfg, bcfg, peak)


def auto_shortcut(cfg: BenchGpuConfig, target: str, ttt: int, rows: list[dict]) -> dict | None:
    """The ``auto`` lever row without running it where that is known: the main row of the
    same shape, TTT and frozen lm_head when the main rows run auto, or a skip where auto
    resolves to the levers of ``all``. None: run it."""
    if main_options(cfg) == LEVERS["auto"]:
        for r in rows:
            same = (r["trainer"], r["target"], r["ttt"], r["lm_head"])
            if same == ("draftsmith", target, ttt, "frozen") and r["status"] == "ok":
                figures = {k: v for k, v in r.items() if k not in ("trainer", "target", "ttt")}
                return {**figures, "same_run_as": "the main row"}
    if "all" in cfg.levers:
        try:
            resolved = [
                resolve_levers(train_config(cfg, target, ttt, "frozen", LEVERS[n]), device())
                for n in ("auto", "all")
            ]
        except ConfigError:  # 'all' cannot run here: auto differs
            return None
        if resolved[0] == resolved[1]:
            return {"status": "skipped: auto resolves to the levers of 'all' here"}
    return None


def resolved_or_none(cfg: BenchGpuConfig, name: str, target: str, ttt: int) -> dict | None:
    """What configuration ``name`` resolves to here; None where it is refused outright."""
    try:
        return resolve_levers(train_config(cfg, target, ttt, "frozen", LEVERS[name]), device())
    except ConfigError:
        return None


def lever_ratios(levers: list[dict]) -> None:
    """Each lever row's ``x_old``: its tok/s over the ``old`` row's at the same TTT."""
    old = {r["ttt"]: r for r in levers if r["config"] == "old" and r["status"] == "ok"}
    for r in levers:
        base = old.get(r["ttt"])
        ok = base is not None and r["status"] == "ok"
        r["x_old"] = r["tokens_per_s"] / base["tokens_per_s"] if ok else None


def speculators_row(cfg: BenchGpuConfig, target: str, ttt: int, peak) -> dict:
    bench = bench_speculators.prepare(
        target, ttt, cfg.row_tokens, cfg.draft_vocab_size, compile=cfg.speculators_compile
    )
    model = bench.head
    lm, teacher = model.lm_head.weight, model.verifier_lm_head.weight
    frozen = 0 if lm.requires_grad else lm.numel()
    flops = StepFlops(trainable(model), frozen, teacher.numel(), ttt)
    row = measure(bench, flops, cfg, peak)
    row["speculators_version"] = bench_speculators.version()
    row["compiled"] = cfg.speculators_compile
    return row


def guarded(run: Callable[[], dict], label: str) -> dict:
    """``run()``, or a row recording why it failed; memory is freed either way."""
    print(f"bench-gpu: {label} ...", flush=True)
    try:
        row = run()
    except ConfigError as error:  # refused on this device: its one line says why
        row = {"status": f"refused: {str(error).splitlines()[0][:300]}"}
    except Exception as error:  # one row's failure (OOM, compile) must not end the run
        traceback.print_exc()
        row = {"status": f"failed: {type(error).__name__}: {str(error).splitlines()[0][:300]}"}
    free_memory()
    print(f"bench-gpu: {label}: {row.get('status')} {row.get('tokens_per_s', '')}", flush=True)
    return row


def speculators_missing() -> str | None:
    """Why speculators' rows cannot run here, or None when it imports."""
    if bench_speculators.version() is None:
        return "speculators is not installed (make device-wheels carries it to the device)"
    try:
        import speculators.models.eagle3  # noqa: F401
    except Exception as error:  # a missing dependency of it, say
        return f"speculators does not import: {type(error).__name__}: {error}"
    return None


def run(cfg: BenchGpuConfig, save: Callable[[dict], None] | None = None) -> dict:
    """Every row of ``cfg``; ``save(result)`` after each (a run cut short keeps its rows)."""
    check_config(cfg)
    cuda = torch.cuda.is_available()
    device_name = torch.cuda.get_device_name() if cuda else "cpu"
    peak = peak_tflops(device_name, cfg.peak_tflops)
    allow_recompiles()
    rows: list[dict] = []
    levers: list[dict] = []
    result = {
        "command": "bench-gpu",
        "config": to_dict(cfg),
        "device": device_name,
        "torch": torch.__version__,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "commit": commit(),
        "peak_tflops": peak,
        "peak_source": "--peak_tflops" if cfg.peak_tflops is not None else "flops.py table",
        "rows": rows,
        "levers": levers,
    }

    def add(key: dict, row: dict) -> None:
        rows.append({**key, **row})
        if save:
            save(result)

    for target in cfg.targets:
        for ttt in cfg.ttt_steps:
            for lm_head in cfg.lm_heads:
                key = {"trainer": "draftsmith", "target": target, "ttt": ttt, "lm_head": lm_head}
                label = f"draftsmith {Path(target).name} TTT {ttt} {lm_head}"
                add(key, guarded(partial(draftsmith_row, cfg, target, ttt, lm_head, peak), label))
    lever_target = cfg.levers_target or cfg.targets[0]
    for ttt in cfg.levers_ttt_steps if cfg.levers else []:
        for name in cfg.levers:
            options = dict(zip(LEVER_OPTIONS, LEVERS[name], strict=True))
            key = {"config": name, "target": lever_target, "ttt": ttt, "lm_head": "frozen"}
            row = auto_shortcut(cfg, lever_target, ttt, rows) if name == "auto" else None
            if row is None:
                label = f"levers {name} {Path(lever_target).name} TTT {ttt}"
                row = guarded(partial(lever_row, cfg, name, lever_target, ttt, peak), label)
                row.setdefault("levers", resolved_or_none(cfg, name, lever_target, ttt))
            levers.append({**key, "options": options, **row})
            lever_ratios(levers)
            if save:
                save(result)
    if cfg.loader:
        loader = guarded(lambda: loader_rows(cfg), "loader, shard order")
        shape = cfg.loader_target or cfg.targets[0]
        fed = [r for r in rows if r["trainer"] == "draftsmith" and r["lm_head"] == "frozen"
               and r["target"] == shape and r["status"] == "ok"]  # fmt: skip
        base = min(fed, key=lambda r: r["ttt"], default=None)  # TTT 3: the fastest to feed
        loader["gpu_ttt"] = base["ttt"] if base else None
        loader["gpu_tokens_per_s"] = base["tokens_per_s"] if base else None
        for p in loader.get("passes", []):
            p["x_gpu"] = p["tokens_per_s"] / base["tokens_per_s"] if base else None
        result["loader"] = loader
        if save:
            save(result)
        if cfg.end_to_end:
            e2e = end_to_end_rows(cfg, loader, rows, main_options(cfg), peak, guarded)
            result["end_to_end"] = e2e
            if save:
                save(result)
    if cfg.speculators:
        missing = speculators_missing()
        for target in cfg.targets:
            for ttt in cfg.ttt_steps:
                key = {"trainer": "speculators", "target": target, "ttt": ttt, "lm_head": "frozen"}
                label = f"speculators {Path(target).name} TTT {ttt}"
                run_row = partial(speculators_row, cfg, target, ttt, peak)
                add(key, {"status": f"skipped: {missing}"} if missing else guarded(run_row, label))
    return result


def commit() -> str | None:
    """$DRAFTSMITH_COMMIT, else the checked-out commit where git and the repository are at
    hand (the device machine gets the tree without its history)."""
    import subprocess

    if os.environ.get("DRAFTSMITH_COMMIT"):
        return os.environ["DRAFTSMITH_COMMIT"]

    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=10, check=True)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def main(args: list[str] | None = None) -> int:
    def go() -> int:
        cfg = parse_config(BenchGpuConfig, args, prog="draftsmith bench-gpu")
        check_config(cfg)
        out = output_dir(cfg)
        check_output(out, "output", OWN, overwrite=cfg.overwrite)
        out.mkdir(parents=True, exist_ok=True)

        def save(result: dict) -> None:
            write_json_atomic(out / "bench-gpu.json", result)
            (out / "bench-gpu.md").write_text(markdown(result))

        table = markdown(run(cfg, save))
        print(table, flush=True)
        print(f"figures: {out / 'bench-gpu.json'}, {out / 'bench-gpu.md'}")
        return 0

    return exit_code("draftsmith bench-gpu", go)


if __name__ == "__main__":
    sys.exit(main())
