"""Nothing lost, nothing silently wrong: outputs never clobber, inputs are verified.

Every case ends in one line on stderr and exit status 2, before any work starts; no file a
test planted is changed.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from draftsmith.cli import main as cli_main
from draftsmith.conversations.rows import DataError
from draftsmith.conversations.sources import SkipLog, load_conversations
from draftsmith.core import outputs
from draftsmith.core.config import one_line
from draftsmith.dataset import manifest
from draftsmith.dataset.reader import DatasetError, open_dataset

ROOT = Path(__file__).resolve().parents[1]
TRAIN_TINY = ROOT / "configs/train/tiny.yaml"
PIPELINE_TINY = ROOT / "configs/pipelines/tiny.yaml"


def one_error(capsys, args: list[str]) -> str:
    """Run ``draftsmith ARGS`` in-process; it must end in exit 2 and one stderr line."""
    code = cli_main(args)
    # Lightning's own INFO lines (seed, devices) are logging, not the error.
    lines = [x for x in capsys.readouterr().err.strip().splitlines() if not x.startswith("INFO:")]
    err = "\n".join(lines)
    assert code == 2, (args, err)
    assert len(lines) == 1 and ": error: " in err, err
    return err


@pytest.fixture()
def chats(tmp_path) -> Path:
    path = tmp_path / "chats.jsonl"
    row = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    path.write_text(json.dumps(row) + "\n")
    return path


def snapshot(path: Path) -> dict[str, tuple[bytes, int]]:
    """Every planted file under ``path`` (or ``path`` itself): bytes and mtime."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    return {str(p): (p.read_bytes(), p.stat().st_mtime_ns) for p in files}


# ----- the seven cases and the smaller ones ---------------------------------------------


def test_export_refuses_an_existing_file(capsys, tmp_path):
    ckpt, target = tmp_path / "last.ckpt", tmp_path / "F"
    ckpt.write_bytes(b"not read")
    target.write_text("the user's file")
    err = one_error(capsys, ["export", f"--checkpoint={ckpt}", f"--output={target}"])
    assert "output:" in err and "existing file" in err and "--overwrite true" in err
    assert target.read_text() == "the user's file"


def corrupt_copy(tiny_dataset: Path, tmp_path: Path) -> tuple[Path, str]:
    data = tmp_path / "data"
    shutil.copytree(tiny_dataset, data)
    info = json.loads((data / "manifest.json").read_text())["shards"][-1]
    shard = data / info["file"]
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0x01  # one bit of tensor data, same size
    shard.write_bytes(bytes(raw))
    return data, info["file"]


@pytest.mark.parametrize("chunk", [None, 5])
def test_flipped_byte_is_refused_before_its_sample(tmp_path, tiny_dataset, monkeypatch, chunk):
    """Each sample's bytes are checked against its xxh3-64 as they are read (in pieces of
    ``HASH_CHUNK`` bytes, 5 here to cross every tensor's edges): the sample holding the
    flipped byte is refused in one line naming the shard and the sample."""
    from draftsmith.dataset import reader

    if chunk is not None:
        monkeypatch.setattr(reader, "HASH_CHUNK", chunk)
    clean = open_dataset(tiny_dataset)
    assert all(len(clean[i]["input_ids"]) for i in range(len(clean)))  # every digest holds
    data, name = corrupt_copy(tiny_dataset, tmp_path)
    ds = open_dataset(data)  # opening reads headers only
    with pytest.raises(
        DatasetError, match=f"{name}: sample '.*' .* differs from its xxh3-64"
    ) as err:
        for i in range(len(ds)):
            ds[i]
    assert "--repair true" in str(err.value) and "\n" not in str(err.value)
    assert len(open_dataset(data, check_shards=False)[len(ds) - 1]["input_ids"])  # opt-out


@pytest.mark.parametrize("workers", [0, 1])
def test_flipped_byte_stops_training(capsys, tmp_path, tiny_dataset, workers):
    """In a loader worker too: its error reaches the user as the one line it was, not as
    torch's "Caught DatasetError in DataLoader worker process 0. Original Traceback ..."."""
    data, name = corrupt_copy(tiny_dataset, tmp_path)
    args = ["train", "fit", f"--config={TRAIN_TINY}", f"--data.data={data}"]
    # One epoch reads every sample (training's or validation's), the corrupt one among them.
    args += [f"--trainer.default_root_dir={tmp_path / 'run'}", "--trainer.max_epochs=1"]
    args += [f"--data.num_workers={workers}"]
    err = one_error(capsys, args)
    assert name in err and "xxh3-64" in err and not (tmp_path / "run" / "checkpoints").exists()
    assert "Caught" not in err and "Traceback" not in err and "File " not in err


def test_repair_deletes_exactly_the_corrupt_shards(tmp_path, tiny_dataset):
    data, name = corrupt_copy(tiny_dataset, tmp_path)
    planned = len(json.loads((data / "manifest.json").read_text())["shards"])
    bad = manifest.repair_shards(data, list(range(planned)))
    assert [manifest.shard_name(k) for k in bad] == [name]
    assert not (data / name).exists() and not manifest.sidecar_path(data, bad[0]).exists()
    assert all((data / manifest.shard_name(k)).exists() for k in range(planned) if k not in bad)


