"""Bad options and bad output directories fail before any engine starts, in one line."""

from __future__ import annotations

import json

import pytest

from draftsmith.extract.main import main


def run_main(capsys, *args: str) -> tuple[int, str]:
    code = main(list(args))
    err = capsys.readouterr().err.strip()
    return code, err


@pytest.fixture()
def chats(tmp_path):
    path = tmp_path / "chats.jsonl"
    row = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    path.write_text(json.dumps(row) + "\n")
    return path


def test_missing_model_directory(capsys, tmp_path, chats):
    code, err = run_main(capsys, "--model", str(tmp_path / "nope"), "--data", f"[{chats}]")
    assert code == 2 and "model:" in err and "does not exist" in err
    assert len(err.splitlines()) == 1


def test_architecture_without_eagle3_support(capsys, tmp_path, chats):
    model = tmp_path / "gpt2"
    model.mkdir()
    config = {
        "architectures": ["GPT2LMHeadModel"],
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "vocab_size": 100,
    }
    (model / "config.json").write_text(json.dumps(config))
    code, err = run_main(capsys, "--model", str(model), "--data", f"[{chats}]")
    assert code == 2 and "GPT2LMHeadModel" in err and "EAGLE-3" in err


@pytest.mark.parametrize(
    "ids, words",
    [("[2,9]", "out of range"), ("[4,2]", "not sorted"), ("[2,2,5]", "duplicates")],
)
def test_bad_layer_ids(capsys, tiny_model_dir, chats, tmp_path, ids, words):
    code, err = run_main(
        capsys,
        "--model",
        str(tiny_model_dir),
        "--data",
        f"[{chats}]",
        "--layer_ids",
        ids,
        "--output",
        str(tmp_path / "o"),
    )
    assert code == 2 and err.count("layer_ids") == 1 and words in err


def test_missing_data_file(capsys, tiny_model_dir, tmp_path):
    missing = tmp_path / "absent.jsonl"
    code, err = run_main(
        capsys,
        "--model",
        str(tiny_model_dir),
        "--data",
        f"[{missing}]",
        "--output",
        str(tmp_path / "o"),
    )
    assert code == 2 and "absent.jsonl" in err


def test_output_holding_another_dataset(capsys, tiny_model_dir, chats, tmp_path):
    out = tmp_path / "o"
    out.mkdir()
    fingerprint = {"target_config_sha256": "0" * 64, "layer_ids": [1, 2, 3]}
    (out / "plan.json").write_text(json.dumps({"fingerprint": fingerprint}))
    code, err = run_main(
        capsys, "--model", str(tiny_model_dir), "--data", f"[{chats}]", "--output", str(out)
    )
    assert code == 2 and "other settings" in err
    assert "layer_ids" in err and "target_config_sha256" in err


def test_self_prompts_need_regeneration(capsys, tiny_model_dir, tmp_path):
    code, err = run_main(
        capsys,
        "--model",
        str(tiny_model_dir),
        "--data",
        "[self:4]",
        "--output",
        str(tmp_path / "o"),
    )
    assert code == 2 and "regenerate" in err


def test_bad_worker_index(capsys, tiny_model_dir, chats, tmp_path):
    code, err = run_main(
        capsys,
        "--model",
        str(tiny_model_dir),
        "--data",
        f"[{chats}]",
        "--workers",
        "2",
        "--worker",
        "2",
        "--output",
        str(tmp_path / "o"),
    )
    assert code == 2 and "worker" in err
