"""Expected acceptance (evaluate/expected.py), the sampling check (evaluate/sampling.py) and
their sections of the report, on hand-made numbers (no vLLM)."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from draftsmith.evaluate.expected import Expected, compare, draft_probabilities, replay
from draftsmith.evaluate.sampling import check, chi2_sf, homogeneity


def test_replay_walks_chains_as_vllm_does():
    # prompt [7, 7] (start = stream 1); reply 1 2 3 4 5 6. Drafts at stream t draft x[t+2..].
    tokens = torch.tensor([7, 7, 1, 2, 3, 4, 5, 6])
    drafts = torch.full((8, 2), 9)
    drafts[1] = torch.tensor([2, 3])  # stream 1 drafts x[3]=2 (right), x[4]=3 (right)
    drafts[4] = torch.tensor([5, 0])  # next chain at 1 + 2 + 1 = 4: x[6]=5 right, x[7]=6 wrong
    p = torch.full((8, 2), 0.5)
    p[4, 1] = 0.25
    out = replay(tokens, drafts, p, start=1)
    # chains at streams 1 and 4; the next, at 4 + 1 + 1 = 6, would draft x[8]: the reply
    # ended at x[7], so vLLM verifies nothing more (its last token ends the request).
    assert out.num_drafts == 2
    assert out.accepted_per_pos == [2, 1]
    assert out.expected_per_pos == [1.0, 0.75]  # stream 1: 0.5 + 0.5; stream 4: 0.5 + 0.25
    assert out.variance == pytest.approx(3 * 0.25 + 0.25 * 0.75)


def test_draft_probabilities_score_the_draft_at_its_position():
    tokens = torch.tensor([0, 1, 2, 3, 0])
    logits = torch.zeros(5, 4)
    logits[1, 2] = 2.0  # position 1 predicts x[2]
    drafts = torch.zeros(5, 1, dtype=torch.long)
    drafts[0, 0] = 2  # stream 0, draft 0 drafts x[2]: scored by logits[1]
    p = draft_probabilities(logits, drafts, tokens, temperature=0.5)
    want = torch.softmax(logits[1] / 0.5, -1)[2]
    assert p[0, 0] == pytest.approx(float(want))
    greedy = draft_probabilities(logits, drafts, tokens, temperature=0.0)
    # x[2] == 2, x[3] != 0, x[4] == 0; streams 3 and 4 have no token to check
    assert greedy[:, 0].tolist() == [1.0, 0.0, 1.0, 0.0, 0.0]


def sampled_walk(p_accept: float, steps: int, k: int, seed: int) -> tuple[dict, Expected]:
    """A lossless sampler's served counters and the replay's expectation: every draft is
    accepted with probability p_accept (the target's probability of it)."""
    rng = random.Random(seed)
    served = {"num_drafts": 0, "num_accepted_tokens": 0, "accepted_per_pos": [0] * k}
    want = Expected(num_drafts=steps, accepted_per_pos=[0] * k, expected_per_pos=[0.0] * k)
    for _ in range(steps):
        served["num_drafts"] += 1
        for j in range(k):
            want.expected_per_pos[j] += p_accept
            want.variance += p_accept * (1 - p_accept)
            if rng.random() >= p_accept:
                break
            served["accepted_per_pos"][j] += 1
            served["num_accepted_tokens"] += 1
    return served, want


def test_compare_passes_a_lossless_sampler_and_flags_a_broken_one():
    served, want = sampled_walk(0.3, 4000, 3, seed=0)
    row = compare(served, want)
    assert row["flag"] in (None, "noise") and abs(row["z"]) < 3
    assert row["expected_per_draft"] == pytest.approx(sum(want.expected_per_pos) / 4000)
    # A sampler that accepts with p^2 instead of p (e.g. q taken as p, not one-hot)
    broken, _ = sampled_walk(0.09, 4000, 3, seed=1)
    bad = compare(broken, want)
    assert bad["flag"] == "gap" and bad["relative_gap"] < -0.5 and bad["z"] < -3


def test_compare_calls_a_small_gap_on_few_drafts_noise():
    served = {"num_drafts": 50, "num_accepted_tokens": 6, "accepted_per_pos": [6]}
    want = Expected(50, [5], [5.0], variance=4.5)
    row = compare(served, want)
    assert row["relative_gap"] == pytest.approx(0.2) and row["flag"] == "noise"


def test_chi2_survival_matches_tables():
    assert chi2_sf(3.841, 1) == pytest.approx(0.05, abs=1e-3)
    assert chi2_sf(18.307, 10) == pytest.approx(0.05, abs=1e-3)
    assert chi2_sf(0.0, 3) == pytest.approx(1.0)


def draws(probs: list[float], n: int, seed: int) -> Counter:
    rng = random.Random(seed)
    return Counter((rng.choices(range(len(probs)), probs)[0], 0) for _ in range(n))


def test_homogeneity_accepts_one_distribution_and_rejects_a_shifted_one():
    p = [0.4, 0.3, 0.2, 0.05, 0.03, 0.02]
    same = homogeneity(draws(p, 2000, 0), draws(p, 2000, 1))
    assert same["p_value"] > 0.01 and same["tv"] < 0.05
    q = [0.3, 0.3, 0.3, 0.05, 0.03, 0.02]  # TV 0.1 from p
    moved = homogeneity(draws(q, 2000, 2), draws(p, 2000, 3))
    assert moved["p_value"] < 1e-6 and moved["tv"] > 0.05
    rare = homogeneity(Counter({(1,): 990, (2,): 5, (3,): 5}), Counter({(1,): 1000}))
    assert rare["df"] == 1  # the two rare outcomes pooled into one cell


def test_check_compares_each_method_with_no_speculation_under_bonferroni():
    p = [0.5, 0.3, 0.2]
    runs = {
        ("none", 1.0): [draws(p, 1000, 0), draws(p, 1000, 1)],
        ("eagle3 k=3", 1.0): [draws(p, 1000, 2), draws([0.2, 0.3, 0.5], 1000, 3)],
    }
    rows = check(runs)
    assert [(r["method"], r["prompt"]) for r in rows] == [("eagle3 k=3", 0), ("eagle3 k=3", 1)]
    assert rows[0]["alpha"] == pytest.approx(0.005)
    assert rows[0]["passed"] and not rows[1]["passed"]


def test_report_shows_served_against_expected_and_the_sampling_check(tmp_path):
    from test_eval_report import make_results

    from draftsmith.evaluate.report import summary_table, write_report

    results = make_results()
    hot = [dict(r, temperature=1.0) for r in results["runs"]]
    results["runs"] += hot
    head = next(r for r in hot if r["method"] == "eagle3" and r["k"] == 3 and "mt" in r["dataset"])
    head["expected"] = {
        "served_per_draft": 0.02,
        "expected_per_draft": 0.2,
        "served_per_pos": [0.02, 0.0, 0.0],
        "expected_per_pos": [0.15, 0.04, 0.01],
        "relative_gap": -0.9,
        "z": -25.0,
        "flag": "gap",
    }
    results["draft_sample_method"] = "greedy"
    results["config"].update(sampling_check_tokens=2, sampling_check_prompts=1)
    results["sampling_check"] = [
        {"method": "eagle3 k=3", "temperature": 1.0, "prompt": 0, "chi2": 3.0, "df": 4,
         "p_value": 0.56, "tv": 0.03, "n_a": 400, "n_b": 400, "outcomes": 9, "alpha": 0.01,
         "passed": True},
    ]  # fmt: skip
    text = write_report(results, tmp_path, wandb=False).read_text(encoding="utf-8")
    section = text[text.index("## mt_bench, temperature 1.0") :]
    assert "Served vs expected acceptance at temperature 1.0" in section
    assert "| eagle3 | 3 | 0.020 | 0.200 | 0.02 / 0.00 / 0.00 | 0.15 / 0.04 / 0.01 | -90.0% |" in (
        section
    )
    assert "**GAP**" in section
    assert "Drafts drawn greedy" in text
    assert "| eagle3 k=3 | 1.0 | 0 | 9 | 3.0 (4) | 0.56 | 0.030 | yes |" in text
    assert "Best k by tokens/s at temperature 1.0:" in text
    # one set of plots per temperature, each embedded
    for name in ("acceptance_per_position", "acceptance_length_vs_k", "speedup_vs_k"):
        assert (tmp_path / f"{name}.png").is_file() and (tmp_path / f"{name}_T1.0.png").is_file()
        assert f"]({name}_T1.0.png)" in text
    table = summary_table(results)
    assert "mt_bench T=1.0 eagle3 k=3: served 0.020 accepted per draft, expected 0.200 (GAP)" in (
        table
    )
    assert "sampling check: 1/1 passed" in table
    # A later run at one temperature removes the other temperature's stale plots.
    results["runs"] = [r for r in results["runs"] if r["temperature"] == 0.0]
    write_report(results, tmp_path, wandb=False)
    assert not (tmp_path / "speedup_vs_k_T1.0.png").exists()


def test_draft_sample_method_vllm_lacks_is_refused(monkeypatch):
    from typing import Literal

    import vllm.config.speculative as spec

    from draftsmith.core.errors import ConfigError
    from draftsmith.evaluate.runs import check_draft_sample_method

    check_draft_sample_method("probabilistic")  # vLLM 0.32 has both
    monkeypatch.setattr(spec, "DraftSampleMethod", Literal["greedy"])
    with pytest.raises(ConfigError, match="draft_sample_method: 'probabilistic' is not one of"):
        check_draft_sample_method("probabilistic")


@pytest.mark.parametrize(
    "options, why",
    [
        ({"method": "dflash"}, "computed for eagle3 heads only, not dflash"),
        ({"draft_sample_method": "probabilistic"}, "greedy drafts only"),
        ({"mode": "server"}, "offline mode only"),
        ({}, "the torch replica failed (OSError: no target here)"),
    ],
)
def test_runs_without_an_expectation_say_why(monkeypatch, options, why):
    from draftsmith.evaluate import expected, runs
    from draftsmith.evaluate.config import EvalConfig
    from draftsmith.evaluate.main import add_expected

    def no_replica(*args):
        raise OSError("no target here")

    monkeypatch.setattr(expected, "DraftReplica", no_replica)
    cfg = EvalConfig(head="head", **{"method": "eagle3", **options})
    rec = {
        "method": cfg.method,
        "k": 3,
        "dataset": "d",
        "temperature": 1.0,
        "counters": {"num_drafts": 1},
    }
    outputs = {(runs.Method(cfg.method, 3), "d", 1.0): [[1, 2]]}
    add_expected(cfg, None, [rec], outputs, {"d": [[0]]})
    assert why in rec["expected_skipped"] and "expected" not in rec