def test_latin1_jsonl_names_line_offset_and_encoding(tmp_path, capsys, tiny_model_dir):
    path = tmp_path / "latin.jsonl"
    path.write_bytes(b'{"prompt": "hi"}\n{"prompt": "caf\xe9"}\n')
    with pytest.raises(DataError) as err:
        load_conversations(str(path), require_assistant=False, skips=SkipLog())
    text = str(err.value)
    assert f"{path}:2:" in text and "byte offset 32" in text and "utf-8" in text
    assert "--encoding" in text
    convs = load_conversations(
        str(path), require_assistant=False, skips=SkipLog(), encoding="latin-1"
    )
    assert convs[1].messages[0]["content"] == "café"
    args = ["extract", f"--model={tiny_model_dir}", f"--data=[{path}]", "--regenerate=true"]
    err2 = one_error(capsys, [*args, f"--output={tmp_path / 'o'}"])
    assert "byte offset 32" in err2


def test_output_under_a_file(capsys, tmp_path, tiny_model_dir, chats):
    blocker = tmp_path / "FILE"
    blocker.write_text("x")
    args = ["extract", f"--model={tiny_model_dir}", f"--data=[{chats}]"]
    err = one_error(capsys, [*args, f"--output={blocker / 'sub'}"])
    assert "lies under" in err and str(blocker) in err and blocker.read_text() == "x"


@pytest.mark.parametrize("command", ["extract", "eval"])
def test_negative_limit_is_refused(capsys, tmp_path, tiny_model_dir, chats, command):
    data = "--data" if command == "extract" else "--datasets"
    args = [command, f"--model={tiny_model_dir}", f"{data}=[{chats}]", "--limit=-5"]
    err = one_error(capsys, [*args, f"--output={tmp_path / 'o'}"])
    assert "limit: -5 is out of range" in err and not (tmp_path / "o").exists()


def test_head_config_that_is_not_an_object(capsys, tmp_path, tiny_model_dir, chats):
    head = tmp_path / "head"
    head.mkdir()
    (head / "config.json").write_text("[1, 2]")
    args = ["eval", f"--model={tiny_model_dir}", f"--head={head}", f"--datasets=[{chats}]"]
    err = one_error(capsys, [*args, f"--output={tmp_path / 'o'}", "--wandb=false"])
    assert "config.json: holds a list, not an object" in err


def test_checkpoint_directory_that_is_not_deepspeed(capsys, tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "notes.txt").write_text("x")
    err = one_error(capsys, ["export", f"--checkpoint={ckpt}", f"--output={tmp_path / 'o'}"])
    assert "not a DeepSpeed checkpoint" not in err  # the words below, in one line
    assert "neither a DeepSpeed checkpoint" in err and "meta.pt" in err


def test_parser_errors_in_the_users_words(capsys, tmp_path):
    err = one_error(capsys, ["extract", "--layer_ids=[two, 4]", f"--output={tmp_path}"])
    assert "layer_ids: expected a list of integers or null; got ['two', 4]" in err
    assert "'two' is not an integer" in err and "Union" not in err
    assert one_line("Parser key \"k\":\n  Expected a <class 'int'>. Got value: x") == (
        "k: expected an integer; got 'x'"
    )


def test_yaml_of_the_wrong_shape(capsys, tmp_path):
    config = tmp_path / "p.yaml"
    config.write_text("- a\n- b\n")
    err = one_error(capsys, ["pipeline", f"--config={config}"])
    assert f"{config} holds a YAML list, expected a YAML config (a mapping)" in err


def test_own_output_is_accepted_for_resuming(tmp_path):
    out = tmp_path / "o"
    out.mkdir()
    (out / "plan.json").write_text("{}")
    (out / "notes").write_text("x")
    assert outputs.check_output(out, "output", outputs.EXTRACT_OWN) == out
    assert outputs.check_output(tmp_path / "new" / "deep", "output") == tmp_path / "new" / "deep"


# ----- the sweep: every command, three bad outputs ----------------------------------------


def command_args(command: str, out: Path, ctx: dict) -> list[str]:
    """``draftsmith COMMAND`` arguments with ``out`` as its output path."""
    model, chats = ctx["model"], ctx["chats"]
    return {
        "extract": ["extract", f"--model={model}", f"--data=[{chats}]", f"--output={out}"],
        "train": [
            "train",
            "fit",
            f"--config={TRAIN_TINY}",
            f"--data.data={ctx['data']}",
            f"--trainer.default_root_dir={out}",
        ],
        "train-ckpt": [
            "train",
            "fit",
            f"--config={TRAIN_TINY}",
            f"--data.data={ctx['data']}",
            f"--trainer.default_root_dir={ctx['tmp'] / 'fresh'}",
            f"--checkpoint.dirpath={out}",
        ],
        "export": ["export", f"--checkpoint={ctx['ckpt']}", f"--output={out}"],
        "convert": ["convert", f"--head={ctx['tmp']}", "--to=vllm", f"--output={out}"],
        "eval": ["eval", f"--model={model}", f"--datasets=[{chats}]", f"--output={out}"],
        "pipeline": [
            "pipeline",
            f"--config={PIPELINE_TINY}",
            f"--model={model}",
            f"--output={out}",
        ],
        "study": ["study", f"--pipeline={PIPELINE_TINY}", f"--output={out}"],
        "bench-train": ["bench-train", f"--model={model}", f"--output={out}"],
        "bench-extract": ["bench-extract", f"--model={model}", f"--output={out}"],
        "bench-loader": ["bench-loader", f"--model={model}", f"--output={out}"],
        "bench-loader-work": ["bench-loader", f"--model={model}", f"--work_dir={out}"],
    }[command]


