"""A kind the target cannot use is refused before any engine starts, in one line: by the
pipeline and by ``extract`` given the kind. Also the small defects met on the same path."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_inputs_outputs import PIPELINE_TINY, TRAIN_TINY, one_error

from draftsmith.core.targets import default_layer_ids


@pytest.mark.parametrize(
    ("kind", "says"),
    [
        ("dspark", "model.kind dspark: the target's architecture LlamaForCausalLM"),
        ("mtp", "model.kind mtp: the target's architecture LlamaForCausalLM has no MTP layers"),
    ],
)
def test_pipeline_refuses_a_kind_the_target_cannot_use_before_extracting(
    kind, says, tiny_model_dir, tmp_path, capsys
):
    out = tmp_path / "run"
    args = ["pipeline", f"--config={PIPELINE_TINY}", f"--model={tiny_model_dir}",
            f"--output={out}", f"--train.model.kind={kind}"]  # fmt: skip
    err = one_error(capsys, args)
    assert says in err, err
    assert not out.exists(), "the pipeline wrote (or extracted) before refusing"


def test_extract_given_the_kind_refuses_before_any_engine(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "data"
    args = ["extract", f"--model={tiny_model_dir}", "--data=[self:4]", f"--output={out}"]
    err = one_error(capsys, [*args, "--kind=dspark"])
    assert "kind: dspark: the target's architecture LlamaForCausalLM is not supported" in err
    assert [p.name for p in out.iterdir()] == ["extract.log"]  # no plan, no shard, no engine
    assert "starting vLLM" not in (out / "extract.log").read_text()
    err = one_error(capsys, [*args, "--kind=eagle4"])
    assert "kind: 'eagle4' is not a drafter kind; use one of" in err


def test_default_layer_ids_stay_within_the_target():
    assert default_layer_ids(30) == [2, 15, 27, 30]  # SmolLM2: low, mid, high and the last
    assert default_layer_ids(8) == [2, 4, 5, 8]
    assert default_layer_ids(4) == [1, 2, 4]
    assert default_layer_ids(2) == [0, 1, 2]
    assert default_layer_ids(1) == [0, 1]
    for n in range(1, 40):
        ids = default_layer_ids(n)
        assert ids == sorted(set(ids)) and 0 <= ids[0] and ids[-1] == n, (n, ids)


def test_resume_from_a_checkpoint_that_does_not_exist_is_one_line(tmp_path, capsys):
    missing = tmp_path / "nowhere" / "last.ckpt"
    args = ["train", "fit", f"--config={TRAIN_TINY}", f"--data.data={tmp_path}",
            f"--trainer.default_root_dir={tmp_path / 'run'}", f"--ckpt_path={missing}"]  # fmt: skip
    err = one_error(capsys, args)
    assert f"ckpt_path: {missing} does not exist" in err and "'last'" in err
    assert not Path(tmp_path / "run" / "checkpoints").exists()
