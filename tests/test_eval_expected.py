"""Expected acceptance (evaluate/expected.py), the sampling check (evaluate/sampling.py) and
their sections of the report, on hand-made numbers (no vLLM)."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from draftsmith.evaluate.expected import Expected, acceptance, compare, replay
from draftsmith.evaluate.sampling import check, chi2_sf, homogeneity


def greedy_terms(tokens, drafts, p):
    """accept / posterior of greedy drafts: accepted with p, exactly when the draft is served."""
    n, k = drafts.shape
    served = torch.stack([tokens[(torch.arange(n) + j + 2).clamp(max=n - 1)] for j in range(k)], 1)
    return p, (drafts == served).float()


def test_replay_walks_chains_as_vllm_does():
    # prompt [7, 7] (start = stream 1); reply 1 2 3 4 5 6. Drafts at stream t draft x[t+2..].
    tokens = torch.tensor([7, 7, 1, 2, 3, 4, 5, 6])
    drafts = torch.full((8, 2), 9)
    drafts[1] = torch.tensor([2, 3])  # stream 1 drafts x[3]=2 (right), x[4]=3 (right)
    drafts[4] = torch.tensor([5, 0])  # next chain at 1 + 2 + 1 = 4: x[6]=5 right, x[7]=6 wrong
    p = torch.full((8, 2), 0.5)
    p[4, 1] = 0.25
    out = replay(*greedy_terms(tokens, drafts, p), start=1)
    # chains at streams 1 and 4; the next, at 4 + 1 + 1 = 6, would draft x[8]: the reply
    # ended at x[7], so vLLM verifies nothing more (its last token ends the request).
    assert out.num_drafts == 2
    assert out.accepted_per_pos == [2, 1]
    assert out.expected_per_pos == [1.0, 0.75]  # stream 1: 0.5 + 0.5; stream 4: 0.5 + 0.25
    assert out.variance == pytest.approx(3 * 0.25 + 0.25 * 0.75)
    # Rows past the served end (the target's greedy continuation at T = 0) score the drafts
    # vLLM verified past the reply's last token; no chain starts there.
    longer = torch.cat([tokens, torch.tensor([8])])
    drafts = torch.cat([drafts, torch.full((1, 2), 9)])
    drafts[6] = torch.tensor([6, 8])  # a chain at 6 (4 + 1 + 1): x[8] is past the reply
    p = torch.cat([p, torch.full((1, 2), 0.5)])
    out = replay(*greedy_terms(longer, drafts, p), start=1, end=8)
    assert out.num_drafts == 2 and out.accepted_per_pos == [2, 1]  # unchanged: 6 + 2 >= 8
    drafts[4] = torch.tensor([5, 6])  # stream 4 now has both right: x[7] = 6, then x[8] = 8?
    drafts[4, 1] = 6
    out = replay(*greedy_terms(longer, drafts, p), start=1, end=8)
    assert out.accepted_per_pos == [2, 2] and out.num_drafts == 2


def test_posterior_replay_by_hand():
    """Random drafts: chains branch with the posterior that each draft was accepted."""
    accept = torch.full((6, 2), 0.6)
    posterior = torch.zeros(6, 2)
    posterior[1] = torch.tensor([0.5, 1.0])  # chain at 1: x[3] accepted w.p. 0.5, then x[4] surely
    posterior[2, 0] = 0.0  # a chain at 2 (draft 0 of 1 rejected) surely rejects x[4]
    posterior[3, 0] = 1.0  # a chain at 3 accepts x[5]; its draft 1 (x[6]) is past the reply
    out = replay(accept, posterior, start=1)
    # Chain at 1 (mass 1); at 2 (0.5: draft 0 rejected); at 3 (0.5: chain at 2 rejected); a
    # chain at 4 (chain 1 fully accepted, mass 0.5) would draft x[6]: the reply has ended.
    assert out.num_drafts == pytest.approx(2.0)
    assert out.accepted_per_pos == pytest.approx([1.0, 0.5])
    assert out.expected_per_pos == pytest.approx([0.6 * 2, 0.6 * 0.5])
    assert out.variance == pytest.approx(0.24 * 2.5)


def test_acceptance_of_greedy_and_probabilistic_drafts_by_hand():
    p = torch.tensor([0.5, 0.3, 0.2])
    q = torch.tensor([0.2, 0.3, 0.5])
    tokens = torch.tensor([0, 0, 0, 2])  # x[2] = 0, x[3] = 2
    target = torch.zeros(4, 3)
    target[1:3] = p.log()  # rows 1, 2 predict x[2], x[3]
    draft = q.log().expand(4, 3).clone()
    a, r = acceptance(target, draft, tokens, 0, 1.0, greedy=False)
    # stream 0 drafts x[2] (served 0), stream 1 drafts x[3] (served 2); 2, 3 have no token
    assert a.tolist() == pytest.approx([0.7, 0.7, 0.0, 0.0])  # sum min(p, q) = 0.2 + 0.3 + 0.2
    assert r.tolist() == pytest.approx([0.4, 1.0, 0.0, 0.0])  # min(1, q(x) / p(x))
    a, r = acceptance(target, draft, tokens, 0, 1.0, greedy=True)  # the argmax, 2, one-hot
    assert a.tolist() == pytest.approx([0.2, 0.2, 0.0, 0.0]) and r.tolist() == [0, 1, 0, 0]
    a, r = acceptance(target, draft, tokens, 0, 0.0, greedy=False)  # T = 0: greedy either way
    assert a.tolist() == r.tolist() == [0, 1, 0, 0]
    sharp = acceptance(target, draft, tokens, 0, 0.5, greedy=False)[0]  # p and q at T = 0.5
    p2, q2 = torch.softmax(p.log() / 0.5, -1), torch.softmax(q.log() / 0.5, -1)
    assert sharp[0] == pytest.approx(float(torch.minimum(p2, q2).sum()))
    # Draft j = 1 of stream 0 drafts x[3], scored by the target's row 2.
    a, r = acceptance(target, draft, tokens, 1, 1.0, greedy=False)
    assert a.tolist() == pytest.approx([0.7, 0.0, 0.0, 0.0]) and r[0] == pytest.approx(1.0)
    # A reduced draft vocabulary: -inf logits outside it have q = 0.
    reduced = draft.clone()
    reduced[:, 0] = float("-inf")  # q = [0, 0.375, 0.625]
    a, r = acceptance(target, reduced, tokens, 0, 1.0, greedy=False)
    assert a[0] == pytest.approx(0.0 + 0.3 + 0.2) and r[0] == 0.0  # x = 0 was never drafted


def test_lossless_rejection_sampling_meets_the_replay_in_mean():
    """Speculative sampling simulated as vLLM runs it (drafts drawn from q, accepted with
    min(1, p / q), else a token from max(0, p - q)): the served counts' mean meets the
    replay's expected and posterior counts on the same replies."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # thousands of tiny ops: threads only wait on each other
    try:
        simulate_and_replay()
    finally:
        torch.set_num_threads(threads)


