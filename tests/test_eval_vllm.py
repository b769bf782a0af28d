"""The evaluate stage against the real vLLM CPU build, on the tiny target and a random head."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from draftsmith.evaluate.runs import lossless_check

pytestmark = pytest.mark.vllm

PROMPTS = [
    {"prompt": "Count from one to ten, then back down again."},
    {"prompt": "Repeat the word banana five times."},
    {"prompt": "List the days of the week."},
]


def evaluate(args: list[str]) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "draftsmith.evaluate", *args]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "WANDB_MODE": "disabled"}
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    path = tmp_path_factory.mktemp("eval") / "prompts.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    return path


def generations(out) -> dict:
    rows = [json.loads(x) for x in (out / "generations.jsonl").read_text().splitlines()]
    return {(r["method"], r["k"], r["id"]): r["token_ids"] for r in rows}


@pytest.fixture(scope="module")
def offline(tmp_path_factory, tiny_model_dir, tiny_eagle3_head, prompts):
    """One offline evaluation of a random head, k in {1, 3}, against both baselines."""
    out = tmp_path_factory.mktemp("offline") / "eval"
    proc = evaluate(
        [
            f"--model={tiny_model_dir}",
            f"--head={tiny_eagle3_head}",
            f"--datasets=[{prompts}]",
            "--k=[1,3]",
            "--max_tokens=24",
            "--concurrency=4",
            "--temperatures=[0.0]",
            f"--output={out}",
            "--wandb=false",
        ]
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, proc.stdout


def test_offline_head_against_baselines(offline):
    out, stdout = offline
    results = json.loads((out / "results.json").read_text())
    rows = {(r["method"], r["k"]): r for r in results["runs"]}
    assert set(rows) == {("none", None), ("ngram", 3), ("ngram", 1), ("eagle3", 3), ("eagle3", 1)}
    head = rows[("eagle3", 3)]
    c = head["counters"]
    assert c["num_drafts"] > 0 and c["num_draft_tokens"] == 3 * c["num_drafts"]
    assert head["acceptance_length"] == pytest.approx(
        1 + c["num_accepted_tokens"] / c["num_drafts"]
    )
    assert sum(c["accepted_per_pos"]) == c["num_accepted_tokens"]
    assert head["tokens_per_step"] == pytest.approx(
        head["output_tokens"] / (head["output_tokens"] - c["num_accepted_tokens"])
    )
    derived = rows[("eagle3", 1)]
    assert derived["derived_from_k"] == 3 and derived["seconds"] is None
    assert derived["acceptance_length"] == pytest.approx(
        1 + c["accepted_per_pos"][0] / c["num_drafts"]
    )
    # Greedy speculative decoding is lossless, for the head and for ngram.
    for key in [("eagle3", 3), ("ngram", 3)]:
        assert rows[key]["lossless"] == {"compared": 3, "identical": 3, "mismatches": []}
    assert rows[("eagle3", 3)]["speedup_vs_none"] > 0
    assert (out / "report.md").is_file()
    assert "eagle3" in stdout  # the summary table


def test_lossless_check_catches_another_target(tmp_path, make_tiny_llama, offline, prompts):
    """Outputs of a different model are reported as mismatches, with the first differing token."""
    other = make_tiny_llama(tmp_path / "other", seed=1)
    out = tmp_path / "other-eval"
    proc = evaluate(
        [
            f"--model={other}",
            f"--datasets=[{prompts}]",
            "--baselines=[none]",
            "--lossless=false",
            "--max_tokens=24",
            "--temperatures=[0.0]",
            f"--output={out}",
            "--wandb=false",
        ]
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = {"a": generations(offline[0]), "b": generations(out)}
    ids = sorted(i for (m, _, i) in runs["b"] if m == "none")
    a = [runs["a"][("none", None, i)] for i in ids]
    b = [runs["b"][("none", None, i)] for i in ids]
    check = lossless_check(ids, a, b)
    assert check["compared"] == 3 and check["identical"] < 3
    for m in check["mismatches"]:
        x, y, first = a[ids.index(m["id"])], b[ids.index(m["id"])], m["first_diff_token"]
        assert x[:first] == y[:first] and x[first : first + 1] != y[first : first + 1]
    assert lossless_check(ids, a, a)["identical"] == 3


def test_server_mode_measures_the_head_on_loopback(
    tmp_path, tiny_model_dir, tiny_eagle3_head, prompts
):
    out = tmp_path / "online"
    proc = evaluate(
        [
            f"--model={tiny_model_dir}",
            f"--head={tiny_eagle3_head}",
            f"--datasets=[{prompts}]",
            "--k=[2]",
            "--baselines=[none]",
            "--max_tokens=16",
            "--concurrency=2",
            "--mode=server",
            "--temperatures=[0.0]",
            f"--output={out}",
            "--wandb=false",
        ]
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    rows = {(r["method"], r["k"]): r for r in results["runs"]}
    head = rows[("eagle3", 2)]
    assert head["mode"] == "server" and head["counters"]["num_drafts"] > 0
    assert 0 < head["output_tokens"] <= 3 * 16
    assert head["lossless"]["compared"] == 3 and head["lossless"]["identical"] == 3
    assert (out / "logs" / "server-eagle3-k2.log").is_file()
