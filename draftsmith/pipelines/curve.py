"""The scaling curve of a study: tokens per step against the tokens a head trained on.

A study whose points differ in training data (``train.data.max_train_samples``, or other
datasets) sets ``curve: true``; then each row gets ``train_tokens`` (every token of the
samples that trained the head, prompts included, counted through the same split that
training used), a least-squares fit ``tokens/step = a + b ln(train_tokens)`` is drawn on a
log axis beside the baselines measured in the study, and the fit is solved for the data at
which the head reaches each baseline. A crossing beyond the largest point is an
extrapolation, and the text says by how much.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any


def fit_log(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares ``y = a + b ln x`` over at least two distinct ``x``; returns (a, b)."""
    ls = [math.log(x) for x in xs]
    n, mx, my = len(ls), sum(ls) / len(ls), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in ls)
    if n < 2 or sxx == 0:
        raise ValueError(f"a log fit needs two distinct x values, got {xs}")
    b = sum((x - mx) * (y - my) for x, y in zip(ls, ys, strict=True)) / sxx
    return my - b * mx, b


def crossing(a: float, b: float, y: float) -> float | None:
    """The x at which ``a + b ln x`` reaches ``y``; None if the fit never rises to it."""
    return math.exp((y - a) / b) if b > 0 else None


def baselines(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Tokens/step of each baseline measured in the study (``<method>_tokens_per_step``)."""
    found: dict[str, float] = {}
    for row in rows:
        for key, value in row.items():
            if key.endswith("_tokens_per_step") and not key.startswith("head") and value:
                found.setdefault(key.removesuffix("_tokens_per_step"), value)
    return found


def measured(rows: list[dict[str, Any]]) -> list[tuple[int, float, str]]:
    """(training tokens, head tokens/step, point name) of each row that has both, sorted."""
    return sorted(
        (r["train_tokens"], r["head_tokens_per_step"], r["point"])
        for r in rows
        if r.get("train_tokens") and r.get("head_tokens_per_step")
    )


def summary(rows: list[dict[str, Any]], k: int) -> tuple[str, dict[str, Any] | None]:
    """Markdown lines on the fit, and the fit itself (None with fewer than two points)."""
    points = [(x, y) for x, y, _ in measured(rows)]
    if len({x for x, _ in points}) < 2:
        return "Scaling curve: fewer than two measured points, no fit.", None
    xs, ys = [float(x) for x, _ in points], [y for _, y in points]
    a, b = fit_log(xs, ys)
    resid = max(abs(a + b * math.log(x) - y) for x, y in points)
    fit: dict[str, Any] = {"a": a, "b": b, "max_residual": resid, "crossings": {}}
    lines = [
        f"Scaling fit over {len(points)} points ({xs[0]:,.0f}-{xs[-1]:,.0f} training tokens): "
        f"tokens/step at k={k} = {a:.4f} + {b:.4f} ln(tokens), i.e. +{b * math.log(2):.4f} "
        f"per doubling of the data (largest residual {resid:.3f})."
    ]
    for method, y in baselines(rows).items():
        x = crossing(a, b, y)
        fit["crossings"][method] = x
        if x is None:
            lines.append(f"The fit never reaches {method}'s {y:.3f} tokens/step.")
        else:
            ratio = x / xs[-1]
            where = f"{ratio:,.0f}x the largest point" if ratio > 1 else "inside the measured range"
            lines.append(
                f"It reaches {method}'s {y:.3f} tokens/step at about {x:,.0f} training tokens "
                f"({where}{', an extrapolation' if ratio > 1 else ''})."
            )
    return " ".join(lines), fit


def plot(rows: list[dict[str, Any]], fit: dict[str, Any] | None, path: Path, k: int) -> None:
    """Tokens/step against training tokens (log x), the fit and each baseline as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = measured(rows)
    fig, ax = plt.subplots(figsize=(6, 3.6))
    ax.plot([p[0] for p in pts], [p[1] for p in pts], "o", color="tab:blue", label="head")
    for x, y, name in pts:
        ax.annotate(name, (x, y), textcoords="offset points", xytext=(4, -10), fontsize=7)
    lo = min((p[0] for p in pts), default=1.0)
    hi = max([p[0] for p in pts] + [c for c in (fit or {}).get("crossings", {}).values() if c])
    if fit:
        grid = [lo * (hi * 1.2 / lo) ** (i / 50) for i in range(51)]
        ax.plot(grid, [fit["a"] + fit["b"] * math.log(x) for x in grid], "--", color="tab:blue",
                label=f"fit: {fit['a']:.3f} + {fit['b']:.3f} ln(tokens)")  # fmt: skip
    for i, (method, y) in enumerate(baselines(rows).items()):
        ax.axhline(y, color=f"C{i + 1}", linestyle=":", label=method)
    ax.set_xscale("log")
    ax.set_xlabel("training tokens")
    ax.set_ylabel(f"tokens / step (k={k})")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
