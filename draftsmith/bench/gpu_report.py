"""``bench-gpu``'s figures as a markdown page: training rows, the levers, profiles, the
loader."""

from __future__ import annotations

from pathlib import Path


def pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def num(x: float | None, spec: str = ",.0f") -> str:
    return "-" if x is None else format(x, spec)


def label(row: dict) -> str:
    return f"{row['trainer']}, {Path(row['target']).name}, TTT {row['ttt']}, {row['lm_head']}"


def levers_text(levers: dict | None) -> str:
    """What a row's speed levers resolved to, e.g. "fused loss, efficient, compiled"."""
    if not levers:
        return "-"
    loss = "fused loss" if levers["fused_loss"] else "torch loss"
    return f"{loss}, {levers['attention']}, {'compiled' if levers['compile'] else 'eager'}"


def speedup(row: dict, rows: list[dict]) -> str:
    """draftsmith's tok/s over speculators' at the same shape and TTT (frozen lm_heads)."""
    if row["trainer"] != "draftsmith" or row["lm_head"] != "frozen" or row["status"] != "ok":
        return "-"
    for other in rows:
        same = (other["target"], other["ttt"]) == (row["target"], row["ttt"])
        if other["trainer"] == "speculators" and same and other["status"] == "ok":
            return f"{row['tokens_per_s'] / other['tokens_per_s']:.2f}x"
    return "-"


