"""Every kind through the front door: ``draftsmith pipeline`` trains, exports and serves each
drafter kind on a peaked tiny target of the family it is for.

The kinds share one output directory, so the pipeline's content addresses give them one
extraction (the same data and validation set, captured once by vLLM), as a user comparing
kinds on one target gets. Per kind: exit 0, the head is lossless, its drafts are accepted,
and vLLM's acceptance length is within 5% of what training's validation walk simulated on
the same prompts. EAGLE-3 runs on every family in ``test_families.py``; DSpark, DFlash2 and
MTP, on their own families, in their own modules.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from draftsmith.drafters.dflash.export import MASK_EMBEDDING_FILE
from draftsmith.pipelines.main import main as pipeline_main
from draftsmith.pipelines.study import train_metrics

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [f"Write a short note about topic number {i}." for i in range(16)]
# kind -> (the recipe it starts from, its train.model changes, the method vLLM serves it with,
# epochs). EAGLE-1 drafts over the whole 49k vocabulary (no draft vocabulary): 25x the loss's
# cost per token of the others here, so it trains one TTT step for fewer epochs.
KINDS = {
    "peagle": ("tiny", {"ttt_steps": 3, "parallel_drafting": True, "num_anchors": 64}, "peagle",
               20),
    "eagle1": ("tiny", {"kind": "eagle", "ttt_steps": 1, "draft_vocab_size": None}, "eagle", 6),
    "dflash": ("tiny-dflash", {}, "dflash", 20),
}  # fmt: skip


@pytest.fixture(scope="module")
def shared(tmp_path_factory, make_tiny_llama) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("kinds")
    target = make_tiny_llama(root / "peaked", seed=1, norm_scale=8.0)
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return {"root": root, "target": target, "prompts": prompts}


def pipeline_config(shared: dict[str, Path], kind: str) -> Path:
    recipe, model, _, epochs = KINDS[kind]
    cfg = yaml.safe_load((ROOT / "configs" / "pipelines" / f"{recipe}.yaml").read_text())
    prompts = str(shared["prompts"])
    cfg.update(model=str(shared["target"]), output=str(shared["root"] / "run"),
               validation={"data": prompts})  # fmt: skip
    cfg["extract"].update(data=[prompts], max_new_tokens=48, samples_per_shard=32)
    cfg["train"]["trainer"].update(
        max_epochs=epochs, check_val_every_n_epoch=epochs, num_sanity_val_steps=0,
        logger=[{"class_path": "lightning.pytorch.loggers.CSVLogger"}],
    )  # fmt: skip
    cfg["train"]["model"].update(model)
    if kind == "eagle1":  # EAGLE-1 reads the last layer's state alone
        cfg["train"]["data"]["aux_layers"] = [8]
    k = cfg["export"]["num_speculative_tokens"] = 3
    # Served on the prompts it trained on, on purpose (the walk simulated those): no guard.
    cfg["eval"].update(datasets=[prompts], k=[k], max_tokens=48, overlap_threshold=1.1,
                       concurrency=16)  # fmt: skip
    cfg["eval"].pop("method", None)  # named by the exported head's config.json
    path = shared["root"] / f"{kind}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.parametrize("kind", list(KINDS))
def test_kind_trains_exports_and_serves_as_simulated_through_the_pipeline(kind, shared):
    code = pipeline_main([f"--config={pipeline_config(shared, kind)}"])
    assert code == 0, f"{kind}: pipeline exit {code}"
    state = json.loads((shared["root"] / "run" / "pipeline.json").read_text())
    dirs = {s: Path(e["dir"]) for s, e in state["stages"].items()}
    results = json.loads((dirs["eval"] / "results.json").read_text())
    method = KINDS[kind][2]
    run = next(r for r in results["runs"] if r["method"] == method)
    assert run["lossless"]["mismatches"] == [] and run["lossless"]["compared"] == len(PROMPTS)
    assert run["counters"]["num_accepted_tokens"] > 0, run
    simulated = train_metrics(dirs["train"])["val/acceptance_length"]
    served = run["acceptance_length"]
    print(f"\n{kind}: simulated {simulated:.4f}, served {served:.4f}, {run['counters']}")
    assert abs(served - simulated) <= 0.05 * served, (served, simulated)
    head = json.loads((dirs["export"] / "config.json").read_text())
    if kind == "peagle":  # vllm serve DIR drafts in parallel from the config alone
        assert head["speculators_model_type"] == "peagle"
    if kind == "dflash":
        assert head["dflash_config"]["target_layer_ids"] == [1, 3, 4]  # ids 2, 4, 5 - 1
        assert (dirs["export"] / MASK_EMBEDDING_FILE).is_file()  # no spare id in SmolLM2's
    # One extraction for every kind: the first run captured it, the later ones reuse it.
    status = state["stages"]["extract"]["status"]
    assert status == ("skipped" if "extract" in shared else "done"), status
    assert shared.setdefault("extract", dirs["extract"]) == dirs["extract"]
