"""The evaluate report: report.md's tables, the PNG plots, W&B offline logging, the terminal table.

The results dict is built the way the evaluate stage builds it: vLLM-style counters per run,
acceptance length and tokens per step computed from them, one row derived from a longer run,
speedups against the none and ngram rows of the same dataset.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from types import SimpleNamespace

import matplotlib.image
import pytest

from draftsmith.evaluate.report import fmt, summary_table, write_report

PLOTS = ("acceptance_per_position.png", "acceptance_length_vs_k.png", "speedup_vs_k.png")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def measured(dataset: str, method: str, k: int | None, out: int, seconds: float, drafts=0, pos=()):
    """A measured run: speed from tokens and seconds, acceptance from the counters."""
    prompts = {"mt_bench": 80, "humaneval": 164}[dataset]
    accepted = sum(pos)
    spec = method != "none"
    return {
        "dataset": dataset,
        "method": method,
        "k": k,
        "temperature": 0.0,
        "mode": "offline",
        "prompts": prompts,
        "output_tokens": out,
        "seconds": seconds,
        "output_tok_s": out / seconds,
        "counters": {
            "num_drafts": drafts,
            "num_draft_tokens": drafts * k,
            "num_accepted_tokens": accepted,
            "accepted_per_pos": list(pos),
        }
        if spec
        else None,
        "acceptance_length": 1 + accepted / drafts if spec else None,
        "per_position": [p / drafts for p in pos] if spec else None,
        "tokens_per_step": out / (out - accepted) if spec else None,
        "derived_from_k": None,
        "speedup_vs_none": None,
        "speedup_vs_ngram": None,
        "lossless": {"compared": prompts, "identical": prompts, "mismatches": []} if spec else None,
    }


def derived(run: dict, k: int) -> dict:
    """Acceptance at a smaller k from `run`'s per-position counters (no timing)."""
    c = run["counters"]
    steps = run["output_tokens"] - c["num_accepted_tokens"]
    pos, drafts = c["accepted_per_pos"][:k], c["num_drafts"]
    return {
        **run,
        "k": k,
        "derived_from_k": run["k"],
        "output_tokens": None,
        "seconds": None,
        "output_tok_s": None,
        "counters": {**c, "num_draft_tokens": drafts * k, "num_accepted_tokens": sum(pos)},
        "acceptance_length": 1 + sum(pos) / drafts,
        "per_position": [p / drafts for p in pos],
        "tokens_per_step": (steps + sum(pos)) / steps,
        "lossless": None,
    }


def add_speedups(runs: list[dict]) -> None:
    rate = {(r["dataset"], r["method"], r["k"]): r["output_tok_s"] for r in runs}
    for r in runs:
        if r["method"] == "none" or r["output_tok_s"] is None:
            continue
        r["speedup_vs_none"] = r["output_tok_s"] / rate[(r["dataset"], "none", None)]
        ngram = rate.get((r["dataset"], "ngram", r["k"]))
        if r["method"] != "ngram" and ngram:
            r["speedup_vs_ngram"] = r["output_tok_s"] / ngram


SECONDS = {  # none, ngram (less 2 s per k), eagle3 k=1, eagle3 k=3
    "mt_bench": (100.0, 96.0, 80.0, 60.0),
    "humaneval": (150.0, 145.0, 110.0, 75.0),
}
OUTPUT_TOKENS = {"mt_bench": 12000, "humaneval": 18000}
COUNTERS = {  # drafts, accepted per position at k=3
    ("mt_bench", "ngram"): (1000, [700, 500, 300]),
    ("mt_bench", "eagle3"): (4000, [3000, 1500, 500]),
    ("humaneval", "ngram"): (1500, [600, 300, 100]),
    ("humaneval", "eagle3"): (6000, [5000, 3500, 2000]),
}


