"""The evaluate stage's plots: per-position acceptance, acceptance length and tokens per
step against k, and speedup against no speculation (bars when a single k was timed), one set
per temperature, each titled with its temperature.

Each plot function takes the runs of one temperature and returns whether it drew anything;
a plot without data is not written, and a stale one from an earlier run is removed.
"""

from __future__ import annotations

from pathlib import Path

from matplotlib.figure import Figure  # the OO API renders with Agg: no display, no pyplot


def drafter(results: dict) -> str | None:
    """The method the plots follow: the head's, else a draft model's, else none."""
    if results.get("head"):
        return results["head"]["method"]
    return "draft_model" if any(r["method"] == "draft_model" for r in results["runs"]) else None


# The model-free methods drawn beside the drafter: (marker in the k plots, line style).
BASELINES = {"ngram": ("x", "--"), "suffix": ("+", "-.")}


def by_dataset(runs: list[dict], method: str, field: str) -> dict[str, list[dict]]:
    """Runs of `method` with `field` set, per dataset, sorted by k."""
    out: dict[str, list[dict]] = {}
    for r in sorted(runs, key=lambda r: r["k"] or 0):
        if r["method"] == method and r.get(field) is not None:
            out.setdefault(r["dataset"], []).append(r)
    return out


def plot_per_position(runs: list[dict], method: str, title: str, path: Path) -> bool:
    """Bars: per-position acceptance of `method` at its largest k, one group per dataset."""
    largest = {d: rs[-1] for d, rs in by_dataset(runs, method, "per_position").items()}
    if not largest:
        return False
    n = max(len(r["per_position"]) for r in largest.values())
    width = 0.8 / n
    fig = Figure(figsize=(max(6.0, 1.2 * n * len(largest) + 2), 4.5), layout="constrained")
    ax = fig.add_subplot()
    for i in range(n):
        xs = [j for j, r in enumerate(largest.values()) if len(r["per_position"]) > i]
        ys = [r["per_position"][i] for r in largest.values() if len(r["per_position"]) > i]
        bars = ax.bar([x + (i - (n - 1) / 2) * width for x in xs], ys, width, label=f"pos {i + 1}")
        ax.bar_label(bars, labels=[f"{y:.2f}" for y in ys], fontsize=7)
    ax.set_xticks(range(len(largest)), [f"{d}\n(k={r['k']})" for d, r in largest.items()])
    ax.set(ylim=(0, 1.08), ylabel="accepted / drafts")
    ax.set_title(f"{method}: per-position acceptance at its largest k {title}")
    ax.legend(title="draft position", fontsize=8)
    fig.savefig(path, dpi=120)
    return True


def plot_length_vs_k(runs: list[dict], method: str, title: str, path: Path) -> bool:
    """Lines: acceptance length and tokens/step vs k per dataset; ngram and suffix as
    markers."""
    head = by_dataset(runs, method, "acceptance_length")
    if not head:
        return False
    others = {name: by_dataset(runs, name, "acceptance_length") for name in BASELINES}
    fig = Figure(figsize=(11, 4.5), layout="constrained")
    axes = fig.subplots(1, 2, sharex=True)
    fields = {"acceptance_length": "acceptance length", "tokens_per_step": "tokens / step"}
    for ax, (field, label) in zip(axes, fields.items(), strict=True):
        for i, (dataset, rs) in enumerate(head.items()):
            ks, ys = [r["k"] for r in rs], [r[field] for r in rs]
            if None not in ys:  # simulated rows have no tokens/step
                ax.plot(ks, ys, "o-", color=f"C{i}", label=dataset)
            for name, rows in others.items():
                if dataset in rows:
                    ks, ys = zip(*((r["k"], r[field]) for r in rows[dataset]), strict=True)
                    mark = BASELINES[name][0]
                    ax.plot(ks, ys, mark, ms=9, mew=2, color=f"C{i}", label=f"{name}, {dataset}")
        ax.set(xlabel="k (draft tokens)", ylabel=label, title=f"{method}: {label} {title}")
        ax.grid(alpha=0.3)
    axes[0].xaxis.get_major_locator().set_params(integer=True)
    axes[0].legend(fontsize=8)
    fig.savefig(path, dpi=120)
    return True


