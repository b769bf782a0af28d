"""The input sweep: every kind of file draftsmith reads, in every corrupt form.

``draftsmith.core.readers.FILE_KINDS`` lists the kinds; ``CASES`` below has one entry per
kind (a kind without one fails ``test_every_file_kind_is_swept``). Each entry builds a
whole file of its kind, the package function that reads it, and, for the files a user hands
to a command, that command. Every corrupt form must end in one line (a ``DraftsmithError``;
exit 2 and no traceback from the command) that names the file, and the command writes
nothing.
"""

from __future__ import annotations

import ast
import json
import os
import pickle
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from draftsmith.cli import main as cli_main
from draftsmith.core.errors import DraftsmithError, original_message
from draftsmith.core.readers import FILE_KINDS

ROOT = Path(__file__).resolve().parents[1]
TRAIN_TINY = ROOT / "configs/train/tiny.yaml"


class Evil:
    """Unpickling this would run ``os.system``: a reader must refuse it unread."""

    def __reduce__(self):
        return (os.system, ("touch /tmp/draftsmith-sweep-ran",))


def forms(valid: bytes, kind: str) -> dict[str, bytes]:
    """Every corrupt form of a file whose whole bytes are ``valid``."""
    out = {
        "empty": b"",
        "cut at 8 bytes": valid[:8],
        "cut in half": valid[: len(valid) // 2],
        "cut by one byte": valid.rstrip()[:-1],
        "garbage": bytes(range(7, 251)) * 3,
        "not utf-8": b'{"shards": ["caf\xe9 \xff"]}',
    }
    if kind in JSON_KINDS:
        out["json list"] = b"[1, 2, 3]"
        out["json object of other keys"] = b'{"something": "else"}'
    if kind in YAML_KINDS:
        out["yaml list"] = b"- a\n- b\n"
    if kind in PICKLE_KINDS or kind in JSON_KINDS:
        out["pickle payload"] = pickle.dumps(Evil())
    if kind in PICKLE_KINDS:  # a torch zip whose pickle names os.system
        out["torch zip with a payload"] = _torch_payload()
    return out


def _torch_payload() -> bytes:
    import io

    buf = io.BytesIO()
    torch.save({"state_dict": {}, "evil": Evil()}, buf)
    return buf.getvalue()


JSON_KINDS = {"dataset manifest", "dataset plan", "shard sidecar", "kept replies", "head config",
              "safetensors index", "stage record", "target config", "tokenizer", "jsonl",
              "conversations"}  # fmt: skip
YAML_KINDS = {"yaml config"}
PICKLE_KINDS = {"head pickle", "dflash embedding", "checkpoint", "fsdp checkpoint",
                "deepspeed checkpoint"}  # fmt: skip


@dataclass
class Case:
    """A whole file of one kind inside ``root``, how the package reads it, and (for a file
    a user gives a command) the command, writing to ``out``."""

    file: Path
    read: Callable[[], object]
    argv: list[str] | None = None
    out: Path | None = None
    whole_reads: bool = True
    named: Path | None = None
    """The path the error must name (default: the file's directory)."""
    """False where the test cannot build a whole file of the kind (a DeepSpeed or sharded
    FSDP directory needs their multi-process runs): only the corrupt forms are read."""


# ----- one builder per kind: (tmp dir, fixtures) -> Case --------------------------------


def _dataset(tmp: Path, fx) -> Path:
    data = tmp / "data"
    shutil.copytree(fx.tiny_dataset, data)
    return data


def _train_argv(data: Path, out: Path) -> list[str]:
    return ["train", "fit", f"--config={TRAIN_TINY}", f"--data.data={data}",
            f"--trainer.default_root_dir={out}", f"--checkpoint.dirpath={out / 'ckpt'}",
            "--trainer.max_steps=1"]  # fmt: skip


def case_manifest(tmp, fx):
    from draftsmith.dataset import open_dataset

    data = _dataset(tmp, fx)
    out = tmp / "run"
    return Case(data / "manifest.json", lambda: open_dataset(data), _train_argv(data, out), out)


def case_plan(tmp, fx):
    from draftsmith.dataset.manifest import read_plan, write_plan

    data = tmp / "planned"
    skipped = {"count": 0, "rows": [], "by_reason": {}}
    write_plan(data, {"model": "m"}, [["a", "b"], ["c"]], skipped)
    return Case(data / "plan.json", lambda: read_plan(data))


def case_shard(tmp, fx):
    from draftsmith.dataset import open_dataset

    data = _dataset(tmp, fx)
    first = json.loads((data / "manifest.json").read_text())["shards"][0]["file"]
    out = tmp / "run"
    return Case(data / first, lambda: open_dataset(data), _train_argv(data, out), out)


def case_sidecar(tmp, fx):
    from draftsmith.core.files import sha256_file
    from draftsmith.dataset.manifest import shard_done, shard_name, sidecar_path

    data = tmp / "written"
    data.mkdir()
    shard = data / shard_name(0)
    shutil.copy(fx.tiny_dataset / shard_name(0), shard)
    info = {"sample_ids": ["a"], "bytes": shard.stat().st_size, "sha256": sha256_file(shard)}
    sidecar_path(data, 0).write_text(json.dumps(info))
    return Case(sidecar_path(data, 0), lambda: shard_done(data, 0, ["a"]))


def case_kept_replies(tmp, fx):
    from draftsmith.extract import replies

    path = tmp / "replies" / "shard-00000.json"
    path.parent.mkdir()
    path.write_text(json.dumps({"sequences": [], "skipped": {"rows": [], "truncated": 0}}))
    return Case(path, lambda: replies.load(path, {}))


def case_staged_states(tmp, fx):
    from draftsmith.core.readers import read_safetensors

    path = tmp / "staged.safetensors"
    save_file({"hidden_states": torch.zeros(3, 2, 4), "token_ids": torch.arange(3)}, path)
    return Case(path, lambda: read_safetensors(path, "staged states", "capture again"))


def _head(tmp, fx, layout: str) -> Path:
    head = tmp / "head"
    shutil.copytree(fx.tiny_eagle3_head, head)
    if layout == "bin":
        tensors = load_file(head / "model.safetensors")
        (head / "model.safetensors").unlink()
        torch.save(tensors, head / "pytorch_model.bin")
    elif layout == "index":
        names = load_file(head / "model.safetensors")
        index = {"metadata": {}, "weight_map": dict.fromkeys(names, "model.safetensors")}
        (head / "model.safetensors.index.json").write_text(json.dumps(index))
    return head


def _convert(head: Path, tmp: Path, fx) -> tuple[list[str], Path]:
    out = tmp / "converted"
    argv = ["convert", f"--head={head}", "--to=sglang", f"--output={out}",
            f"--model={fx.tiny_model_dir}"]  # fmt: skip
    return argv, out


def _head_case(tmp, fx, layout: str, name: str) -> Case:
    from draftsmith.drafters.eagle3.layouts import read_head

    head = _head(tmp, fx, layout)
    argv, out = _convert(head, tmp, fx)
    return Case(head / name, lambda: read_head(head), argv, out)


def case_head_config(tmp, fx):
    return _head_case(tmp, fx, "safetensors", "config.json")


def case_head_weights(tmp, fx):
    return _head_case(tmp, fx, "safetensors", "model.safetensors")


def case_safetensors_index(tmp, fx):
    return _head_case(tmp, fx, "index", "model.safetensors.index.json")


def case_head_pickle(tmp, fx):
    return _head_case(tmp, fx, "bin", "pytorch_model.bin")


def case_dflash_embedding(tmp, fx):
    from draftsmith.drafters.dflash.export import MASK_EMBEDDING_FILE, read_mask_embedding

    head = tmp / "dflash"
    head.mkdir()
    torch.save({"mask_token_id": 3, "embedding": torch.zeros(8)}, head / MASK_EMBEDDING_FILE)
    return Case(head / MASK_EMBEDDING_FILE, lambda: read_mask_embedding(head))


def case_checkpoint(tmp, fx):
    from draftsmith.train.checkpoints import read_checkpoint

    ckpt = tmp / "last.ckpt"
    shutil.copy(fx.tiny_checkpoint, ckpt)
    out = tmp / "exported"
    argv = ["export", f"--checkpoint={ckpt}", f"--output={out}"]
    return Case(ckpt, lambda: read_checkpoint(ckpt), argv, out)


def case_deepspeed_checkpoint(tmp, fx):
    """A ZeRO directory as DeepSpeed lays it out, its model-states file damaged."""
    from draftsmith.train.checkpoints import read_checkpoint

    ckpt = tmp / "ds.ckpt"
    (ckpt / "checkpoint").mkdir(parents=True)
    (ckpt / "latest").write_text("checkpoint")
    states = ckpt / "checkpoint" / "mp_rank_00_model_states.pt"
    torch.save({"module": {}, "buffer_names": [], "ds_version": "0.18"}, states)
    return Case(states, lambda: read_checkpoint(ckpt), whole_reads=False, named=ckpt)


def case_fsdp_checkpoint(tmp, fx):
    from draftsmith.train.checkpoints import FSDP_METADATA, read_checkpoint

    ckpt = tmp / "fsdp.ckpt"
    ckpt.mkdir()
    torch.save({"epoch": 0, "global_step": 1}, ckpt / FSDP_METADATA)
    return Case(ckpt / FSDP_METADATA, lambda: read_checkpoint(ckpt), whole_reads=False)


def case_yaml_config(tmp, fx):
    from draftsmith.pipelines.config import read_yaml_mapping

    path = tmp / "pipeline.yaml"
    # Flow style: any cut is invalid YAML. (A block mapping cut at a line end is a valid
    # shorter config; the options that are then missing are the parser's to name.)
    path.write_text(f"{{model: {fx.tiny_model_dir}, output: {tmp / 'pipe'}}}\n")
    argv = ["pipeline", f"--config={path}"]
    return Case(path, lambda: read_yaml_mapping(path, "--config"), argv, tmp / "pipe")


def case_stage_record(tmp, fx):
    from draftsmith.core.readers import read_json

    path = tmp / ".done.json"
    path.write_text(json.dumps({"seconds": 1.0}))
    return Case(path, lambda: read_json(path, "stage record", "rerun", keys=("seconds",)))


def case_jsonl(tmp, fx):
    from draftsmith.core.readers import read_jsonl

    path = tmp / "prompts.jsonl"
    path.write_text('{"prompt": "a"}\n{"prompt": "b"}\n{"prompt": "c"}\n')  # half: mid-line
    return Case(path, lambda: read_jsonl(path, "jsonl", "write it again", ("prompt",)))


def case_conversations(tmp, fx):
    from draftsmith.conversations.sources import SkipLog, load_conversations

    path = tmp / "chats.json"
    rows = [
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    ]
    path.write_text(json.dumps(rows))
    return Case(path, lambda: load_conversations(str(path), skips=SkipLog()))


def _target(tmp, fx) -> Path:
    target = tmp / "target"
    shutil.copytree(fx.tiny_model_dir, target)
    return target


def _extract_argv(target: Path, tmp: Path) -> tuple[list[str], Path]:
    chats = tmp / "chats.jsonl"
    chats.write_text(json.dumps({"prompt": "hi"}) + "\n")
    out = tmp / "extracted"
    return ["extract", f"--model={target}", f"--data=[{chats}]", f"--output={out}"], out


def case_target_config(tmp, fx):
    from draftsmith.core.targets import read_target

    target = _target(tmp, fx)
    argv, out = _extract_argv(target, tmp)
    return Case(target / "config.json", lambda: read_target(str(target)), argv, out)


def case_target_weights(tmp, fx):
    from draftsmith.core.targets import read_target
    from draftsmith.drafters.target.weights import load_target_weights

    target = _target(tmp, fx)
    return Case(target / "model.safetensors",
                lambda: load_target_weights(read_target(str(target))))  # fmt: skip


def case_tokenizer(tmp, fx):
    from draftsmith.core.targets import load_tokenizer

    target = _target(tmp, fx)
    argv, out = _extract_argv(target, tmp)
    return Case(target / "tokenizer.json", lambda: load_tokenizer(str(target)), argv, out)


CASES: dict[str, Callable] = {
    "dataset manifest": case_manifest,
    "dataset plan": case_plan,
    "shard": case_shard,
    "shard sidecar": case_sidecar,
    "kept replies": case_kept_replies,
    "staged states": case_staged_states,
    "head config": case_head_config,
    "head weights": case_head_weights,
    "safetensors index": case_safetensors_index,
    "head pickle": case_head_pickle,
    "dflash embedding": case_dflash_embedding,
    "checkpoint": case_checkpoint,
    "deepspeed checkpoint": case_deepspeed_checkpoint,
    "fsdp checkpoint": case_fsdp_checkpoint,
    "yaml config": case_yaml_config,
    "jsonl": case_jsonl,
    "conversations": case_conversations,
    "stage record": case_stage_record,
    "target config": case_target_config,
    "target weights": case_target_weights,
    "tokenizer": case_tokenizer,
}


def test_every_file_kind_is_swept():
    assert set(CASES) == set(FILE_KINDS), set(CASES) ^ set(FILE_KINDS)


# ----- the fixtures every case may use ----------------------------------------------------


@dataclass
class Fixtures:
    tiny_dataset: Path
    tiny_model_dir: Path
    tiny_eagle3_head: Path
    tiny_checkpoint: Path


@pytest.fixture(scope="module")
def fx(tmp_path_factory, tiny_dataset, tiny_model_dir, tiny_eagle3_head) -> Fixtures:
    out = tmp_path_factory.mktemp("ckpt")
    assert cli_main(_train_argv(tiny_dataset, out)) == 0
    ckpt = out / "ckpt" / "last.ckpt"
    return Fixtures(tiny_dataset, tiny_model_dir, tiny_eagle3_head, ckpt)


def _every_form(kind: str):
    return [pytest.param(kind, form, id=f"{kind}/{form}") for form in forms(b"x" * 64, kind)]


@pytest.mark.parametrize(("kind", "form"), [p for kind in CASES for p in _every_form(kind)])
def test_reader_refuses_in_one_line(kind, form, fx, tmp_path):
    """The package function that reads the file raises one line naming it."""
    case = CASES[kind](tmp_path, fx)
    if case.whole_reads:
        case.read()  # the whole file reads
    case.file.write_bytes(forms(case.file.read_bytes(), kind)[form])
    with pytest.raises(DraftsmithError) as err:
        case.read()
    text = original_message(str(err.value))
    assert "\n" not in text and str(case.named or case.file.parent) in text, text
    assert not Path("/tmp/draftsmith-sweep-ran").exists()


COMMAND_KINDS = [kind for kind in CASES if kind not in (
    "dataset plan", "shard sidecar", "kept replies", "staged states", "dflash embedding",
    "deepspeed checkpoint", "fsdp checkpoint", "jsonl", "conversations", "stage record",
    "target weights")]  # fmt: skip


@pytest.mark.parametrize(("kind", "form"), [p for kind in COMMAND_KINDS for p in _every_form(kind)])
def test_command_refuses_in_one_line_and_writes_nothing(kind, form, fx, tmp_path, capsys):
    """The command a user gives the file: exit 2, one stderr line, no traceback, and no
    output (train's log file aside: it opens before the data is read)."""
    case = CASES[kind](tmp_path, fx)
    assert case.argv is not None and case.out is not None
    case.file.write_bytes(forms(case.file.read_bytes(), kind)[form])
    capsys.readouterr()
    code = cli_main(case.argv)
    captured = capsys.readouterr()
    lines = [x for x in captured.err.strip().splitlines() if not x.startswith("INFO:")]
    assert code == 2 and len(lines) == 1 and ": error: " in lines[0], captured.err
    assert "Traceback" not in captured.err + captured.out
    assert str(case.file.parent) in lines[0] or kind == "yaml config", lines[0]
    written = [p for p in case.out.rglob("*") if p.is_file() and p.suffix != ".log"]
    assert written == [] and not (case.out / "ckpt").exists(), written
    assert not Path("/tmp/draftsmith-sweep-ran").exists()


# ----- every file is read through the boundary --------------------------------------------

# Calls that open a file, by name, and the modules allowed to make them (besides
# core/readers.py) with the reason.
OPENERS = {"torch.load", "safe_open", "load_file", "json.load", "yaml.safe_load", "yaml.load",
           "from_pretrained"}  # fmt: skip
ALLOWED = {
    ("core/config.py", "yaml.safe_load"): "a command-line value, not a file",
    ("core/targets.py", "from_pretrained"): "the GGUF a Python package ships, converted once",
    ("extract/verify.py", "from_pretrained"): "transformers' own forward, the check's reference",
    ("bench/extract.py", "from_pretrained"): "transformers' forward, the benchmark's baseline",
    ("train/checkpoints.py", "load_file"): "its own wrapper of readers.read_torch",
    ("train/main.py", "load_file"): "checkpoints.load_file: readers.read_torch",
    ("evaluate/replay.py", "from_pretrained"): "the target's forward: expected acceptance",
    ("bench/device_train.py", "load_file"): "the benchmark's own exported heads, compared",
    ("bench/planes.py", "json.loads(file)"): "the benchmark reads the shards it compresses",
    ("bench/planes.py", "safe_open"): "the benchmark reads the shards it compresses",
    ("core/outputs.py", "json.loads(file)"): "a probe of whose a file is: unreadable is not ours",
}


def _opener(node: ast.Call) -> str | None:
    func = node.func
    if isinstance(func, ast.Attribute):
        base = func.value.id if isinstance(func.value, ast.Name) else ""
        name = f"{base}.{func.attr}" if base in ("torch", "json", "yaml") else func.attr
    elif isinstance(func, ast.Name):
        name = func.id
    else:
        return None
    if name == "json.loads" and node.args:  # json.loads(<file>.read_text()) opens a file
        arg = node.args[0]
        if isinstance(arg, ast.Call) and isinstance(arg.func, ast.Attribute):
            if arg.func.attr in ("read_text", "read_bytes", "read"):
                return "json.loads(file)"
    return name if name in OPENERS else None


def test_every_file_is_opened_through_the_readers():
    package = ROOT / "draftsmith"
    found = []
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package).as_posix()
        if rel == "core/readers.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and (name := _opener(node)):
                if (rel, name) not in ALLOWED:
                    found.append(f"{rel}:{node.lineno} {name}")
    assert not found, f"read these through draftsmith.core.readers: {found}"