def make_results() -> dict:
    runs = []
    for dataset, (t_none, t_ngram, t_k1, t_k3) in SECONDS.items():
        out = OUTPUT_TOKENS[dataset]
        runs.append(measured(dataset, "none", None, out, t_none))
        drafts, pos = COUNTERS[(dataset, "ngram")]
        for k in (1, 2, 3):
            runs.append(measured(dataset, "ngram", k, out, t_ngram - 2 * k, drafts, pos[:k]))
        drafts, pos = COUNTERS[(dataset, "eagle3")]
        k1 = measured(dataset, "eagle3", 1, out, t_k1, drafts, pos[:1])
        k3 = measured(dataset, "eagle3", 3, out, t_k3, drafts, pos)
        runs += [k1, k3, derived(k3, 2)]
    mt_k3 = runs[5]
    assert (mt_k3["dataset"], mt_k3["method"], mt_k3["k"]) == ("mt_bench", "eagle3", 3)
    mt_k3["lossless"] = {
        "compared": 80,
        "identical": 79,
        "mismatches": [{"id": "mt_bench:81", "first_diff_token": 17}],
    }
    add_speedups(runs)
    return {
        "draftsmith_version": "0.1.0",
        "vllm_version": "0.32.0",
        "device": "cpu (2 cores)",
        "created": "2026-11-23T02:00:00Z",
        "config": {
            "model": "smollm2-135m",
            "k": [1, 2, 3],
            "mode": "offline",
            "concurrency": 1,
            "max_tokens": 256,
        },  # fmt: skip
        "target": {"path": "/models/smollm2-135m", "architecture": "LlamaForCausalLM"},
        "head": {"path": "/heads/smollm2-eagle3", "method": "eagle3"},
        "runs": runs,
    }


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> tuple[Path, dict]:
    """The report of make_results(), written once with W&B in offline mode."""
    out = tmp_path_factory.mktemp("eval")
    results = make_results()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WANDB_MODE", "offline")
        mp.setenv("WANDB_DIR", str(out))
        mp.delenv("WANDB_API_KEY", raising=False)
        report = write_report(results, out, wandb=True, run_name="test-report")
    return report, results


def test_report_tables(written):
    report, _ = written
    text = report.read_text(encoding="utf-8")
    assert report.name == "report.md"
    assert text.index("## mt_bench, temperature 0.0 (80 prompts)") < text.index(
        "## humaneval, temperature 0.0 (164 prompts)"
    )
    setup = next(line for line in text.splitlines() if line.startswith("**Setup:**"))
    for part in ("/models/smollm2-135m", "/heads/smollm2-eagle3", "eagle3", "vLLM 0.32.0"):
        assert part in setup
    assert "cpu (2 cores)" in setup and "2026-11-23T02:00:00Z" in setup
    # mt_bench: none at 120 tok/s; eagle3 k=3 at 200 tok/s, ngram k=3 at 133.3 tok/s.
    assert "| none | – | – | – | – | 120.0 | – | – | – |" in text
    assert (
        "| eagle3 | 3 | 2.250 | 1.714 | 0.75 / 0.38 / 0.13 | 200.0 | 1.67× | 1.50× | 79/80 |"
        in (text)
    )
    assert "| eagle3 | 2* | 2.125 | 1.643 | 0.75 / 0.38 | – | – | – | – |" in text
    assert "| ngram | 3 | 2.500 | 1.143 | 0.70 / 0.50 / 0.30 | 133.3 | 1.11× | – | 80/80 |" in text
    # Rows run none, ngram k=1..3, eagle3 k=1..3 within each table.
    mt = text[text.index("## mt_bench") : text.index("## humaneval")]
    rows = [line.split(" | ")[:2] for line in mt.splitlines() if line.startswith("| ")][1:]
    assert rows == [["| none", "–"]] + [["| ngram", k] for k in "123"] + [
        ["| eagle3", k] for k in ("1", "2*", "3")
    ]


