"""``draftsmith study``: vary one knob at a time around a pipeline, measure each head in vLLM.

    draftsmith study --config configs/study/smollm2.yaml

Each point is the base pipeline YAML with a few dotted overrides
(``train.model.ttt_steps: 5``). Every point runs in the same output directory, so stages
that a point does not change (content-addressed, ``pipelines/stage_dirs.py``) are reused: a grid
over training knobs extracts once. The table gives, per point, tokens per verification step
and acceptance length at ``k`` measured by vLLM, the simulated acceptance length logged in
training, the draft vocabulary's coverage and the seconds of each stage; it is written to
``<output>/study.md`` (and ``study.json``, ``study.png``).
"""

from __future__ import annotations

import csv
import dataclasses
import json
import sys
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from draftsmith import drafters
from draftsmith.core.config import parse_config, section_overrides, set_dotted
from draftsmith.core.console import say
from draftsmith.core.errors import DraftsmithError, exit_code
from draftsmith.core.files import write_json_atomic
from draftsmith.core.outputs import PIPELINE_OWN, check_output
from draftsmith.core.readers import read_json
from draftsmith.drafters.headfiles.read import read_head_config
from draftsmith.pipelines import curve
from draftsmith.pipelines.commands import COMMANDS
from draftsmith.pipelines.config import (
    SECTIONS,
    PipelineError,
    parse_pipeline,
    read_yaml_mapping,
)
from draftsmith.pipelines.runner import run

# Plain YAML values: ``Any`` would let the parser instantiate ``class_path`` dicts (loggers).
Overrides = dict[str, None | bool | int | float | str | list | dict]


@dataclass
class StudyConfig:
    """Vary one knob at a time around a pipeline config and tabulate the heads in vLLM."""

    pipeline: str = "configs/pipelines/smollm2.yaml"
    """The base pipeline YAML (every point starts from it)."""
    common: Overrides = field(default_factory=dict)
    """Dotted overrides applied to every point (before the point's own)."""
    points: dict[str, Overrides] = field(default_factory=lambda: {"base": {}})
    """Point name -> dotted overrides of the pipeline YAML, e.g. {train.model.ttt_steps: 5}."""
    output: str = "outputs/study"
    """Run directory shared by every point (stages are reused across points)."""
    overwrite: bool = False
    """Write into `output` even if it is a file or a directory no study wrote."""
    k: int = 3
    """Draft length whose acceptance the table reports (the eval section must measure it)."""
    dataset: str = "mt_bench"
    """Evaluation set the table reports."""
    curve: bool = False
    """Also fit tokens/step against each point's training tokens (points that differ in
    data, e.g. ``train.data.max_train_samples``): ``curve.png`` and the fit in study.md."""