def simulate_and_replay() -> None:
    g = torch.Generator().manual_seed(0)
    n, k, v, start, replies = 12, 3, 4, 1, 1500
    p = torch.softmax(2 * torch.randn(n, v, generator=g), -1)  # the target at each position
    q = torch.softmax(2 * torch.randn(n, k, v, generator=g), -1)  # draft j of stream t
    residual = (p[:, None, None] - q[None]).clamp(min=0)  # [pos, t, j, v]
    pl, ql, rl = p.tolist(), q.tolist(), residual.tolist()
    rng = random.Random(0)
    served, replayed = [0] * k, Expected(accepted_per_pos=[0.0] * k, expected_per_pos=[0.0] * k)
    target_logits = torch.cat([p[1:].log(), torch.zeros(1, v)])  # row i predicts x[i + 1]
    for _ in range(replies):
        tokens, t = [0] * n, start
        while t + 2 < n:  # a chain at t
            for j in range(k):
                pos = t + j + 2
                if pos >= n:  # the reply ends (max_tokens): nothing more is verified
                    t = n
                    break
                d = rng.choices(range(v), ql[t][j])[0]
                if rng.random() < min(1.0, pl[pos][d] / ql[t][j][d]):
                    tokens[pos] = d
                    served[j] += 1
                    continue
                tokens[pos] = rng.choices(range(v), rl[pos][t][j])[0]  # the recovered token
                t += j + 1
                break
            else:  # all k accepted: the bonus token, then the next chain
                t += k + 1
                if t + 1 < n:
                    tokens[t + 1] = rng.choices(range(v), pl[t + 1])[0]
        x = torch.tensor(tokens)
        accept, posterior = torch.zeros(n, k), torch.zeros(n, k)
        for j in range(k):
            accept[:, j], posterior[:, j] = acceptance(
                target_logits, q[:, j].log(), x, j, 1.0, greedy=False
            )
        replayed.add(replay(accept, posterior, start))
    sd = replayed.variance**0.5
    for j in range(k):
        assert abs(served[j] - replayed.expected_per_pos[j]) < 3 * sd, (j, served, replayed)
        assert abs(served[j] - replayed.accepted_per_pos[j]) < 3 * sd, (j, served, replayed)
    # Greedy drafts' acceptance (the target's probability of q's argmax) is another figure:
    # the test tells the two apart.
    greedy = sum(float(p[t + 2, q[t, 0].argmax()]) for t in range(start, n - 2)) / (n - 3)
    assert abs(greedy - replayed.expected_per_pos[0] / replayed.num_drafts) > 0.1


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
        ({"method": "mtp"}, "mtp heads have no torch replica (kinds with one: eagle3, eagle, "),
        ({"mode": "server"}, "offline mode only"),
        ({}, "the torch replica failed (OSError: no target here)"),
    ],
)
def test_runs_without_an_expectation_say_why(monkeypatch, options, why):
    from draftsmith.evaluate import replay, runs
    from draftsmith.evaluate.config import EvalConfig

    def no_replica(*args):
        raise OSError("no target here")

    if not options:
        monkeypatch.setattr(replay, "TargetReplica", no_replica)
    monkeypatch.setattr("draftsmith.drafters.eagle3.replica.Eagle3Replica", lambda *a: object())
    cfg = EvalConfig(head="head", **{"method": "eagle3", **options})
    rec = {
        "method": cfg.method,
        "k": 3,
        "dataset": "d",
        "temperature": 1.0,
        "counters": {"num_drafts": 1},
    }
    outputs = {(runs.Method(cfg.method, 3), "d", 1.0): [[1, 2]]}
    replay.add_expected(cfg, None, [rec], outputs, {"d": [[0]]})
    assert why in rec["expected_skipped"] and "expected" not in rec


