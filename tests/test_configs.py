"""Every shipped YAML parses into its stage's config and opens with the command that runs it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from draftsmith.cli import main as cli_main
from draftsmith.core.config import parse_config
from draftsmith.core.errors import ConfigError
from draftsmith.core.targets import validate_layer_ids
from draftsmith.evaluate.checks import check_k
from draftsmith.evaluate.config import EvalConfig
from draftsmith.evaluate.context import check_buckets
from draftsmith.extract.config import ExtractConfig

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
EXTRACT = sorted((CONFIGS / "extract").glob("*.yaml"))
EVAL = sorted((CONFIGS / "eval").glob("*.yaml"))
TRAIN = sorted((CONFIGS / "train").glob("*.yaml"))


def test_there_are_configs():
    assert len(EXTRACT) >= 2 and len(EVAL) >= 2 and len(TRAIN) >= 4


@pytest.mark.parametrize("path", EXTRACT, ids=lambda p: p.name)
def test_extract_configs_parse(path):
    first = path.read_text().splitlines()[0]
    assert first.startswith("# draftsmith extract --config configs/extract/" + path.name)
    cfg = parse_config(ExtractConfig, ["--config", str(path)], prog="test")
    assert isinstance(cfg, ExtractConfig) and cfg.data and cfg.output
    if cfg.layer_ids is not None:
        validate_layer_ids(cfg.layer_ids, 10_000)


@pytest.mark.parametrize("path", EVAL, ids=lambda p: p.name)
def test_eval_configs_parse(path):
    first = path.read_text().splitlines()[0]
    assert first.startswith("# draftsmith eval --config configs/eval/" + path.name)
    cfg = parse_config(EvalConfig, ["--config", str(path)], prog="test")
    assert isinstance(cfg, EvalConfig) and cfg.datasets
    check_k(cfg.k)
    check_buckets(cfg.datasets, cfg.context_buckets)


def test_overrides_apply_after_the_file():
    path = CONFIGS / "extract" / "smollm2.yaml"
    cfg = parse_config(
        ExtractConfig,
        ["--config", str(path), "--layer_ids", "[1,2]", "--engine.max_model_len", "99"],
        prog="test",
    )
    assert cfg.layer_ids == [1, 2] and cfg.engine.max_model_len == 99
    assert cfg.model == "smollm2-135m"  # from the file


def test_unknown_option_is_refused_in_one_line(capsys):
    with pytest.raises(ConfigError, match="unrecognized arguments: --layer_idz") as err:
        parse_config(ExtractConfig, ["--layer_idz", "[1]"], prog="draftsmith extract")
    assert "\n" not in str(err.value)
    assert cli_main(["extract", "--layer_idz", "[1]"]) == 2
    printed = capsys.readouterr().err.strip()
    assert printed.startswith("draftsmith extract: error: ") and "\n" not in printed


def test_cli_lists_stages_and_rejects_unknown(capsys):
    assert cli_main([]) == 0
    assert "extract" in capsys.readouterr().out
    assert cli_main(["nope"]) == 2
    err = capsys.readouterr().err.strip()
    assert "unknown command 'nope'; use one of: extract, train" in err and "\n" not in err


def test_help_shows_field_docs(capsys):
    with pytest.raises(SystemExit):
        cli_main(["extract", "--help"])
    out = " ".join(capsys.readouterr().out.split())  # --help wraps lines
    assert (
        "residual stream after k decoder layers" in out and "--engine.tensor_parallel_size" in out
    )


@pytest.mark.parametrize("path", TRAIN, ids=lambda p: p.name)
def test_train_configs_parse_and_validate(path, capsys):
    """Each recipe (multi-GPU ones included) parses into the LightningCLI's types."""
    from draftsmith.train.main import main as train_main

    first = path.read_text().splitlines()[0]
    assert first.startswith("# draftsmith train fit --config configs/train/" + path.name)
    with pytest.raises(SystemExit) as exit_:
        train_main(["fit", "--config", str(path), "--print_config"])
    assert exit_.value.code == 0
    printed = capsys.readouterr().out
    assert "kind: eagle" in printed and "ttt_steps:" in printed
    for json_config in re.findall(r"config: (configs/deepspeed/\S+)", path.read_text()):
        assert (CONFIGS.parent / json_config).is_file(), json_config


def test_cpu_runtime_env_fills_defaults_and_keeps_the_users(tmp_path, monkeypatch):
    from draftsmith.core.engine import EngineOptions, cpu_runtime_env

    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libiomp5.so").touch()
    monkeypatch.setattr("sys.prefix", str(tmp_path))
    env = {"LD_PRELOAD": "/x/libfoo.so"}
    cpu_runtime_env(EngineOptions(), env)
    assert env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    assert env["LD_PRELOAD"] == f"{tmp_path}/lib/libiomp5.so:/x/libfoo.so"
    cpu_runtime_env(EngineOptions(), env)  # idempotent
    assert env["LD_PRELOAD"].count("libiomp5") == 1
    env = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}
    cpu_runtime_env(EngineOptions(cpu_preload_iomp=False), env)
    assert env == {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}  # the user's choice stands


# Recipes for large targets, each dry-run against its target's own config.json (kept in
# configs/targets/ since the hub is out of reach here): layer ids, draft vocabulary and
# lengths must fit the real model.
RECIPES = {
    "llama3.1-8b.yaml": "llama3.1-8b",
    "qwen3-8b.yaml": "qwen3-8b",
    "qwen3-8b-64k.yaml": "qwen3-8b-yarn",
    "qwen3-30b-a3b.yaml": "qwen3-30b-a3b",
    "gpt-oss-20b.yaml": "gpt-oss-20b",
}


@pytest.mark.parametrize("recipe", sorted(RECIPES), ids=str)
def test_recipes_fit_their_targets(recipe, tmp_path, capsys):
    from draftsmith.pipelines.main import main as pipeline_main

    target = CONFIGS / "targets" / RECIPES[recipe]
    args = [f"--config={CONFIGS / 'pipelines' / recipe}", f"--model={target}"]
    assert pipeline_main([*args, f"--output={tmp_path}", "--dry_run=true"]) == 0
    printed = capsys.readouterr().out
    assert "target   ok" in printed, printed
    for stage in ("extract", "train", "export", "eval"):
        assert f"{stage:8s} ok" in printed