def plot_speedup_vs_k(runs: list[dict], method: str, title: str, path: Path) -> bool:
    """Speedup vs none by k per dataset; ngram's and suffix's best as lines per dataset."""
    head = by_dataset(runs, method, "speedup_vs_none")
    if not head:
        return False
    others = {name: by_dataset(runs, name, "speedup_vs_none") for name in BASELINES}
    fig = Figure(figsize=(7, 4.5), layout="constrained")
    ax = fig.add_subplot()
    ax.axhline(1.0, color="gray", lw=1, ls=":", label="no speculation")
    if all(len(rs) == 1 for rs in head.values()):  # one measured k: bars, not a lone point
        _speedup_bars(ax, head, others, method)
        ax.set_title(f"{method}: speedup vs no speculation {title}")
        fig.savefig(path, dpi=120)
        return True
    for i, (dataset, rs) in enumerate(head.items()):
        ys = [r["speedup_vs_none"] for r in rs]
        ax.plot([r["k"] for r in rs], ys, "o-", color=f"C{i}", label=dataset)
        for name, rows in others.items():
            if dataset in rows:
                best = max(rows[dataset], key=lambda r: r["speedup_vs_none"])
                label = f"{name}, {dataset} (best: k={best['k']})"
                ax.axhline(
                    best["speedup_vs_none"], color=f"C{i}", ls=BASELINES[name][1], label=label
                )
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set(xlabel="k (draft tokens)", ylabel="output tok/s ÷ no speculation")
    ax.set_title(f"{method}: speedup vs no speculation {title}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=120)
    return True


def _speedup_bars(ax, head: dict, others: dict[str, dict], method: str) -> None:
    """Per dataset: the head's speedup at its one k beside each baseline's best."""
    datasets = list(head)
    rows = [(method, [head[d][0] for d in datasets])]
    for name, runs in others.items():
        if runs:
            best = [max(runs[d], key=lambda r: r["speedup_vs_none"]) if d in runs else None
                    for d in datasets]  # fmt: skip
            rows.append((f"{name} (best k)", best))
    width = 0.8 / len(rows)
    for i, (label, rs) in enumerate(rows):
        shown = [(j, r) for j, r in enumerate(rs) if r]
        xs = [j + (i - (len(rows) - 1) / 2) * width for j, _ in shown]
        bars = ax.bar(xs, [r["speedup_vs_none"] for _, r in shown], width, label=label)
        labels = [f"{r['speedup_vs_none']:.2f} (k={r['k']})" for _, r in shown]
        ax.bar_label(bars, labels=labels, fontsize=7)
    ax.set_xticks(range(len(datasets)), datasets)
    ax.set(ylabel="output tok/s ÷ no speculation")
    ax.legend(fontsize=8)


def plot_by_context(runs: list[dict], method: str, title: str, path: Path) -> bool:
    """Tokens per step against context length (``context.plot_by_context``)."""
    from draftsmith.evaluate.context import plot_by_context as plot

    return plot(runs, method, title, path)


PLOTS = {  # file name: plot(runs, method, title suffix, path) -> written
    "acceptance_per_position.png": plot_per_position,
    "acceptance_length_vs_k.png": plot_length_vs_k,
    "speedup_vs_k.png": plot_speedup_vs_k,
    "tokens_per_step_by_context.png": plot_by_context,
}


def plot_name(name: str, temperature: float, first: bool) -> str:
    """The file of a plot at ``temperature``: the plain name for the first (greedy when
    measured) temperature, ``<name>_T<temperature>.png`` for the others."""
    return name if first else name.replace(".png", f"_T{float(temperature)}.png")


def write_plots(results: dict, out_dir: Path) -> list[str]:
    """Write every plot there is data for, one set per temperature (greedy first, under the
    plain names); return the file names."""
    method = drafter(results)
    written = []
    if method is not None and results["runs"]:
        temps = sorted({r["temperature"] for r in results["runs"]})
        for i, temperature in enumerate(temps):
            runs = [r for r in results["runs"] if r["temperature"] == temperature]
            simulated = any(r.get("simulated") for r in runs if r["method"] == method)
            title = f"({'simulated, ' if simulated else ''}temperature {float(temperature)})"
            for name, plot in PLOTS.items():
                file = plot_name(name, temperature, i == 0)
                if plot(runs, method, title, out_dir / file):
                    written.append(file)
    stale = [p.name for name in PLOTS for p in out_dir.glob(name.replace(".png", "_T*.png"))]
    for name in (set(PLOTS) | set(stale)) - set(written):  # a stale plot would mislead
        (out_dir / name).unlink(missing_ok=True)
    return written
