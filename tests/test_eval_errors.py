"""Bad evaluate inputs fail before vLLM starts, with one line naming the option and the fix."""

from __future__ import annotations

import json

import pytest

from draftsmith.evaluate.main import main


@pytest.fixture()
def prompts(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "hi"}) + "\n")
    return path


def run_main(capsys, *args: str) -> tuple[int, str]:
    code = main([*args, "--wandb=false"])
    return code, capsys.readouterr().err.strip()


def test_missing_head_directory(capsys, tiny_model_dir, prompts, tmp_path):
    code, err = run_main(
        capsys,
        f"--model={tiny_model_dir}",
        f"--head={tmp_path / 'none'}",
        f"--datasets=[{prompts}]",
    )
    assert code == 2 and "head:" in err and "config.json" in err and len(err.splitlines()) == 1


def test_unknown_method_is_refused_by_the_parser(capsys, tiny_model_dir, tiny_eagle3_head):
    assert (
        main([f"--model={tiny_model_dir}", f"--head={tiny_eagle3_head}", "--method=medusa2"]) == 2
    )
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "method: 'medusa2' is not a choice; use one of [" in err
    assert "'eagle3'" in err  # the allowed values are named


def test_head_run_with_the_wrong_method(capsys, tiny_model_dir, tiny_eagle3_head, prompts):
    code, err = run_main(
        capsys,
        f"--model={tiny_model_dir}",
        f"--head={tiny_eagle3_head}",
        "--method=eagle",
        f"--datasets=[{prompts}]",
    )
    assert code == 2 and "Eagle3LlamaForCausalLM" in err and "--method eagle3" in err


@pytest.mark.parametrize(
    "override, words",
    [
        ({"target_hidden_size": 64}, "hidden size 64"),
        ({"vocab_size": 32000}, "vocab_size 32000"),
        ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 4, 9]}}, "taps layers [9]"),
        ({"draft_vocab_size": 1000}, "lm_head.weight"),
    ],
)
def test_head_built_for_another_target(
    capsys, tmp_path, tiny_model_dir, make_eagle3_head, prompts, override, words
):
    head = make_eagle3_head(tmp_path / "head", **override)
    code, err = run_main(
        capsys, f"--model={tiny_model_dir}", f"--head={head}", f"--datasets=[{prompts}]"
    )
    assert code == 2 and words in err and len(err.splitlines()) == 1


def test_unknown_dataset(capsys, tiny_model_dir):
    code, err = run_main(capsys, f"--model={tiny_model_dir}", "--datasets=[no_such_set]")
    assert code == 2 and "no_such_set" in err


@pytest.mark.parametrize("ks", ["[0,3]", "[17]"])
def test_k_out_of_range(capsys, tiny_model_dir, prompts, ks):
    code, err = run_main(
        capsys, f"--model={tiny_model_dir}", f"--datasets=[{prompts}]", f"--k={ks}"
    )
    assert code == 2 and "k:" in err and "between 1 and 16" in err


def test_time_limit_skips_baselines_that_would_overrun(
    monkeypatch, tiny_model_dir, tiny_eagle3_head, prompts, tmp_path
):
    """Suffix decoding runs first among the speculative engines, right after no speculation:
    a time limit skips it only when even then it would end past the limit (each stand-in
    engine takes 0.3 s: with 0.5 s allowed, 0.3 used + 0.3 predicted). Its time is predicted
    from the engines without a draft model: a slow head never skips it, since the head runs
    after it. No speculation, the head and ngram are never skipped."""
    import importlib.util
    import time

    from draftsmith.core.config import parse_config
    from draftsmith.evaluate import runs
    from draftsmith.evaluate.config import EvalConfig
    from draftsmith.evaluate.main import evaluate

    ran, seconds = [], {}

    def engine_run(cfg, model, method, prompts, kwargs, *args, **options):
        ran.append(method.name)
        time.sleep(seconds.get(method.name, 0.3))
        return [], {(d, 0.0): [[1, 2, 3]] * len(p) for d, p in prompts.items()}, {}

    monkeypatch.setattr(runs, "offline_runs", engine_run)
    find_spec = importlib.util.find_spec  # suffix needs arctic-inference; the stand-in does not
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: True if name == "arctic_inference" else find_spec(name, *a),
    )
    base = [f"--model={tiny_model_dir}", f"--head={tiny_eagle3_head}", f"--datasets=[{prompts}]"]
    base += ["--baselines=[none,ngram,suffix]", "--k=[3]", f"--output={tmp_path}", "--wandb=false"]
    results, _ = evaluate(parse_config(EvalConfig, [*base, "--time_limit=0.5"], prog="eval"))
    assert ran == ["none", "eagle3", "ngram"]
    assert results["skipped"] == [{"method": "suffix", "k": 3, "reason": "time_limit"}]
    ran.clear()
    results, _ = evaluate(parse_config(EvalConfig, base, prog="eval"))
    assert ran == ["none", "suffix", "eagle3", "ngram"] and results["skipped"] == []
    ran.clear()  # a slow head (2 s) comes after suffix: 0.1 used + 0.1 predicted < 1.1
    seconds.update(none=0.1, eagle3=2.0, ngram=0.1, suffix=0.1)
    results, _ = evaluate(parse_config(EvalConfig, [*base, "--time_limit=1.1"], prog="eval"))
    assert ran == ["none", "suffix", "eagle3", "ngram"] and results["skipped"] == []
    ran.clear()
    seconds.update(none=0.7)  # 0.7 s used + 0.7 predicted > 1.3
    results, _ = evaluate(parse_config(EvalConfig, [*base, "--time_limit=1.3"], prog="eval"))
    assert ran == ["none", "eagle3", "ngram"] and results["skipped"][0]["method"] == "suffix"
