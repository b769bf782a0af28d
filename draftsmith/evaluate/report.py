"""The evaluate stage's report: report.md, a terminal table and W&B (plots: ``plots.py``).

Acceptance length is ``1 + accepted / drafts``; tokens per step is output tokens per target
verification step. Both stand side by side everywhere: ngram drafts only where it finds a
match in the prompt, so its acceptance length alone flatters it.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

from draftsmith.evaluate.plots import write_plots
from draftsmith.evaluate.report_checks import (
    DASH,
    SIMULATED,
    VERDICTS,
    argmax_lines,
    expected_lines,
    fmt,
    not_served_line,
    sampling_lines,
)

ORDER = ("none", "ngram", "suffix", "target_mtp", "draft_model", "eagle", "eagle3", "peagle")
ORDER += ("dflash", "mtp")
COLUMNS = ("method", "k", "acceptance length", "tokens/step", "per-position acceptance")
COLUMNS += ("output tok/s", "speedup vs none", "speedup vs ngram", "lossless")
NUMBERS = ("acceptance_length", "tokens_per_step", "output_tok_s")
NUMBERS += ("speedup_vs_none", "speedup_vs_ngram", "derived_from_k")
MAX_MISMATCHES = 20  # listed per run in report.md; generations.jsonl has them all


def per_position_text(run: dict) -> str:
    """Per-position acceptance rates as ``0.75 / 0.38 / 0.13``."""
    return " / ".join(fmt(p, 2) for p in run["per_position"]) if run.get("per_position") else DASH


def lossless_text(run: dict) -> str:
    """Identical greedy outputs out of those compared, as ``79/80``; under the argmax rule
    (a bfloat16 target on vLLM-CPU) replies whose every token is the target's top logit,
    as ``8/8 top logit (3 identical)``."""
    ll = run.get("lossless")
    if ll and ll.get("rule") == "argmax":
        return f"{ll['top_logit']}/{ll['compared']} top logit ({ll['identical']} identical)"
    return f"{ll['identical']}/{ll['compared']}" if ll else DASH


def cells(run: dict) -> list[str]:
    """One run's row under COLUMNS; derived rows carry acceptance only."""
    derived = run.get("derived_from_k") is not None
    k = DASH if run["k"] is None else f"{run['k']}*" if derived else str(run["k"])

    def timing(key: str, digits: int, suffix: str = "") -> str:
        return DASH if derived else fmt(run.get(key), digits, suffix)

    return [
        run["method"] + (" (simulated)" if run.get("simulated") else ""),
        k,
        fmt(run.get("acceptance_length"), 3),
        fmt(run.get("tokens_per_step"), 3),
        per_position_text(run),
        timing("output_tok_s", 1),
        timing("speedup_vs_none", 2, "×"),
        timing("speedup_vs_ngram", 2, "×"),
        lossless_text(run),
    ]


def sorted_runs(results: dict) -> list[dict]:
    """Runs by dataset (first appearance), temperature, method (baselines first), k."""
    datasets = list(dict.fromkeys(r["dataset"] for r in results["runs"]))

    def key(r: dict) -> tuple:
        m = ORDER.index(r["method"]) if r["method"] in ORDER else len(ORDER)
        return datasets.index(r["dataset"]), r["temperature"], m, r["method"], r["k"] or 0

    return sorted(results["runs"], key=key)


def footnotes(runs: list[dict]) -> list[str]:
    """One line per larger k that derived rows came from."""
    sources = sorted({r["derived_from_k"] for r in runs if r.get("derived_from_k") is not None})
    return [
        f"\\* derived from the k={k} run's per-position counters: acceptance only, no timing."
        for k in sources
    ]


def best_k(runs: list[dict]) -> str | None:
    """One line: each speculative method at the k that gave it the most tokens/s (timed
    runs only; derived k's have no timing), beside no speculation."""
    best: dict[str, dict] = {}
    for r in runs:
        if r["method"] != "none" and r.get("output_tok_s"):
            if r["method"] not in best or r["output_tok_s"] > best[r["method"]]["output_tok_s"]:
                best[r["method"]] = r
    if not best:
        return None
    none = next((r for r in runs if r["method"] == "none" and r.get("output_tok_s")), None)
    parts = [
        f"{m} k={r['k']} {r['output_tok_s']:.1f} tok/s"
        + (f" ({r['speedup_vs_none']:.2f}x none)" if r.get("speedup_vs_none") else "")
        for m, r in best.items()
    ]
    base = f"; none {none['output_tok_s']:.1f} tok/s" if none else ""
    temperature = float(next(iter(best.values()))["temperature"])
    return f"Best k by tokens/s at temperature {temperature}: " + ", ".join(parts) + base + "."


