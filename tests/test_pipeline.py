"""The pipeline end to end on the tiny target: content-addressed stages, resume, dry run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from draftsmith.evaluate.config import EvalConfig
from draftsmith.evaluate.runs import engine_count
from draftsmith.pipelines.config import PipelineConfig, PipelineError, parse_pipeline
from draftsmith.pipelines.main import main as pipeline_main
from draftsmith.pipelines.stage_dirs import (
    EVAL_MIN_PROMPTS,
    TRAIN_STARTUP_S,
    Plan,
    eval_prompts,
    shard_seconds_per_sample,
    train_time,
)

CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "pipelines"


def tiny_config(tmp_path: Path, model: Path, source: str = "tiny", **changes) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    cfg = yaml.safe_load((CONFIGS / f"{source}.yaml").read_text())
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps({"prompt": f"Tell me about the number {i}."}) + "\n" for i in range(12))
    )
    held_out = tmp_path / "eval.jsonl"  # the overlap guard refuses training prompts
    held_out.write_text(
        "".join(json.dumps({"prompt": f"Write a haiku about colour {c}."}) + "\n" for c in "RGB")
    )
    cfg.update(model=str(model), output=str(tmp_path / "run"), **changes)
    cfg["extract"]["data"] = [str(prompts)]
    cfg["eval"]["datasets"] = [str(held_out)]
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.vllm
def test_pipeline_runs_resumes_and_skips_finished_stages(
    tmp_path, tiny_model_dir, capsys, monkeypatch
):
    # A 10-minute budget whose extraction share (0.6 s) ends after the first shard: the
    # data shrinks to whole shards, training keeps its share. Training validates on a
    # separate set of prompts the target answers.
    val_prompts = tmp_path / "val.jsonl"
    val_prompts.write_text(
        "".join(json.dumps({"prompt": f"Describe animal number {i}."}) + "\n" for i in range(3))
    )
    config = tiny_config(
        tmp_path,
        tiny_model_dir,
        time_budget="00:00:10:00",
        extract_share=0.001,
        train_share=0.5,
        validation={"data": str(val_prompts)},
    )
    # Stopped after training (as an interruption would), then run to the end.
    said: list[str] = []
    monkeypatch.setattr("draftsmith.extract.main.say", lambda *parts: said.append(str(parts)))
    assert pipeline_main([f"--config={config}", "--stop_after=train"]) == 0
    # One vLLM engine captured both the validation set and the data.
    assert sum("extract: starting vLLM" in line for line in said) == 1, said
    assert sum("extract: reusing the running vLLM" in line for line in said) == 1, said
    state = json.loads((tmp_path / "run" / "pipeline.json").read_text())
    assert list(state["stages"]) == ["extract", "train"]
    manifest = json.loads((Path(state["stages"]["extract"]["dir"]) / "manifest.json").read_text())
    assert manifest["stopped_by"] == "time_limit" and not manifest["complete"]
    assert len(manifest["shards"]) == 1 and manifest["num_shards_planned"] == 2
    assert manifest["num_samples"] == 8  # one whole shard of samples_per_shard 8
    val_dir = Path(state["stages"]["extract"]["dir"]) / "val"
    assert json.loads((val_dir / "manifest.json").read_text())["num_samples"] == 3
    train_yaml = yaml.safe_load((Path(state["stages"]["train"]["dir"]) / "stage.yaml").read_text())
    assert train_yaml["trainer"]["max_time"] == "00:00:04:30"  # 0.5 x 600 - TRAIN_STARTUP_S
    assert train_yaml["data"]["val_data"] == str(val_dir)
    assert state["budget"]["train_max_time_s"] == 300 - TRAIN_STARTUP_S
    assert pipeline_main([f"--config={config}"]) == 0
    state = json.loads((tmp_path / "run" / "pipeline.json").read_text())
    status = {s: e["status"] for s, e in state["stages"].items()}
    assert status == {"extract": "skipped", "train": "skipped", "export": "done", "eval": "done"}
    dirs = {s: Path(e["dir"]) for s, e in state["stages"].items()}
    assert (dirs["train"] / "checkpoints" / "last.ckpt").is_file()
    assert (dirs["export"] / "config.json").is_file()
    eval_yaml = yaml.safe_load((dirs["eval"] / "stage.yaml").read_text())
    assert 60 <= eval_yaml["time_limit"] <= 600  # what the budget had left for evaluation
    results = json.loads((dirs["eval"] / "results.json").read_text())
    head_run = next(r for r in results["runs"] if r["method"] == "eagle3")
    assert head_run["lossless"]["mismatches"] == [] and head_run["counters"]["num_drafts"] > 0
    assert "eagle3" in (tmp_path / "run" / "summary.md").read_text()
    capsys.readouterr()

    # Same config again: nothing reruns, and the last results are printed again (a run
    # that evaluated printed them once, from the eval stage). A changed eval section
    # reruns eval alone.
    assert pipeline_main([f"--config={config}"]) == 0
    state = json.loads((tmp_path / "run" / "pipeline.json").read_text())
    assert {e["status"] for e in state["stages"].values()} == {"skipped"}
    assert "acc len" in capsys.readouterr().out
    changed = yaml.safe_load(config.read_text())
    changed["eval"]["max_tokens"] = 16
    config.write_text(yaml.safe_dump(changed))
    plan = Plan(PipelineConfig(**{k: v for k, v in changed.items()}))
    assert plan.dirs["train"] == dirs["train"] and plan.dirs["eval"] != dirs["eval"]


def test_content_addresses_follow_upstream_changes(tmp_path):
    base = PipelineConfig(model="m", output=str(tmp_path), extract={"data": ["a"]})
    other = PipelineConfig(model="m", output=str(tmp_path), extract={"data": ["b"]})
    a, b = Plan(base), Plan(other)
    assert all(a.dirs[s] != b.dirs[s] for s in a.dirs)  # every downstream stage moves
    c = Plan(PipelineConfig(model="m", output=str(tmp_path), extract={"data": ["a"]},
                            eval={"k": [3]}))  # fmt: skip
    assert c.dirs["train"] == a.dirs["train"] and c.dirs["eval"] != a.dirs["eval"]


def test_the_mtp_kind_extracts_the_last_layer_alone_unless_layer_ids_are_given(tmp_path):
    """MTP reads layer N only: with no extract.layer_ids its pipeline taps [N] (and its
    validation set too), at an address of its own; ids given in the section win."""
    target = tmp_path / "mimo"
    target.mkdir()
    config = {"architectures": ["MiMoForCausalLM"], "hidden_size": 128, "vocab_size": 1000,
              "num_hidden_layers": 6, "num_nextn_predict_layers": 1}  # fmt: skip
    (target / "config.json").write_text(json.dumps(config))
    base = dict(model=str(target), output=str(tmp_path / "run"), extract={"data": ["a"]})
    eagle3 = Plan(PipelineConfig(**base))
    mtp = Plan(PipelineConfig(**base, train={"model": {"kind": "mtp"}},
                              validation={"data": "b"}))  # fmt: skip
    assert "layer_ids" not in eagle3.section("extract")  # extraction's default
    assert mtp.section("extract")["layer_ids"] == [6]
    assert mtp.validation_section()["layer_ids"] == [6]
    assert mtp.dirs["extract"] != Plan(PipelineConfig(**base, validation={"data": "b"})).dirs[
        "extract"]  # fmt: skip
    given = dict(base, extract={"data": ["a"], "layer_ids": [3, 6]})
    chosen = Plan(PipelineConfig(**given, train={"model": {"kind": "mtp"}}))
    assert chosen.section("extract")["layer_ids"] == [3, 6]
    assert chosen.dirs["extract"] == Plan(PipelineConfig(**given)).dirs["extract"]


def test_a_stream_section_reaches_training_and_moves_both_addresses(tmp_path):
    budget = dict(output=str(tmp_path), time_budget="00:00:20:00", extract={"data": ["a"]})
    offline = Plan(PipelineConfig(**budget))
    streamed = Plan(PipelineConfig(**budget, stream={"shards": 3, "policy": "drop"}))
    assert streamed.dirs["extract"] != offline.dirs["extract"]
    assert streamed.dirs["train"] != offline.dirs["train"]
    assert streamed.section("train")["data"]["stream"] == {"shards": 3, "policy": "drop"}
    assert "stream" not in offline.section("train")["data"]
    # The producer closes the data where offline extraction stops; training goes on.
    assert streamed.section("extract")["time_limit"] == 360
    assert offline.section("extract")["time_limit"] == 360
    # Training gets both shares, less what the validation set took (it ran before).
    max_time, _ = train_time(streamed.cfg, extract_seconds=40.0)
    assert max_time == "00:00:12:50"  # (0.3 x 1200 - 40) + 0.4 x 1200 - 30 = 770 s
    (tmp_path / "manifest.json").write_text(json.dumps({"shards": []}))
    with pytest.raises(PipelineError, match="stream: .* skips extraction"):
        Plan(PipelineConfig(output=str(tmp_path), data=str(tmp_path), stream={"shards": 2}))


def test_a_given_dataset_is_addressed_by_its_shards_not_its_manifest_bytes(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    manifest = {"layer_ids": [1, 2], "shards": [{"sha256": "aa"}, {"sha256": "bb"}],
                "config": {"seed": 0}}  # fmt: skip
    (data / "manifest.json").write_text(json.dumps(manifest))
    first = Plan(PipelineConfig(output=str(tmp_path), data=str(data))).dirs["train"]
    manifest["config"]["new_option"] = None  # an up-to-date extract rewrote the manifest
    (data / "manifest.json").write_text(json.dumps(manifest, indent=2))
    assert Plan(PipelineConfig(output=str(tmp_path), data=str(data))).dirs["train"] == first
    manifest["shards"][1]["sha256"] = "cc"  # different data: a different train stage
    (data / "manifest.json").write_text(json.dumps(manifest))
    assert Plan(PipelineConfig(output=str(tmp_path), data=str(data))).dirs["train"] != first


def test_time_budget_cuts_prompts_never_replies_when_the_hour_is_slow(tmp_path):
    three = {"k": [1, 2, 3], "baselines": ["none", "ngram", "suffix"], "max_tokens": 256,
             "temperatures": [0.0]}  # fmt: skip
    cfg = PipelineConfig(output=str(tmp_path), time_budget="00:00:20:00", eval=three)
    section = EvalConfig(**three, head="head")

    def cut(section: EvalConfig, *args, **kwargs):  # the pipeline's cut with eval's own count
        return eval_prompts(cfg, section, engine_count(section), *args, **kwargs)

    assert engine_count(section) == (4, 1)  # none, suffix, head, ngram (k=3, the rest derived)
    every_k = EvalConfig(**three, head="head", derive_k=False)
    assert engine_count(every_k) == (10, 3)  # every k its own engine
    # 2 s per extracted sample at 256 tokens: 30 + 2 x 40 = 110 s per engine, 440 s for 4
    limit, info = cut(section, 2.0, 500.0, [20, 20], extract_tokens=256)
    assert limit is None and info["eval_predicted_s"] == 440.0 and info["eval_engines"] == 4
    # 300 s left: all 4 engines, suffix's included, get 75 s each, 45 s of prompts: 22
    # prompts, 11 a set (suffix is budgeted, never left to whatever time remains)
    limit, info = cut(section, 2.0, 300.0, [20, 20], extract_tokens=256)
    assert limit == 11 and info["eval_prompts_per_set"] == [11, 11]
    assert info["eval_max_tokens"] == 256  # replies keep their length
    # Extraction at 128 tokens per reply: each prompt of a 256-token evaluation costs double.
    limit, _ = cut(section, 1.0, 300.0, [20, 20], extract_tokens=128)
    assert limit == 11
    # Two temperatures: every engine decodes each prompt twice (the demo once overran here).
    two = EvalConfig(**{**three, "temperatures": [0.0, 1.0]}, head="head")
    limit, info = cut(two, 2.0, 500.0, [20, 20], extract_tokens=256)
    assert info["eval_predicted_s"] == 4 * (30 + 2 * 2 * 40) and limit == 11  # 4 x 118 s
    limit, _ = cut(section, 20.0, left_s=100.0, prompts_per_set=[20, 20])
    assert limit == EVAL_MIN_PROMPTS  # never fewer prompts than the floor
    assert cut(section, 0.0, left_s=100.0, prompts_per_set=[20]) == (None, {})
    # The cut moves the evaluation's address: a rerun on another hour does not reuse it.
    plan = Plan(cfg)
    before = plan.dirs["eval"]
    plan.set_eval_limit(17)
    assert plan.dirs["eval"] != before and plan.section("eval")["limit"] == 17
    plan.set_eval_limit(None)
    assert plan.section("eval").get("limit") is None


def test_extraction_speed_is_read_from_the_shards_seconds(tmp_path):
    assert shard_seconds_per_sample(tmp_path) is None  # no manifest: nothing measured
    shards = [{"samples": 32, "seconds": 64.0}, {"samples": 32, "seconds": 96.0},
              {"samples": 16, "seconds": 40.0}]  # fmt: skip
    manifest = {"shards": shards, "config": {"max_new_tokens": 256}}
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    assert shard_seconds_per_sample(tmp_path) == (2.5, 256)  # the median of 2, 3 and 2.5


def test_time_budget_gives_training_its_share_whatever_extraction_took(tmp_path):
    cfg = PipelineConfig(output=str(tmp_path), time_budget="00:00:20:00")  # 1200 s, 0.3 / 0.4
    fast, info = train_time(cfg, extract_seconds=300.0)  # 60 s of extraction's 360 unused
    assert fast == "00:00:08:30" and info["extract_unused_s"] == 60.0  # 480 + 60 - 30
    slow, info = train_time(cfg, extract_seconds=500.0)  # overran: training keeps its share
    assert slow == "00:00:07:30" and info["train_max_time_s"] == 450.0
    with pytest.raises(PipelineError, match="train_share=0.04 leaves 18 s to train"):
        train_time(PipelineConfig(time_budget="00:00:20:00", train_share=0.04), 400.0)

    plan = Plan(cfg)
    assert plan.section("extract")["time_limit"] == 360
    plan.train_max_time = slow  # what run() sets before the train stage
    assert plan.section("train")["trainer"]["max_time"] == "00:00:07:30"
    # The budget is part of the extract and train addresses.
    other = Plan(PipelineConfig(output=str(tmp_path)))
    assert other.dirs["extract"] != plan.dirs["extract"]
    assert other.dirs["train"] != plan.dirs["train"]


def test_time_budget_errors_name_the_option(tmp_path):
    with pytest.raises(PipelineError, match="time_budget='19 minutes': expected DD:HH:MM:SS"):
        Plan(PipelineConfig(output=str(tmp_path), time_budget="19 minutes"))
    with pytest.raises(PipelineError, match="extract_share=0.7, train_share=0.4: each"):
        Plan(PipelineConfig(output=str(tmp_path), time_budget="0:19:00", extract_share=0.7))
    with pytest.raises(PipelineError, match="eval_engine_start_s=-1, .*must be >= 0"):
        Plan(PipelineConfig(output=str(tmp_path), time_budget="0:19:00", eval_engine_start_s=-1))
    (tmp_path / "manifest.json").write_text("{}")
    with pytest.raises(PipelineError, match="time_budget shares the run.*data: skips"):
        Plan(PipelineConfig(output=str(tmp_path), time_budget="0:19:00", data=str(tmp_path)))


def test_command_line_overrides_reach_the_stages_and_move_their_addresses(
    tmp_path, tiny_model_dir, capsys
):
    config = tiny_config(tmp_path, tiny_model_dir)
    base = [f"--config={config}", "--dry_run=true"]
    assert pipeline_main(base) == 0
    plain = Plan(parse_pipeline(base))
    prompts = tmp_path / "other.jsonl"
    prompts.write_text(json.dumps({"prompt": "Name a colour."}) + "\n")
    # Both spellings, a single source (no list), and a key three levels deep.
    args = [*base, "--extract.data", str(prompts), "--train.model.lr=0.01",
            "--train.trainer.max_epochs", "1", "--eval.k=[3]"]  # fmt: skip
    assert pipeline_main(args) == 0
    plan = Plan(parse_pipeline(args))
    stage = {s: plan.section(s) for s in plan.dirs}
    assert stage["extract"]["data"] == str(prompts)
    assert stage["train"]["model"]["lr"] == 0.01 and stage["train"]["trainer"]["max_epochs"] == 1
    assert stage["train"]["model"]["kind"] == "eagle3"  # the YAML's other keys stay
    assert stage["eval"]["k"] == [3]
    assert all(plan.dirs[s] != plain.dirs[s] for s in plan.dirs)
    # An eval-only override moves the eval stage alone.
    only_eval = Plan(parse_pipeline([*base, "--eval.max_tokens", "8"]))
    assert only_eval.dirs["train"] == plain.dirs["train"]
    assert only_eval.dirs["eval"] != plain.dirs["eval"]


def test_validation_section_is_extracted_beside_the_data_and_validates_training(
    tmp_path, tiny_model_dir, capsys
):
    config = tiny_config(tmp_path, tiny_model_dir)
    base = [f"--config={config}", "--dry_run=true"]
    args = [*base, "--validation.data", "sharegpt@heldout", "--validation.limit", "4"]
    args += ["--extract.keep_replies", "0.5"]  # a training mix; validation keeps the target's
    assert pipeline_main(args) == 0
    plan, plain = Plan(parse_pipeline(args)), Plan(parse_pipeline(base))
    val = plan.validation_section()
    assert val["data"] == "sharegpt@heldout" and val["limit"] == 4
    assert val["regenerate"] is True  # the extract section's options, the validation's on top
    assert "keep_replies" not in val
    assert plan.section("extract")["keep_replies"] == 0.5
    train = plan.section("train")
    assert train["data"]["val_data"] == str(plan.dirs["extract"] / "val")
    assert plan.dirs["extract"] != plain.dirs["extract"]
    given = [*args, f"--data={tmp_path}"]
    (tmp_path / "manifest.json").write_text("{}")
    with pytest.raises(PipelineError, match="validation: extracts a validation set"):
        Plan(parse_pipeline(given))


def test_missing_model_is_one_line_naming_the_option(tmp_path, capsys):
    args = [f"--config={CONFIGS / 'tiny.yaml'}", f"--output={tmp_path}", "--dry_run=true"]
    assert pipeline_main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("draftsmith pipeline: error: model: not given") and "\n" not in err


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_pipeline_configs_dry_run(path, tmp_path, tiny_model_dir, make_mtp_target, capsys):
    first = path.read_text().splitlines()[0]
    assert first.startswith("# draftsmith pipeline --config configs/pipelines/" + path.name)
    args = [f"--config={path}", f"--output={tmp_path}", "--dry_run=true"]
    if path.name == "tiny-mtp.yaml":  # a target that ships an MTP layer
        args.append(f"--model={make_mtp_target(tmp_path / 'mimo', 'mimo')}")
    elif path.name.startswith("tiny"):  # tiny.yaml, tiny-dflash.yaml: the model is given
        args.append(f"--model={tiny_model_dir}")
    assert pipeline_main(args) == 0
    printed = capsys.readouterr().out
    for stage in ("extract", "train", "export", "eval"):
        assert f"{stage:8s} ok" in printed


@pytest.mark.parametrize(
    ("eagle", "dflash"),
    [("smollm2.yaml", "smollm2-dflash.yaml"),
     ("smollm2-cpu-2h.yaml", "smollm2-cpu-2h-dflash.yaml"),
     ("smollm2-cpu-2h-prefill.yaml", "smollm2-cpu-2h-prefill-dflash.yaml"),
     ("smollm2.yaml", "smollm2-dflash2.yaml")],
)  # fmt: skip
def test_each_dflash_recipe_trains_on_its_eagle_recipes_dataset(eagle, dflash, tmp_path):
    """One dataset trains either kind: the DFlash recipe's extraction (and validation set)
    has the address of its EAGLE-3 twin's, so a shared output reuses it."""
    out = f"--output={tmp_path}"
    a = Plan(parse_pipeline([f"--config={CONFIGS / eagle}", out]))
    b = Plan(parse_pipeline([f"--config={CONFIGS / dflash}", out]))
    assert a.dirs["extract"] == b.dirs["extract"] and a.val_dir() == b.val_dir()
    assert a.dirs["train"] != b.dirs["train"]