COMMANDS = [
    "extract",
    "train",
    "train-ckpt",
    "export",
    "convert",
    "eval",
    "pipeline",
    "study",
    "bench-train",
    "bench-extract",
    "bench-loader",
    "bench-loader-work",
]


@pytest.mark.parametrize("case", ["file", "foreign_dir", "unwritable"])
@pytest.mark.parametrize("command", COMMANDS)
def test_sweep_bad_outputs(capsys, monkeypatch, tmp_path, tiny_model_dir, tiny_dataset, chats,
                           command, case):  # fmt: skip
    if command == "bench-loader-work" and case == "foreign_dir":
        pytest.skip("work_dir only ever gets a fresh subdirectory: any directory will do")
    ckpt = tmp_path / "last.ckpt"
    ckpt.write_bytes(b"x")
    ctx = {"model": tiny_model_dir, "chats": chats, "data": tiny_dataset, "ckpt": ckpt}
    ctx["tmp"] = tmp_path
    if case == "file":
        out = tmp_path / "planted.txt"
        out.write_text("the user's file")
        planted = out
    elif case == "foreign_dir":
        out = tmp_path / "mine"
        out.mkdir()
        (out / "thesis.tex").write_text("years of work")
        planted = out
    else:
        planted = tmp_path / "locked"
        planted.mkdir()
        (planted / "keep.txt").write_text("x")
        out = planted / "out"
        planted.chmod(0o500)
        real = os.access  # root writes anywhere: stand in for a user the mode bits stop
        monkeypatch.setattr(outputs.os, "access", lambda p, m: Path(p) != planted and real(p, m))
    before = snapshot(planted)
    monkeypatch.chdir(tmp_path)  # defaults such as outputs/... land in the test's directory
    try:
        err = one_error(capsys, command_args(command, out, ctx))
    finally:
        planted.chmod(0o700) if planted.is_dir() else None
    option = {"train": "default_root_dir", "train-ckpt": "dirpath"}.get(command, "")
    assert option in err and str(out) in err, err
    assert snapshot(planted) == before
    if case == "unwritable":
        assert not out.exists()


# ----- options vLLM would refuse are refused before any engine starts ---------------------


@pytest.mark.parametrize(
    ("command", "option", "said"),
    [
        ("eval", "--temperatures=[-1]", "temperatures: -1"),
        ("eval", "--temperatures=[]", "temperatures: empty"),
        ("eval", "--k=[0]", "k: [0] out of range"),
        ("eval", "--max_tokens=0", "max_tokens: 0 is out of range"),
        ("eval", "--concurrency=0", "concurrency: 0 is out of range"),
        ("eval", "--engine.gpu_memory_utilization=1.5", "engine.gpu_memory_utilization: 1.5"),
        ("eval", "--engine.max_num_seqs=0", "engine.max_num_seqs: 0 is out of range"),
        ("extract", "--temperature=-0.5", "temperature: -0.5 is not a temperature"),
        ("extract", "--seed=-1", "seed: -1 is out of range"),
        ("extract", "--engine.tensor_parallel_size=0", "engine.tensor_parallel_size: 0"),
    ],
)
def test_options_vllm_would_refuse_are_ours_to_refuse(
    capsys, tmp_path, tiny_model_dir, chats, command, option, said, monkeypatch
):
    import vllm

    def no_engine(*args, **kwargs):
        raise AssertionError("an engine started before the options were checked")

    monkeypatch.setattr(vllm, "LLM", no_engine)
    data = "--data" if command == "extract" else "--datasets"
    args = [command, f"--model={tiny_model_dir}", f"{data}=[{chats}]", option]
    err = one_error(capsys, [*args, f"--output={tmp_path / 'o'}"])
    assert said in err and not (tmp_path / "o").exists(), err


def test_pipeline_refuses_an_eval_temperature_before_extracting(capsys, tmp_path, tiny_model_dir):
    err = one_error(
        capsys,
        ["pipeline", f"--config={PIPELINE_TINY}", f"--output={tmp_path / 'p'}",
         f"--model={tiny_model_dir}", "--eval.temperatures=[-1]"],
    )  # fmt: skip
    assert "eval.temperatures: -1" in err or "temperatures: -1" in err
    assert not (tmp_path / "p").exists()