def summary_table(results: dict) -> str:
    """A compact plain-text table for the terminal: one row per run."""
    header = ["dataset", "temp", "method", "k", "acc len", "tok/step", "per position", "tok/s"]
    header += ["vs none", "vs ngram", "lossless"]
    rows = [[r["dataset"], str(float(r["temperature"])), *cells(r)] for r in sorted_runs(results)]
    widths = [max(map(len, col)) for col in zip(header, *rows, strict=True)]

    def line(row: list[str]) -> str:
        return "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()

    notes = [n.removeprefix("\\") for n in footnotes(results["runs"])]
    for r in sorted_runs(results):
        if e := r.get("expected"):
            verdict = VERDICTS[e["flag"]].replace("*", "")
            notes.append(
                f"{r['dataset']} T={float(r['temperature'])} {r['method']} k={r['k']}: served "
                f"{fmt(e['served_per_draft'], 3)} accepted per draft, expected "
                f"{fmt(e['expected_per_draft'], 3)} ({verdict})"
            )
    checks = results.get("sampling_check") or []
    if checks:
        failed = sum(not c["passed"] for c in checks)
        notes.append(f"sampling check: {len(checks) - failed}/{len(checks)} passed")
    notes += [f"WARNING: {line}" for line in results.get("vllm_defects") or []]
    if gone := not_served_line(results):
        notes.append(gone.replace("**", "").replace("`", ""))
    table = [line(header), line(["-" * w for w in widths]), *map(line, rows), *notes]
    return "\n".join([setup_line(results), *table])


def summary_of(eval_dir: Path, fresh: bool) -> str:
    """What ``draftsmith pipeline`` prints last about a finished evaluation in ``eval_dir``:
    where its report and plots are, after the table when this run did not print it already
    (``fresh``: the evaluation ran in this run)."""
    from draftsmith.core.readers import read_json

    results = eval_dir / "results.json"
    if not results.is_file():
        return ""
    plots = ", ".join(sorted(p.name for p in eval_dir.glob("*.png")))
    where = f"report: {eval_dir / 'report.md'} (plots: {plots or 'none'})"
    if fresh:
        return where
    rerun = f"delete {eval_dir} and run the pipeline again"
    return summary_table(read_json(results, "stage record", rerun, keys=("runs",))) + "\n" + where


def setup_line(results: dict) -> str:
    """What every row was measured on: the reply length and the prompts per set."""
    cfg = results.get("config") or {}
    prompts: dict[str, int] = {}
    for r in results["runs"]:
        prompts.setdefault(r["dataset"], r["prompts"])
    sets = ", ".join(f"{d} {n}" for d, n in prompts.items())
    return (f"replies up to {cfg.get('max_tokens', '?')} tokens; prompts per set: {sets}; "
            f"{cfg.get('concurrency', '?')} in flight")  # fmt: skip