def test_report_marks_simulated_rows_and_says_why_the_head_was_not_served(tmp_path):
    from test_eval_report import make_results

    from draftsmith.evaluate.config import EvalConfig
    from draftsmith.evaluate.replay import simulated_row
    from draftsmith.evaluate.report import summary_table, write_report

    results = make_results()
    results["head"]["method"] = "dspark"
    results["runs"] = [r for r in results["runs"] if r["method"] == "none"]
    cfg = EvalConfig(head="h", method="dspark")
    replayed = Expected(num_drafts=10, accepted_per_pos=[5.0, 2.0, 1.0],
                        expected_per_pos=[5.0, 2.0, 1.0])  # fmt: skip
    row = simulated_row(cfg, "mt_bench", 0.0, 80, 3, replayed)
    assert row["acceptance_length"] == pytest.approx(1.8) and row["counters"] is None
    assert row["simulated"]["replayed_accepted_per_pos"] == [5, 2, 1]
    results["runs"].append(row)
    command = 'vllm serve T --speculative-config \'{"method": "dspark"}\''
    results["head_not_served"] = {"reason": "vLLM serves DSpark heads only in its GPU model "
                                  "runner, not on this CPU build", "command": command,
                                  "simulated_skipped": None}  # fmt: skip
    text = write_report(results, tmp_path, wandb=False).read_text(encoding="utf-8")
    assert "| dspark (simulated) | 3 | 1.800 | – | 0.50 / 0.20 / 0.10 |" in text
    line = next(x for x in text.splitlines() if "was not served" in x)
    assert "GPU model runner" in line and f"`{command}`" in line
    assert "its rows below are simulated" in line and "Rows marked (simulated)" in text
    assert (tmp_path / "acceptance_length_vs_k.png").is_file()
    assert "dspark (simulated)" in summary_table(results)
    results["head_not_served"]["simulated_skipped"] = "the torch replica failed (OSError: x)"
    text = write_report(results, tmp_path, wandb=False).read_text(encoding="utf-8")
    assert "no simulated rows (the torch replica failed (OSError: x))" in text