CSV_LOGGER = {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": "x"}}


@pytest.mark.vllm
def test_study_two_point_grid_on_a_given_dataset(tmp_path, tiny_model_dir, tiny_dataset, capsys):
    """Two points share the given dataset; each trains its own head and is measured in vLLM."""
    from draftsmith.pipelines.study import main as study_main

    base = tiny_config(tmp_path, tiny_model_dir)
    study = tmp_path / "study.yaml"
    study.write_text(
        yaml.safe_dump(
            {
                "pipeline": str(base),
                "output": str(tmp_path / "study"),
                "k": 2,
                "dataset": str(tmp_path / "eval.jsonl"),
                "common": {
                    "data": str(tiny_dataset),
                    "eval.baselines": [],
                    "eval.lossless": False,
                    "eval.limit": 4,
                    "train.trainer.logger": [CSV_LOGGER],  # the simulated acceptance
                },
                "points": {"base": {}, "ttt-1": {"train.model.ttt_steps": 1}},
            }
        )
    )
    # A command-line override reaches every point (here: the reply length).
    assert study_main([f"--config={study}", "--eval.max_tokens", "16"]) == 0
    for name in ("base", "ttt-1"):
        point = yaml.safe_load((tmp_path / "study" / "points" / f"{name}.yaml").read_text())
        assert point["eval"]["max_tokens"] == 16
    rows = json.loads((tmp_path / "study" / "study.json").read_text())["rows"]
    assert [r["point"] for r in rows] == ["base", "ttt-1"]
    for row in rows:
        assert "extract" in row["reused"] and row["seconds"]["train"] > 0
        assert 1.0 <= row["head_acceptance_length"] <= 3.0
        assert row["head_tokens_per_step"] >= 1.0
        assert 0.0 < row["draft_vocab_coverage"] <= 1.0  # of the target's eval outputs
    # Training simulates chains up to its TTT steps: k=2 for the base (2 steps), none for 1.
    assert 1.0 <= rows[0]["simulated_acceptance_length"] <= 3.0
    assert rows[1]["simulated_acceptance_length"] is None
    table = (tmp_path / "study" / "study.md").read_text()
    assert "`train.model.ttt_steps=1`" in table and "| base | (base) |" in table
    assert (tmp_path / "study" / "study.png").stat().st_size > 0


def test_study_rejects_an_unknown_section():
    from draftsmith.pipelines.study import apply_overrides

    merged = apply_overrides({"train": {"a": 1}}, {"train.b.c": 2})
    assert merged == {"train": {"a": 1, "b": {"c": 2}}}
    with pytest.raises(PipelineError, match="no section 'trian'"):
        apply_overrides({"train": {}}, {"trian.model.lr": 1.0})


@pytest.mark.parametrize(
    "path", sorted((CONFIGS.parent / "study").glob("*.yaml")), ids=lambda p: p.name
)
def test_study_configs_parse_and_every_point_resolves(path, tmp_path, capsys):
    """The study's defaults parse, and each point is a pipeline whose stages all resolve."""
    from draftsmith.pipelines.study import parse_study, point_configs

    assert path.read_text().startswith("# draftsmith study --config configs/study/" + path.name)
    cfg = parse_study(["--config", str(path), "--train.data.val_fraction", "0.07"])
    for name, point in point_configs(cfg).items():
        assert cfg.k in point["eval"]["k"]
        if "train.data.val_fraction" not in cfg.points[name]:  # the CLI's value, not the YAML's
            assert point["train"]["data"]["val_fraction"] == 0.07, name
        point.pop("data", None)  # the study's dataset is written by `make study`, not here
        config = tmp_path / f"{name}.yaml"
        config.write_text(yaml.safe_dump(point))
        assert pipeline_main([f"--config={config}", f"--output={tmp_path}", "--dry_run=true"]) == 0
        assert "train    ok" in capsys.readouterr().out, name


def test_dry_run_checks_the_target_and_bad_input_is_one_line(tmp_path, tiny_model_dir, capsys):
    config = tiny_config(tmp_path, tiny_model_dir)
    base = [f"--config={config}", "--dry_run=true"]
    assert pipeline_main(base) == 0
    assert "target   ok  -> LlamaForCausalLM: 8 layers" in capsys.readouterr().out
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    cases = [
        ([*base, "--extract.layer_ids", "[2, 99]"], "extract.layer_ids: [99] out of range"),
        ([*base, "--train.model.draft_vocab_size", "10000000"], "larger than the target's"),
        ([*base, f"--model={broken}"], "config.json: is not valid JSON"),
        ([*base, "--train.model.kind", "eagle9"], "'eagle9' is not a choice; use one of ["),
        ([*base, "--train.model.kind", "mtp"], "train.model.kind mtp: the target's architecture"),
        ([*base, "--train.model.kind", "dspark"], "train.model.kind dspark: the target's arch"),
        ([*base, "--eval.method", "eagle9"], "'eagle9' is not a choice; use one of ["),
        ([*base, "--eval.baselines", "[none, target_mtp]"],
         "eval.baselines: target_mtp serves the target's own MTP layer, but LlamaForCausalLM"),
    ]  # fmt: skip
    for args, said in cases:
        assert pipeline_main(args) == 2
        captured = capsys.readouterr()
        err = captured.err.strip()
        assert said in err and "\n" not in err, err
        assert "Traceback" not in captured.out + captured.err


def kill_producer_mid_shard(dataset: Path, shard: int, log: Path) -> dict:
    """Wait until the producer says it writes ``shard``, SIGKILL it (its engine too), check
    the shard was not finished, then start another producer in its place."""
    import os
    import signal
    import subprocess
    import sys
    import time

    beat = dataset / "stream" / "producer-w0.json"
    seen: dict = {}
    deadline = time.monotonic() + 900  # a loaded 2-core machine once took over 300 s
    while time.monotonic() < deadline:
        try:
            seen = json.loads(beat.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            seen = {}
        if seen.get("state") == f"writing shard {shard}":
            os.killpg(os.getpgid(seen["pid"]), signal.SIGKILL)
            break
        time.sleep(0.01)
    killed = {
        "state": seen.get("state"),
        "finished": (dataset / f"shard-{shard:05d}.json").exists(),
    }
    command = [sys.executable, "-m", "draftsmith.cli", "extract", "--config",
               str(dataset / "stage.yaml"), "--stream", "true"]  # fmt: skip
    with log.open("ab") as out:
        subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    return killed


@pytest.mark.vllm
def test_streamed_pipeline_trains_the_offline_head_through_a_killed_producer(
    tmp_path, tiny_model_dir
):
    """tiny-stream.yaml = tiny.yaml + a stream section: the same head, tensor for tensor,
    though its producer is SIGKILLed mid-shard and another one finishes the work."""
    import threading

    import torch
    from safetensors.torch import load_file

    def run(name: str) -> tuple[dict, dict]:
        config = tiny_config(tmp_path / name, tiny_model_dir, source=name)
        assert pipeline_main([f"--config={config}", "--stop_after=export"]) == 0
        state = json.loads((tmp_path / name / "run" / "pipeline.json").read_text())
        return state, load_file(Path(state["stages"]["export"]["dir"]) / "model.safetensors")

    _, offline = run("tiny")
    config = tiny_config(tmp_path / "tiny-stream", tiny_model_dir, source="tiny-stream")
    dataset = Plan(parse_pipeline([f"--config={config}"])).dirs["extract"]
    killed: dict = {}
    second_log = tmp_path / "second-producer.log"
    watcher = threading.Thread(
        target=lambda: killed.update(kill_producer_mid_shard(dataset, 1, second_log))
    )
    watcher.start()
    state, streamed = run("tiny-stream")
    watcher.join(timeout=60)
    assert killed == {"state": "writing shard 1", "finished": False}
    assert "producer exit -9" in state["stages"]["extract"]["status"]
    manifest = json.loads((dataset / "manifest.json").read_text())
    assert manifest["num_samples"] == 12 and manifest["complete"]  # nothing lost, once each
    ids = [sid for shard in manifest["shards"] for sid in shard["sample_ids"]]
    assert len(ids) == len(set(ids)) == 12
    assert offline.keys() == streamed.keys()
    for key, value in offline.items():
        torch.testing.assert_close(streamed[key], value, rtol=0, atol=0, msg=key)
    recapture_replays_the_kept_replies(dataset, tmp_path / "recapture.log")


def recapture_replays_the_kept_replies(dataset: Path, log: Path) -> None:
    """A streamed shard written again (``recapture``, or asked for again on resume) is
    captured by one prefill of the greedy replies kept at its first capture: the same
    tokens and masks, the same states up to kernel rounding, no prompt answered again."""
    import subprocess
    import sys
    import time

    import torch
    from safetensors.torch import load_file

    from draftsmith.dataset.stream import StreamDir

    shard, sidecar = dataset / "shard-00000.safetensors", dataset / "shard-00000.json"
    assert json.loads(sidecar.read_text())["captured_by"] == "generation"
    kept = json.loads((dataset / "replies" / "shard-00000.json").read_text())
    first = load_file(shard)
    ends = first["sample_offsets"].tolist()
    assert [r["input_ids"] for r in kept["sequences"]] == [
        first["input_ids"][a:b].tolist() for a, b in zip(ends, ends[1:], strict=False)
    ]
    shard.unlink()
    sidecar.unlink()
    (dataset / "stream" / "finished.json").unlink()
    stream = StreamDir(dataset)
    stream.want(0, [0])
    command = [sys.executable, "-m", "draftsmith.cli", "extract", "--config",
               str(dataset / "stage.yaml"), "--stream", "true"]  # fmt: skip
    with log.open("wb") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while not sidecar.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    stream.finish()
    assert proc.wait(timeout=120) == 0, log.read_text()[-2000:]
    assert json.loads(sidecar.read_text())["captured_by"] == "prefill"
    again = load_file(shard)
    assert first.keys() == again.keys()
    for key, value in first.items():
        if value.is_floating_point():
            torch.testing.assert_close(again[key], value, rtol=1e-3, atol=1e-3, msg=key)
        else:
            assert torch.equal(again[key], value), key
