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


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (["--keep_replies", "0.5"], "regenerate: true"),
        (["--regenerate", "true", "--keep_replies", "1.5"], "[0, 1]"),
    ],
)
def test_keep_replies_needs_regeneration_and_a_share(
    capsys, tiny_model_dir, chats, tmp_path, extra, says
):
    code, err = run_main(
        capsys,
        "--model",
        str(tiny_model_dir),
        "--data",
        f"[{chats}]",
        "--output",
        str(tmp_path / "o"),
        *extra,
    )
    assert (
        code == 2 and err.startswith("draftsmith extract") and "keep_replies" in err and says in err
    )
    assert len(err.splitlines()) == 1


@pytest.mark.parametrize("share", [0.0, 0.25, 0.5, 1.0])
def test_kept_replies_are_spread_evenly(tokenizer, share):
    """Every prefix of the conversations with replies keeps `share` of them (rounded
    down), so a time limit that stops between shards cuts both kinds in proportion;
    prompts without replies are always answered by the target."""
    from draftsmith.conversations.sources import Conversation, SkipLog
    from draftsmith.extract.config import ExtractConfig
    from draftsmith.extract.sample_plan import plan_items

    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    prompt = [{"role": "user", "content": "hi"}]
    convs = [Conversation(f"c:{i}", chat if i % 3 else prompt, "c", i) for i in range(24)]
    cfg = ExtractConfig(data=["c"], regenerate=True, keep_replies=share)
    items = plan_items(convs, tokenizer, cfg, SkipLog())
    assert len(items) == 24
    kept = [bool(it.input_ids) for it in items]
    assert not any(kept[::3])  # the prompts
    with_replies = [k for i, k in enumerate(kept) if i % 3]
    for n in range(1, len(with_replies) + 1):
        assert sum(with_replies[:n]) == int(n * share)


def test_keep_replies_enters_the_fingerprint_only_when_set():
    """Datasets written before the option existed keep resuming: an unset share leaves the
    fingerprint as it was; a set one is part of it."""
    from types import SimpleNamespace

    from draftsmith.extract.config import ExtractConfig
    from draftsmith.extract.sample_plan import fingerprint

    target = SimpleNamespace(config_sha256="x")
    plain = fingerprint(ExtractConfig(data=["c"], regenerate=True), target, [1, 2])
    mixed = fingerprint(ExtractConfig(data=["c"], regenerate=True, keep_replies=0.5), target, [1])
    assert "keep_replies" not in plain and mixed["keep_replies"] == 0.5