def apply_overrides(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """A deep copy of ``base`` with ``{"a.b.c": v}`` set; unknown top-level keys are errors."""
    out = json.loads(json.dumps(base))
    for dotted, value in overrides.items():
        section = dotted.split(".")[0]
        if section not in out and section not in (*SECTIONS, "data"):
            raise PipelineError(f"points: {dotted!r}: no section {section!r} in the pipeline")
        set_dotted(out, dotted, value)
    return out


def parse_study(args: list[str] | None) -> StudyConfig:
    """The study's options; ``--<stage>.<key> VALUE`` arguments join ``common`` (after the
    YAML's), so they apply to every point and a point's own overrides still win."""
    args = list(sys.argv[1:] if args is None else args)
    rest, overrides = section_overrides(args, SECTIONS)
    cfg = parse_config(StudyConfig, rest, prog="draftsmith study")
    return dataclasses.replace(cfg, common={**cfg.common, **overrides})


def point_configs(cfg: StudyConfig) -> dict[str, dict[str, Any]]:
    """Point name -> the whole pipeline config that point runs."""
    if not Path(cfg.pipeline).is_file():
        raise PipelineError(f"pipeline: {cfg.pipeline} does not exist; give a pipeline YAML")
    base = read_yaml_mapping(Path(cfg.pipeline), "pipeline")
    common = apply_overrides(base, cfg.common)
    points = {}
    for name, overrides in cfg.points.items():
        points[name] = {**apply_overrides(common, overrides or {}), "output": cfg.output}
        if cfg.overwrite:  # the study's own first point has made the directory its own
            points[name]["overwrite"] = True
    return points


def train_metrics(train_dir: Path) -> dict[str, float]:
    """The last logged value of each val/ metric of a train stage (CSV logger)."""
    last: dict[str, float] = {}
    for path in sorted(train_dir.glob("**/metrics.csv")):
        with path.open() as f:
            for row in csv.DictReader(f):
                for key, value in row.items():
                    if key.startswith("val/") and value:
                        last[key] = float(value)
    return last


def point_row(name: str, overrides: dict, state: dict, cfg: StudyConfig) -> dict[str, Any]:
    stages = state["stages"]
    row: dict[str, Any] = {
        "point": name,
        "overrides": overrides,
        "seconds": {s: e["seconds"] for s, e in stages.items()},
        "dirs": {s: e["dir"] for s, e in stages.items()},
        "reused": [s for s, e in stages.items() if e["status"] in ("skipped", "given")],
    }
    metrics = train_metrics(Path(stages["train"]["dir"])) if "train" in stages else {}
    row["simulated_acceptance_length"] = metrics.get(f"val/acceptance_length_k{cfg.k}")
    card = Path(stages.get("export", {}).get("dir", ""), "config.json")
    if card.is_file():
        row["draft_vocab_size"] = read_head_config(card.parent).get("draft_vocab_size")
    results = Path(stages.get("eval", {}).get("dir", ""), "results.json")
    if results.is_file():
        fix = f"delete {results.parent} to evaluate again"
        record = read_json(results, "stage record", fix, keys=("runs",))
        for run_ in record["runs"]:
            if run_["dataset"] != cfg.dataset or run_["k"] != cfg.k:
                continue
            prefix = "head" if run_["method"] in drafters.head_methods() else run_["method"]
            row[f"{prefix}_acceptance_length"] = run_["acceptance_length"]
            row[f"{prefix}_tokens_per_step"] = run_["tokens_per_step"]
            row[f"{prefix}_per_position"] = run_["per_position"]
            if run_.get("draft_vocab_coverage"):
                row["draft_vocab_coverage"] = run_["draft_vocab_coverage"]["covered"]
        method = (record.get("config") or {}).get("method")
        if method and (figures := COMMANDS["eval"].hook("by_context")(record, method)):
            row["by_context"] = figures
    return row


def context_table(rows: list[dict[str, Any]]) -> str:
    """Tokens per step per context bucket: each point's head served (expected in brackets,
    its drafts replayed in torch), then ngram and suffix from the first point that ran them."""
    buckets = sorted(
        {int(t) for r in rows for f in (r.get("by_context") or {}).values() for t in f}
    )
    if not buckets:
        return ""
    temperatures = sorted({f["temperature"] for r in rows for m in (r.get("by_context") or {})
                           .values() for f in m.values()})  # fmt: skip
    at = ", ".join(str(float(t)) for t in temperatures)
    lines = [
        f"By context length (prompt tokens), temperature {at}, tokens per step served (expected):",
        "",
        "| point | " + " | ".join(f"{t:,}" for t in buckets) + " | last / first |",
        "|---|" + "---|" * (len(buckets) + 1),
    ]

    def line(name: str, figures: dict) -> str:
        cells, served = [], []
        for t in buckets:
            f = figures.get(t)
            if f is None:
                cells.append("–")
                continue
            served.append(f["tokens_per_step"])
            more = f.get("expected_tokens_per_step")
            cells.append(_fmt(f["tokens_per_step"]) + (f" ({more:.3f})" if more else ""))
        ratio = served[-1] / served[0] if len(served) > 1 and served[0] else None
        return f"| {name} | " + " | ".join(cells) + f" | {_fmt(ratio)} |"

    for r in rows:
        if (r.get("by_context") or {}).get("head"):
            lines.append(line(r["point"], r["by_context"]["head"]))
    for method in ("ngram", "suffix"):
        figures = next((r["by_context"][method] for r in rows
                        if method in (r.get("by_context") or {})), None)  # fmt: skip
        if figures:
            lines.append(line(method, figures))
    return "\n".join(lines)


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "–"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def _vocab(row: dict[str, Any]) -> str:
    size, cover = row.get("draft_vocab_size"), row.get("draft_vocab_coverage")
    if size is None:
        return "–"
    return f"{size:,}" + (f" ({100 * cover:.1f}%)" if cover is not None else "")


def table(rows: list[dict[str, Any]], cfg: StudyConfig) -> str:
    lines = [
        f"| point | overrides | tokens/step k={cfg.k} | acceptance length | per position "
        "| simulated (train) | draft vocab (coverage) | train s | eval s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        over = ", ".join(f"`{k}={v}`" for k, v in r["overrides"].items()) or "(base)"
        pos = " / ".join(f"{p:.2f}" for p in r.get("head_per_position") or [])
        secs = r.get("seconds", {})
        lines.append(
            f"| {r['point']} | {over} | {_fmt(r.get('head_tokens_per_step'))} "
            f"| {_fmt(r.get('head_acceptance_length'))} | {pos or '–'} "
            f"| {_fmt(r.get('simulated_acceptance_length'))} | {_vocab(r)} "
            f"| {_fmt(secs.get('train'), 0)} "
            f"| {_fmt(secs.get('eval'), 0)} |"
            + (f" failed: {r['error']}" if r.get("error") else "")
        )
    ngram = next((r["ngram_tokens_per_step"] for r in rows if r.get("ngram_tokens_per_step")), None)
    if ngram:
        lines.append(f"\nngram in the same runs: {ngram:.3f} tokens/step at k={cfg.k}.")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path, k: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["point"] for r in rows]
    fig, ax = plt.subplots(figsize=(max(4, 0.8 * len(rows)), 3))
    ax.bar(names, [r.get("head_tokens_per_step") or 0 for r in rows], color="tab:blue")
    ax.set_ylabel(f"tokens / step (k={k})")
    ax.tick_params(axis="x", rotation=45)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(args: list[str] | None = None) -> int:
    return exit_code("draftsmith study", lambda: _main(args))


def _main(args: list[str] | None) -> int:
    cfg = parse_study(args)
    out = check_output(cfg.output, "output", PIPELINE_OWN, overwrite=cfg.overwrite)
    point_configs(cfg)  # a bad pipeline YAML fails before anything is written
    (out / "points").mkdir(parents=True, exist_ok=True)
    rows = []
    for name, point in point_configs(cfg).items():
        overrides = cfg.points[name] or {}
        path = out / "points" / f"{name}.yaml"
        path.write_text(yaml.safe_dump(point, sort_keys=False))
        say(f"study: point {name}: {overrides or '(base)'}")
        try:
            state = run(parse_pipeline(["--config", str(path)]))
            rows.append(point_row(name, overrides, state, cfg))
        except Exception as err:  # one failed point does not end the study
            if not isinstance(err, DraftsmithError):
                traceback.print_exc()
            say(f"study: point {name} failed: {err}")
            rows.append({"point": name, "overrides": overrides, "error": str(err)[:200]})
        write_json_atomic(out / "study.json", {"config": cfg.__dict__, "rows": rows})
    text = table(rows, cfg)
    if by_context := context_table(rows):
        text += "\n\n" + by_context
    if cfg.curve:
        for row in rows:
            if "train" in row.get("dirs", {}):
                tokens = COMMANDS["train"].hook("train_tokens")
                row["train_tokens"] = tokens(Path(row["dirs"]["train"]))
        line, fit = curve.summary(rows, cfg.k)
        text += "\n\n" + line
        curve.plot(rows, fit, out / "curve.png", cfg.k)
        write_json_atomic(out / "study.json", {"config": cfg.__dict__, "rows": rows, "fit": fit})
    (out / "study.md").write_text(text + "\n")
    plot(rows, out / "study.png", cfg.k)
    say(text)
    return 1 if any(r.get("error") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