def markdown(results: dict, plots: list[str]) -> str:
    """report.md's text: setup, one table per (dataset, temperature), mismatches, plots."""
    target, head, cfg = results["target"], results.get("head"), results.get("config") or {}
    name = Path(head["path"]).name if head else "baselines"
    head_desc = f"`{head['path']}` ({head['method']})" if head else "none"
    lines = [
        f"# draftsmith eval: {name} on {Path(target['path']).name}",
        "",
        f"**Setup:** target `{target['path']}` ({target.get('architecture', '?')}) · "
        f"head {head_desc} · vLLM {results.get('vllm_version', '?')} · "
        f"{results.get('device', '?')} · {results.get('created', '?')}",
        "",
        ", ".join(
            f"{key} {cfg[key]}" for key in ("mode", "concurrency", "max_tokens") if key in cfg
        )
        + ". Acceptance length = 1 + accepted / drafts; "
        "tokens/step = output tokens per target verification step (compare methods on this: "
        "ngram drafts only where it finds a match, which flatters its acceptance length).",
    ]
    for line in results.get("vllm_defects") or []:
        lines += ["", f"**Warning: {line}.** Only the temperature 0 tables stand."]
    if line := not_served_line(results):
        lines += ["", line]
    if head and results.get("draft_sample_method"):
        lines += ["", f"Drafts drawn {results['draft_sample_method']} (vLLM's "
                  "`draft_sample_method`) at every temperature > 0."]  # fmt: skip
    if results.get("skipped"):
        gone = ", ".join(f"{s['method']} k={s['k']}" for s in results["skipped"])
        lines += ["", f"Skipped by the time limit ({cfg.get('time_limit')} s): {gone}."]
    if any(r["method"] == "target_mtp" for r in results["runs"]):
        lines += ["", "target_mtp: the MTP layer the target ships, served by vLLM's method mtp "
                  "without a draft model (the layer an mtp head was fine-tuned from)."]  # fmt: skip
    groups: dict[tuple, list[dict]] = {}
    for r in sorted_runs(results):
        groups.setdefault((r["dataset"], r["temperature"]), []).append(r)
    for (dataset, temperature), runs in groups.items():
        lines += [
            "",
            f"## {dataset}, temperature {float(temperature)} ({runs[0]['prompts']} prompts)",
        ]
        lines += ["", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
        lines += ["| " + " | ".join(cells(r)) + " |" for r in runs]
        notes = footnotes(runs)
        lines += ["", *notes] if notes else []
        fastest = best_k(runs)
        lines += ["", fastest] if fastest else []
        cover = next(
            (r["draft_vocab_coverage"] for r in runs if r.get("draft_vocab_coverage")), None
        )
        if cover:
            lines += [
                "",
                f"The head's draft vocabulary ({cover['size']:,} ids) holds "
                f"{100 * cover['covered']:.1f}% of the target's {cover['tokens']:,} greedy output "
                "tokens here; the rest can never be drafted.",
            ]
        lines += expected_lines(runs, results.get("draft_sample_method"))
        if any(r.get("simulated") for r in runs):
            lines += ["", SIMULATED]
        lines += argmax_lines(runs)
        bad = [r for r in runs if r.get("lossless") and r["lossless"]["mismatches"]]
        if bad:
            lines += ["", "Greedy outputs that differ from no speculation:", ""]
        for r in bad:
            run, mismatches = f"- {r['method']} k={r['k']}", r["lossless"]["mismatches"]
            lines += [
                f"{run}: `{m['id']}` (first different token: {m['first_diff_token']})"
                if "first_diff_token" in m
                else f"{run}: `{m['id']}` (first token below the target's top logit: "
                f"{m['first_below_top_token']})"
                for m in mismatches[:MAX_MISMATCHES]
            ]
            if len(mismatches) > MAX_MISMATCHES:
                lines.append(f"{run}: … and {len(mismatches) - MAX_MISMATCHES} more")
    lines += sampling_lines(results)
    from draftsmith.evaluate.context import markdown_lines
    from draftsmith.evaluate.plots import drafter

    lines += markdown_lines(results, drafter(results))
    if plots:
        lines += ["", "## Plots", ""]
        lines += [f"![{p.removesuffix('.png').replace('_', ' ')}]({p})" for p in plots]
    return "\n".join(lines) + "\n"


def log_wandb(
    results: dict, out_dir: Path, plots: list[str], project: str, run_name: str | None
) -> None:
    """Log the plots and a table of runs; W&B trouble warns once and never raises."""
    mode = os.environ.get("WANDB_MODE") or (
        "online" if os.environ.get("WANDB_API_KEY") else "offline"
    )
    if mode == "disabled":
        return
    run, error = None, None
    try:
        import wandb

        run = wandb.init(
            mode=mode,
            dir=out_dir,
            project=project,
            name=run_name,
            config=results.get("config") or {},
            reinit="create_new",
        )
        columns = ["dataset", "temperature", "method", "k", *NUMBERS, "per_position", "lossless"]
        rows = [
            [r["dataset"], r["temperature"], r["method"], r["k"], *(r.get(n) for n in NUMBERS)]
            + [per_position_text(r), lossless_text(r)]
            for r in sorted_runs(results)
        ]
        images = {p.removesuffix(".png"): wandb.Image(str(out_dir / p)) for p in plots}
        run.log({**images, "runs": wandb.Table(columns=columns, data=rows)})
    except Exception as err:  # W&B is optional: the report on disk stands without it
        error = err
    if run is not None:
        try:
            run.finish()
        except Exception as err:
            error = error or err
    if error is not None:
        warnings.warn(f"W&B logging skipped: {type(error).__name__}: {error}", stacklevel=3)


def write_report(
    results: dict,
    out_dir: Path,
    wandb: bool = True,
    wandb_project: str = "draftsmith",
    run_name: str | None = None,
) -> Path:
    """Write report.md and its PNG plots to `out_dir` (and log to W&B); return report.md."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    plots = write_plots(results, out_dir)
    report = out_dir / "report.md"
    report.write_text(markdown(results, plots), encoding="utf-8")
    if wandb:
        log_wandb(results, out_dir, plots, wandb_project, run_name)
    return report