def test_report_lists_mismatches_and_footnotes(written):
    text = written[0].read_text(encoding="utf-8")
    mt = text[text.index("## mt_bench") : text.index("## humaneval")]
    he = text[text.index("## humaneval") :]
    assert "- eagle3 k=3: `mt_bench:81` (first different token: 17)" in mt
    assert "mt_bench:81" not in he and "differ from no speculation" not in he
    note = "\\* derived from the k=3 run's per-position counters: acceptance only, no timing."
    assert note in mt and note in he


def test_plots_are_pngs_and_embedded(written):
    report, _ = written
    text = report.read_text(encoding="utf-8")
    for name in PLOTS:
        path = report.parent / name
        data = path.read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 10_000, name
        pixels = matplotlib.image.imread(path)
        assert pixels.shape[0] > 300 and pixels.shape[1] > 600, name
        assert pixels[..., :3].std() > 0.05, f"{name} looks blank"
        assert f"]({name})" in text


def test_wandb_offline_run_is_written(written):
    report, results = written
    runs = list((report.parent / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, runs
    logs = list(runs[0].glob("run-*.wandb"))
    assert logs and logs[0].stat().st_size > 0
    images = list(runs[0].glob("files/media/images/*.png"))
    assert len(images) == len(PLOTS), images
    assert list(runs[0].glob("files/media/table/runs_*.table.json"))


def test_without_ngram_runs_the_speedup_plot_still_draws(tmp_path):
    results = make_results()
    results["runs"] = [r for r in results["runs"] if r["method"] != "ngram"]
    for r in results["runs"]:
        r["speedup_vs_ngram"] = None
    report = write_report(results, tmp_path, wandb=False)
    for name in PLOTS:
        assert (tmp_path / name).read_bytes()[:8] == PNG_MAGIC, name
    assert "| eagle3 | 3 | 2.250 | 1.714 | 0.75 / 0.38 / 0.13 | 200.0 | 1.67× | – | 79/80 |" in (
        report.read_text(encoding="utf-8")
    )


def test_plots_without_data_are_skipped_and_stale_ones_removed(tmp_path):
    results = make_results()
    write_report(results, tmp_path, wandb=False)
    assert (tmp_path / "speedup_vs_k.png").is_file()
    no_timing = copy.deepcopy(results)
    no_timing["runs"] = [r for r in no_timing["runs"] if r["method"] != "none"]
    for r in no_timing["runs"]:
        r["speedup_vs_none"] = None
    text = write_report(no_timing, tmp_path, wandb=False).read_text(encoding="utf-8")
    assert not (tmp_path / "speedup_vs_k.png").exists() and "speedup_vs_k.png" not in text
    assert (tmp_path / "acceptance_length_vs_k.png").is_file()

    baselines = copy.deepcopy(results)
    baselines["head"] = None
    baselines["runs"] = [r for r in baselines["runs"] if r["method"] != "eagle3"]
    text = write_report(baselines, tmp_path, wandb=False).read_text(encoding="utf-8")
    assert not any((tmp_path / name).exists() for name in PLOTS)
    assert "## Plots" not in text and "| ngram | 3 | 2.500 | 1.143 |" in text


class FakeWandb:
    """Stands in for the wandb module: records init's arguments, what was logged, finish."""

    def __init__(self) -> None:
        self.inits: list[dict] = []
        self.logged: dict = {}
        self.finished = 0

    def init(self, **kwargs):
        self.inits.append(kwargs)
        return SimpleNamespace(log=self.logged.update, finish=self.finish)

    def finish(self) -> None:
        self.finished += 1

    Image = staticmethod(lambda path: ("image", Path(path).name))
    Table = staticmethod(lambda columns, data: ("table", columns, data))


@pytest.mark.parametrize(
    "env, mode",
    [
        ({}, "offline"),
        ({"WANDB_API_KEY": "x" * 40}, "online"),
        ({"WANDB_API_KEY": "x" * 40, "WANDB_MODE": "offline"}, "offline"),
        ({"WANDB_MODE": "disabled"}, None),
    ],
)
def test_wandb_mode_follows_the_environment(tmp_path, monkeypatch, env, mode):
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    for name in ("WANDB_API_KEY", "WANDB_MODE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    results = make_results()
    write_report(results, tmp_path, wandb=True, wandb_project="p", run_name="r")
    if mode is None:  # disabled: W&B is not even started
        assert fake.inits == [] and fake.finished == 0
        return
    assert fake.inits == [
        dict(
            mode=mode,
            dir=tmp_path,
            project="p",
            name="r",
            config=results["config"],
            reinit="create_new",
        )
    ]
    assert fake.finished == 1
    assert {fake.logged[p.removesuffix(".png")] for p in PLOTS} == {("image", p) for p in PLOTS}
    kind, columns, rows = fake.logged["runs"]
    assert kind == "table" and len(rows) == len(results["runs"])
    assert {"acceptance_length", "tokens_per_step", "speedup_vs_none"} <= set(columns)


def test_wandb_is_finished_when_logging_fails(tmp_path, monkeypatch):
    fake = FakeWandb()
    fake.Table = None  # calling it raises TypeError after init
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setenv("WANDB_MODE", "offline")
    with pytest.warns(UserWarning, match="W&B logging skipped: TypeError"):
        write_report(make_results(), tmp_path, wandb=True)
    assert fake.finished == 1 and (tmp_path / "report.md").is_file()


def test_wandb_false_never_imports_wandb(tmp_path, monkeypatch):
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setenv("WANDB_MODE", "offline")
    write_report(make_results(), tmp_path, wandb=False)
    assert fake.inits == [] and not (tmp_path / "wandb").exists()


def test_wandb_missing_warns_once_and_the_report_stands(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    with pytest.warns(UserWarning, match="W&B logging skipped") as record:
        report = write_report(make_results(), tmp_path, wandb=True)
    assert len([w for w in record if "W&B" in str(w.message)]) == 1
    assert "mt_bench:81" in report.read_text(encoding="utf-8")


def test_summary_table_has_one_row_per_run():
    results = make_results()
    lines = summary_table(results).splitlines()
    n = {r["dataset"]: r["prompts"] for r in results["runs"]}
    max_tokens = results["config"]["max_tokens"]
    assert lines[0].startswith(f"replies up to {max_tokens} tokens; prompts per set: ")
    assert all(f"{d} {k}" in lines[0] for d, k in n.items())  # what the rows were measured on
    lines = lines[1:]
    assert lines[0].split()[:4] == ["dataset", "temp", "method", "k"]
    rows = [line for line in lines if line.split()[0] in ("mt_bench", "humaneval")]
    assert len(rows) == len(results["runs"]) == 14
    keys = {tuple(row.split()[:4]) for row in rows}
    assert len(keys) == 14 and ("mt_bench", "0.0", "eagle3", "2*") in keys
    derived_row = next(r for r in rows if r.split()[:4] == ["humaneval", "0.0", "eagle3", "2*"])
    assert "2.417" in derived_row and "2.133" in derived_row
    assert lines[-1].startswith("* derived from the k=3 run's per-position counters")


@pytest.mark.parametrize(
    "value, digits, expected",
    [
        (0.125, 2, "0.13"),
        (0.375, 2, "0.38"),
        (2.25, 3, "2.250"),
        (1.6666, 2, "1.67"),
        (None, 2, "–"),
    ],
)
def test_fmt_rounds_half_up(value, digits, expected):
    assert fmt(value, digits) == expected


def test_draft_vocab_coverage_counts_tokens_the_head_can_draft(tmp_path):
    import torch
    from safetensors.torch import save_file

    from draftsmith.evaluate.report import markdown
    from draftsmith.evaluate.runs import draft_vocab_coverage

    save_file({"d2t": torch.tensor([0, 1, 3])}, str(tmp_path / "model.safetensors"))
    cover = draft_vocab_coverage(str(tmp_path), [[0, 2, 2], [1, 5]])  # draft vocab {0, 2, 5}
    assert cover == {"size": 3, "tokens": 5, "covered": 0.8}
    save_file({"fc.weight": torch.zeros(1)}, str(tmp_path / "model.safetensors"))
    assert draft_vocab_coverage(str(tmp_path), [[0]]) is None  # a full-vocabulary head
    results = make_results()
    results["runs"][-1]["draft_vocab_coverage"] = cover
    text = markdown(results, [])
    assert "draft vocabulary (3 ids) holds 80.0% of the target's 5 greedy output tokens" in text


def test_report_names_each_methods_fastest_k(tmp_path):
    results = make_results()
    text = write_report(results, tmp_path, wandb=False).read_text(encoding="utf-8")
    # mt_bench: ngram is fastest at k=3 (90 s), the head at k=3 (60 s); derived k=2 is untimed.
    assert (
        "Best k by tokens/s at temperature 0.0: ngram k=3 133.3 tok/s (1.11x none), eagle3 k=3 "
        "200.0 tok/s "
        "(1.67x none); none 120.0 tok/s." in text
    )
    slow_k3 = [r for r in results["runs"] if not (r["method"] == "eagle3" and r["k"] == 3)]
    text = write_report({**results, "runs": slow_k3}, tmp_path, wandb=False).read_text()
    assert "eagle3 k=1 150.0 tok/s (1.25x none)" in text  # k=3 gone: k=1 is the best left


def test_one_measured_k_draws_bars_not_a_lone_point(tmp_path, monkeypatch):
    from draftsmith.evaluate import plots

    results = make_results()
    results["runs"] = [r for r in results["runs"] if r["k"] in (None, 3)]
    drawn = []
    monkeypatch.setattr(plots, "_speedup_bars", lambda ax, *a: drawn.append(a))
    write_report(results, tmp_path, wandb=False)
    assert len(drawn) == 1 and set(drawn[0][0]) == {"mt_bench", "humaneval"}
    drawn.clear()
    write_report(make_results(), tmp_path, wandb=False)  # k = 1 and 3 measured: a line
    assert drawn == []


def test_plots_draw_suffix_beside_ngram(monkeypatch):
    """Every model-free baseline that ran is drawn: bars, lines and markers name suffix."""
    from matplotlib.figure import Figure

    from draftsmith.evaluate import plots

    runs = make_results()["runs"]
    suffix = [{**r, "method": "suffix"} for r in runs if r["method"] == "ngram"]
    for r in suffix:
        r["speedup_vs_none"] = r["speedup_vs_none"] and r["speedup_vs_none"] + 0.1
    ax = Figure().add_subplot()
    head = plots.by_dataset(runs, "eagle3", "speedup_vs_none")
    others = {n: plots.by_dataset(runs + suffix, n, "speedup_vs_none") for n in plots.BASELINES}
    plots._speedup_bars(ax, {d: rs[-1:] for d, rs in head.items()}, others, "eagle3")
    labels = ax.get_legend_handles_labels()[1]
    assert labels == ["eagle3", "ngram (best k)", "suffix (best k)"]
    drawn = []
    monkeypatch.setattr(Figure, "savefig", lambda fig, path, **kw: drawn.append(fig))
    for plot in (plots.plot_length_vs_k, plots.plot_speedup_vs_k):
        drawn.clear()
        assert plot(runs + suffix, "eagle3", "(T=0)", "unused.png")
        legend = [t for ax in drawn[0].axes for t in ax.get_legend_handles_labels()[1]]
        assert any(t.startswith("suffix, mt_bench") for t in legend), legend
        assert any(t.startswith("ngram, mt_bench") for t in legend), legend