def training_table(result: dict) -> list[str]:
    cuda = result["device"] != "cpu"
    memory = "peak GiB" if cuda else "peak RSS GiB (process)"
    lines = [
        f"| trainer, shape, TTT, lm_head | levers | tok/s | MFU 6NT | MFU hw | {memory} "
        "| matmul | attention | other | busy | vs speculators |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        levers = levers_text(row.get("levers"))
        if row["status"] != "ok":
            lines.append(f"| {label(row)} | {levers} | {row['status']} | | | | | | | | |")
            continue
        prof = row.get("profile") or {}
        gib = row.get("peak_memory_gib", row.get("peak_rss_gib"))
        lines.append(
            f"| {label(row)} | {levers} | {num(row['tokens_per_s'])} | {pct(row['mfu_6nt'])} "
            f"| {pct(row['mfu_hw'])} | {num(gib, '.1f')} | {pct(prof.get('matmul_share'))} "
            f"| {pct(prof.get('attention_share'))} | {pct(prof.get('other_share'))} "
            f"| {pct(prof.get('busy'))} | {speedup(row, result['rows'])} |"
        )
    return lines


def levers_table(result: dict) -> list[str]:
    """One row per lever configuration and TTT; ``x old`` is the speed over ``old``'s."""
    levers = result.get("levers") or []
    if not levers:
        return []
    memory = "peak GiB" if result["device"] != "cpu" else "peak RSS GiB (process)"
    first = levers[0]
    lines = [
        "",
        f"## Speed levers ({Path(first['target']).name}, lm_head {first['lm_head']})",
        "",
        "Asked: the options given (fused_loss, attention, compile); resolved: what a step "
        "runs for them here; (main row): the main table's run of the same row. x old: tok/s "
        "over the old path's at the same TTT. warm-up s: the untimed first steps, compiling "
        "included.",
        "",
        f"| configuration | TTT | asked | resolved | tok/s | MFU 6NT | {memory} | matmul "
        "| x old | warm-up s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in levers:
        o = r["options"]
        asked = f"{o['fused_loss']}, {o['attention']}, {o['compile']}"
        resolved = levers_text(r.get("levers"))
        name = r["config"] + (" (main row)" if r.get("same_run_as") else "")
        head = f"| {name} | {r['ttt']} | {asked} | {resolved}"
        if r["status"] != "ok":
            lines.append(f"{head} | {r['status']} | | | | | |")
            continue
        gib = r.get("peak_memory_gib", r.get("peak_rss_gib"))
        share = (r.get("profile") or {}).get("matmul_share")
        x = "-" if r.get("x_old") is None else f"{r['x_old']:.2f}x"
        lines.append(
            f"{head} | {num(r['tokens_per_s'])} | {pct(r['mfu_6nt'])} | {num(gib, '.1f')} "
            f"| {pct(share)} | {x} | {num(r.get('warmup_s'), '.1f')} |"
        )
    return lines


def profile_tables(result: dict) -> list[str]:
    lines: list[str] = []
    for row in result["rows"]:
        prof = row.get("profile")
        if not prof:
            continue
        lines += [
            "",
            f"### {label(row)}",
            "",
            f"{prof['steps']} steps, {prof['clock']}: busy {num(prof['busy_s'], '.3f')} s of "
            f"{num(prof['wall_s'], '.3f')} s wall; matmul {pct(prof['matmul_share'])}, "
            f"attention {pct(prof['attention_share'])}, other {pct(prof['other_share'])}.",
            "",
            "| op | share | ms/step |",
            "|---|---|---|",
        ]
        lines += [
            f"| `{op['op']}` | {pct(op['share'])} | {num(op['ms_per_step'], ',.2f')} |"
            for op in prof["top_ops"]
        ]
    return lines


def loader_table(loader: dict) -> list[str]:
    if loader.get("status", "ok") != "ok" and "passes" not in loader:
        return ["", "## Loader", "", f"loader: {loader['status']}"]
    shape = loader["shape"]
    gpu = loader.get("gpu_tokens_per_s")
    lines = [
        "",
        "## Loader (shard order, bf16 shards)",
        "",
        f"{Path(shape['target']).name}: layers {shape['layer_ids']} x hidden "
        f"{shape['hidden_size']}, rows of {loader['config']['row_tokens']}; {loader['cpus']} "
        f"CPUs. The GPU rate to feed (draftsmith, TTT {loader.get('gpu_ttt') or '-'}, frozen "
        f"lm_head): {num(gpu)} tok/s.",
        "",
        "| workers | cache | tokens | tok/s | x GPU rate | MB/s | x raw | 1st batch s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for p in loader["passes"]:
        x = "-" if p.get("x_gpu") is None else f"{p['x_gpu']:.2f}x"
        raw = "-" if p.get("x_raw") is None else f"{p['x_raw']:.2f}"
        lines.append(
            f"| {p['workers']} | {p['cache']} | {p['tokens']:,} | {num(p['tokens_per_s'])} "
            f"| {x} | {num(p['disk_mb_per_s'])} | {raw} | {p['first_batch_s']:.2f} |"
        )
    for r in loader.get("raw_reads", []):
        lines.append(f"\nraw sequential read, {r['cache']}: {num(r['mb_per_s'])} MB/s")
    for b in loader.get("breakdown", []):
        parts = ", ".join(f"{k} {v / b['seconds']:.0%}" for k, v in b["phases_s"].items())
        lines.append(f"\nin-process pass, {b['cache']} ({num(b['tokens_per_s'])} tok/s): {parts}")
    return lines


def end_to_end_table(rows: list[dict]) -> list[str]:
    lines = [
        "",
        "## End to end: the step with the loader in front",
        "",
        "| target | TTT | workers | tok/s | real tok/s | step only tok/s | x step |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r.get("status") != "ok":
            lines.append(f"| {Path(r['target']).name} | {r['ttt']} | {r['workers']} | "
                         f"{r.get('status')} | | | |")  # fmt: skip
            continue
        x = "-" if r.get("x_step") is None else f"{r['x_step']:.2f}x"
        lines.append(
            f"| {Path(r['target']).name} | {r['ttt']} | {r['workers']} | {num(r['tokens_per_s'])}"
            f" | {num(r['real_tokens_per_s'])} | {num(r.get('step_only_tokens_per_s'))} | {x} |"
        )
    return lines


def markdown(result: dict) -> str:
    """The whole page."""
    cfg = result["config"]
    peak = result["peak_tflops"]
    peak_line = (
        f"MFU against {peak:g} TFLOP/s bf16 dense ({result['peak_source']})"
        if peak
        else "MFU: no peak known for this device (give --peak_tflops)"
    )
    lines = [
        f"# bench-gpu: {result['device']}",
        "",
        f"{result['date']}, torch {result['torch']}, commit {result['commit'] or '-'}. Rows of "
        f"{cfg['row_tokens']} tokens, draft vocabulary {cfg['draft_vocab_size']:,}, random "
        f"weights, {cfg['steps']} timed steps after {cfg.get('warmup_steps', 1)} warm-up "
        f"steps. Main rows: the speed levers as asked (fused_loss {cfg.get('fused_loss', '-')}, "
        f"attention {cfg['attention']}, compile {cfg.get('compile', '-')}), the levers "
        f"column says what they resolved to. {peak_line}; 6NT = 6 x "
        "trainable params x TTT per token, hw adds the frozen lm_head's forward and input "
        "gradient and the teacher's logits (draftsmith/bench/flops.py).",
        "",
        "## Training",
        "",
        *training_table(result),
        *levers_table(result),
        "",
        "## Where the time goes (torch.profiler, top 10 ops by own time)",
        *profile_tables(result),
    ]
    if "loader" in result:
        lines += loader_table(result["loader"])
    if result.get("end_to_end"):
        lines += end_to_end_table(result["end_to_end"])
    return "\n".join(lines) + "\n"
