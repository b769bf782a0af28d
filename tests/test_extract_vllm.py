"""End-to-end extraction with the real vLLM CPU build.

Each run is a separate `python -m draftsmith.extract` process, as users run it (vLLM
starts its workers with spawn, and a killed run must be a real process).
"""

from __future__ import annotations

import itertools
import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from draftsmith.conversations.template import render_conversation, render_prompt
from draftsmith.dataset.reader import open_dataset
from draftsmith.extract.verify import verify_dataset

pytestmark = pytest.mark.vllm

CHATS = [
    {
        "conversations": [
            {"from": "human", "value": "Name three primary colours."},
            {"from": "gpt", "value": "Red, yellow and blue."},
            {"from": "human", "value": "And secondary ones?"},
            {"from": "gpt", "value": "Orange, green and purple."},
        ]
    },
    {
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "What is 2 + 2?"},
            {"role": "assistant", "content": "4."},
        ]
    },
    {
        "messages": [
            {"role": "user", "content": "Say hello in French."},
            {"role": "assistant", "content": "Bonjour !"},
            {"role": "user", "content": "And in German?"},
            {"role": "assistant", "content": "Hallo!"},
        ]
    },
]


# Runs `draftsmith extract ARGS` but, at the second shard's write, reports "2" on the file
# descriptor given first and waits there forever (for the test's SIGKILL).
PAUSE_AT_SECOND_SHARD = """
import os, signal, sys
from draftsmith.dataset import shards as store
fd, real, calls = int(sys.argv[1]), store.write_shard, []
def write_shard(*args, **kwargs):
    calls.append(1)
    if len(calls) == 2:
        os.write(fd, b"2")
        while True:
            signal.pause()
    return real(*args, **kwargs)
store.write_shard = write_shard
from draftsmith.extract.main import main
sys.exit(main(sys.argv[2:]))
"""


def extract(args: list[str]) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "draftsmith.extract", *args]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_states_equal_transformers_without_regeneration(tmp_path, tiny_model_dir, tokenizer):
    data = write_jsonl(tmp_path / "chats.jsonl", CHATS)
    out = tmp_path / "ds"
    proc = extract(
        [
            f"--model={tiny_model_dir}",
            f"--data=[{data}]",
            f"--output={out}",
            "--dtype=float32",
            "--samples_per_shard=2",
            "--verify=3",
        ]
    )
    assert "verify: 3 samples" in proc.stdout

    ds = open_dataset(out)
    man = ds.manifest
    assert man["complete"] and man["layer_ids"] == [2, 4, 5, 8]  # [2, N//2, N-3, N], N = 8
    assert len(ds) == 3 and len(man["shards"]) == 2
    report = verify_dataset(str(out), 3)
    assert report.ok and all(c.relative < 1e-4 for c in report.layers), report.text()
    # Token ids and loss masks are exactly those of the chat template.
    messages = [
        [
            {"role": {"human": "user", "gpt": "assistant"}[m["from"]], "content": m["value"]}
            for m in CHATS[0]["conversations"]
        ],
        CHATS[1]["messages"],
        CHATS[2]["messages"],
    ]
    for i, msgs in enumerate(messages):
        ref = render_conversation(tokenizer, msgs)
        assert ds[i]["input_ids"].tolist() == ref.input_ids
        assert ds[i]["loss_mask"].int().tolist() == ref.loss_mask


def test_a_sample_longer_than_an_engine_step_is_stored_whole(tmp_path, tiny_model_dir, tokenizer):
    # vLLM prefills a prompt longer than its step budget in chunks (chunked prefill): a long
    # sample's states come from several engine steps and must still be stored whole, each
    # position the one transformers computes.
    notes = " ".join(f"Note {k}: the shipment left depot {k % 7} on day {k}." for k in range(40))
    chat = {
        "messages": [
            {
                "role": "user",
                "content": f"Read these notes, then tell me which day came last. {notes}",
            },
            {"role": "assistant", "content": "Day 39 came last: the shipment left depot 4."},
        ]
    }
    data = write_jsonl(tmp_path / "long.jsonl", [chat])
    out = tmp_path / "ds"
    step = 64
    proc = extract(
        [
            f"--model={tiny_model_dir}",
            f"--data=[{data}]",
            f"--output={out}",
            "--dtype=float32",
            "--max_length=2047",
            f"--engine.max_num_batched_tokens={step}",
            "--engine.max_num_seqs=4",
            "--verify=1",
        ]
    )
    assert "verify: 1 samples" in proc.stdout
    ds = open_dataset(out)
    ref = render_conversation(tokenizer, chat["messages"])
    assert len(ref.input_ids) > 10 * step  # 718 tokens: eleven or more engine steps of prefill
    assert ds[0]["input_ids"].tolist() == ref.input_ids  # whole: nothing cut
    assert ds[0]["loss_mask"].int().tolist() == ref.loss_mask
    report = verify_dataset(str(out), 1)
    assert report.ok and all(c.relative < 1e-4 for c in report.layers), report.text()


def test_repair_extracts_exactly_the_corrupt_shard_again(tmp_path, tiny_model_dir):
    """A byte flipped in one shard: reading it is refused in one line naming the repair
    command; `--output DIR --repair true` alone (the settings come from the manifest) writes
    that shard again, byte for byte as before, and leaves the other untouched."""
    from draftsmith.core.errors import DatasetError
    from draftsmith.extract.main import main

    data = write_jsonl(tmp_path / "chats.jsonl", CHATS)
    out = tmp_path / "ds"
    args = [f"--model={tiny_model_dir}", f"--data=[{data}]", f"--output={out}"]
    assert main([*args, "--samples_per_shard=2"]) == 0
    first, second = out / "shard-00000.safetensors", out / "shard-00001.safetensors"
    before = {f: (f.read_bytes(), f.stat().st_mtime_ns) for f in (first, second)}
    raw = bytearray(before[second][0])
    raw[-3] ^= 0x01  # a bit of the tensor data: the size and the header stay valid
    second.write_bytes(bytes(raw))
    ds = open_dataset(out)
    with pytest.raises(DatasetError, match=f"--output {out} --repair true") as err:
        [ds[i] for i in range(len(ds))]
    assert "\n" not in str(err.value)
    assert main([f"--output={out}", "--repair=true"]) == 0
    assert first.stat().st_mtime_ns == before[first][1]  # the good shard was not rewritten
    assert second.read_bytes() == before[second][0]  # the bad one is as extracted first
    ds = open_dataset(out)
    assert ds.manifest["complete"] and len(ds) == len(CHATS)
    assert all(ds[i]["input_ids"].numel() for i in range(len(ds)))


def test_a_mix_keeps_some_replies_and_regenerates_the_rest(tmp_path, tiny_model_dir, tokenizer):
    """`keep_replies: 0.5` with greedy regeneration: the second chat keeps its own replies
    (prefilled beside the others, token for token the chat template's); the target
    answers the first and third in the capturing pass. Their second rounds do not fit
    `max_length`, so each ends after its first round (counted as truncated, not lost).
    Every state matches transformers."""
    data = write_jsonl(tmp_path / "chats.jsonl", CHATS)
    first_rounds = [
        render_prompt(tokenizer, [{"role": "user", "content": chat[0]}])
        for chat in (["Name three primary colours."], ["Say hello in French."])
    ]
    # A second round adds a reply and about 15 template and user tokens: it cannot fit.
    max_length = max(map(len, first_rounds)) + 8
    kept = render_conversation(tokenizer, CHATS[1]["messages"])
    assert len(kept.input_ids) <= max_length
    out = tmp_path / "mix"
    extract(
        [
            f"--model={tiny_model_dir}",
            f"--data=[{data}]",
            f"--output={out}",
            "--regenerate=true",
            "--keep_replies=0.5",
            "--max_new_tokens=16",
            f"--max_length={max_length}",
            "--dtype=float32",
        ]
    )
    ds = open_dataset(out)
    samples = {ds[i]["id"]: ds[i] for i in range(len(ds))}
    assert sorted(samples) == ["chats:1", "chats:2", "chats:3"]  # ids name 1-based rows
    assert samples["chats:2"]["input_ids"].tolist() == kept.input_ids
    assert samples["chats:2"]["loss_mask"].tolist() == kept.loss_mask
    for answered, prompt in zip(("chats:1", "chats:3"), first_rounds, strict=True):
        sample = samples[answered]
        assert sample["input_ids"][: len(prompt)].tolist() == prompt  # the first round
        text = tokenizer.decode(sample["input_ids"])
        assert "Red, yellow" not in text and "Bonjour" not in text  # the target's reply
        assert text.count("<|im_start|>user") == 1 and sample["loss_mask"][-1]
    assert ds.manifest["skipped"]["truncated"] == 2 and ds.manifest["skipped"]["count"] == 0
    report = verify_dataset(str(out), 3)
    assert report.ok and all(c.relative < 1e-4 for c in report.layers), report.text()


def shard_files(out: Path) -> dict[int, str]:
    """Finished shards (file and sidecar both present) by index."""
    return {
        int(p.stem.split("-")[1]): p.stem
        for p in out.glob("shard-*.safetensors")
        if p.with_suffix(".json").is_file()
    }


def test_worker_killed_mid_shard_reruns_and_merges_without_gaps(tmp_path, tiny_model_dir):
    """Two workers fill one dataset; worker 1 is SIGKILLed while writing its second shard
    (its first one finished and recorded), re-run, and a merge run completes the dataset:
    every sample once, in order, no stray files, and the states equal transformers'."""
    prompts = [{"prompt": f"Tell me fact number {i} about the sea."} for i in range(8)]
    data = write_jsonl(tmp_path / "prompts.jsonl", prompts)
    out = tmp_path / "out"
    common = [
        f"--model={tiny_model_dir}",
        f"--data=[{data}]",
        f"--output={out}",
        "--regenerate=true",
        "--max_new_tokens=32",
        "--samples_per_shard=2",
        "--dtype=bfloat16",
    ]
    extract([*common, "--workers=2", "--worker=0"])
    assert shard_files(out) == {0: "shard-00000", 2: "shard-00002"}

    # Worker 1 (shards 1 and 3) tells us over a pipe when it reaches its second shard's
    # write; then the whole run is killed, as a crash or an OOM kill would.
    ready, signal_w = os.pipe()
    worker1 = [*common, "--workers=2", "--worker=1"]
    proc = subprocess.Popen(
        [sys.executable, "-c", PAUSE_AT_SECOND_SHARD, str(signal_w), *worker1],
        pass_fds=(signal_w,),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # a kill takes vLLM's engine processes down with it
    )
    os.close(signal_w)
    readable, _, _ = select.select([ready], [], [], 600)
    if not readable:  # the worker pauses forever at its second shard: kill it before reading
        os.killpg(proc.pid, signal.SIGKILL)
        output = proc.communicate()[0].decode()[-3000:]
        pytest.fail(f"worker 1 wrote no second shard in 600 s:\n{output}")
    assert os.read(ready, 1) == b"2"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert not json.loads((out / "manifest.json").read_text())["complete"]
    assert sorted(shard_files(out)) == [0, 1, 2]  # worker 1's first shard is kept
    written = {
        name: (out / f"{name}.safetensors").stat().st_mtime_ns for name in shard_files(out).values()
    }

    extract(worker1)  # writes shard 3 only
    extract(common)  # the merge: every shard is done, so no engine starts
    man = json.loads((out / "manifest.json").read_text())
    assert man["complete"] and man["num_samples"] == 8
    assert sorted(shard_files(out)) == [0, 1, 2, 3]
    assert {n: (out / f"{n}.safetensors").stat().st_mtime_ns for n in written} == written
    assert not list(out.glob("*.tmp"))
    ds = open_dataset(out)
    ids = [ds[i]["id"] for i in range(len(ds))]
    assert len(ids) == 8 == len(set(ids)), ids
    assert [ds[i]["loss_mask"].any().item() for i in range(8)] == [True] * 8
    report = verify_dataset(str(out), 8)
    assert report.ok, report.text()


def test_smollm2_writes_prompts_and_samples_replies_that_match_transformers(
    tmp_path, smollm2_dir, tokenizer
):
    """The real chat model writes three prompts, then answers them and a two-turn chat
    with sampled replies (a plain engine writes them: vLLM 0.32's capture method
    degenerates sampled text), captured by prefill; the states match transformers."""
    data = write_jsonl(tmp_path / "multi.jsonl", [CHATS[2]])
    out = tmp_path / "sampled"
    extract(
        [
            f"--model={smollm2_dir}",
            f"--data=[self:3,{data}]",
            f"--output={out}",
            "--regenerate=true",
            "--temperature=0.8",
            "--max_new_tokens=48",
            "--dtype=float32",
        ]
    )
    ds = open_dataset(out)
    assert len(ds) == 4 and len(list((out / "replies").glob("*.json"))) == 1
    prompts = [
        json.loads(x)["prompt"] for x in (out / "prompts.self.jsonl").read_text().split("\n") if x
    ]
    assert len(set(prompts)) == 3 and all(len(p) >= 12 for p in prompts)
    for i in range(len(ds)):
        sample = ds[i]
        reply = sample["input_ids"][sample["loss_mask"]].tolist()
        assert "<|im_start|>user" not in tokenizer.decode(reply)  # no user turn in the loss
        assert sample["loss_mask"][-1]  # the sample ends inside the regenerated reply
        # Degenerate replies repeat one token ("you you you ..."); real ones do not.
        longest_run = max(sum(1 for _ in g) for _, g in itertools.groupby(reply))
        assert longest_run < 6, tokenizer.decode(reply)
        assert len(set(reply)) > len(reply) // 3, tokenizer.decode(reply)
    # The two-turn chat: its first reply was regenerated too, so the original assistant
    # text is gone and both replies are in the loss mask.
    (multi,) = [ds[i] for i in range(len(ds)) if ds[i]["id"].startswith("multi:")]
    full = tokenizer.decode(multi["input_ids"])
    assert "Bonjour !" not in full and full.count("<|im_start|>assistant") == 2
    assert torch.diff(multi["loss_mask"].int()).eq(1).sum().item() == 2
    report = verify_dataset(str(out), 4)
    assert report.ok and all(c.relative < 1e-4 for c in report.layers), report.text()


def test_reasoning_template_gives_a_sample_per_turn_each_as_the_target_saw_it(
    tmp_path, tiny_model_dir, tokenizer
):
    """A target whose template drops earlier replies' <think> block (Qwen3's shape), with
    `enable_thinking: false` given to the template: every assistant turn is its own sample,
    holding exactly the prompt the target read for it (the chat endpoint's render) and then
    the turn; the loss covers that turn only. The first chat is answered by the target
    round by round (each round captured as it is written), the second keeps its replies
    (`keep_replies: 0.5`). Every state matches transformers."""
    import shutil

    from chat_templates import QWEN3_LIKE
    from transformers import AutoTokenizer

    from draftsmith.conversations.template import render_turns

    model = shutil.copytree(tiny_model_dir, tmp_path / "thinking-llama")
    (model / "chat_template.jinja").write_text(QWEN3_LIKE)
    tok = AutoTokenizer.from_pretrained(model)
    kwargs = {"enable_thinking": False}
    chats = [
        [
            {"role": "user", "content": f"Question {i}?"},
            {"role": "assistant", "content": f"Answer {i}."},
            {"role": "user", "content": f"Follow-up {i}?"},
            {"role": "assistant", "content": f"Second answer {i}."},
        ]
        for i in range(2)
    ]
    data = write_jsonl(tmp_path / "chats.jsonl", [{"messages": m} for m in chats])
    out = tmp_path / "turns"
    proc = extract(
        [
            f"--model={model}",
            f"--data=[{data}]",
            f"--output={out}",
            "--regenerate=true",
            "--keep_replies=0.5",
            "--chat_template_kwargs={enable_thinking: false}",
            "--max_new_tokens=12",
            "--dtype=float32",
        ]
    )
    assert "4 samples (4 single turns)" in proc.stdout
    ds = open_dataset(out)
    samples = {ds[i]["id"]: ds[i] for i in range(len(ds))}
    assert list(samples) == ["chats:1#1", "chats:1#2", "chats:2#1", "chats:2#2"]

    def prompt_of(sample) -> list[int]:
        mask = sample["loss_mask"].tolist()
        assert mask == sorted(mask) and mask[-1]  # 0s (the prompt), then 1s (the turn)
        return sample["input_ids"][: mask.index(1)].tolist()

    def chat_ids(messages) -> list[int]:
        return tok.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False, **kwargs
        )

    # Regenerated: round 1 after exactly the endpoint's prompt; round 2 after the history
    # with the target's first reply in it, rendered as an earlier turn (no think block).
    first, second = samples["chats:1#1"], samples["chats:1#2"]
    assert prompt_of(first) == chat_ids(chats[0][:1])
    reply = tok.decode(first["input_ids"][len(prompt_of(first)) :])
    text = tok.decode(prompt_of(second))
    earlier = "<|im_start|>user\nQuestion 0?<|im_end|>\n<|im_start|>assistant\n"
    assert "Answer 0." not in text and text.startswith(earlier + reply)
    assert text.endswith("Follow-up 0?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
    # Kept replies: exactly the template's per-turn samples.
    for k, turn in enumerate(render_turns(tok, chats[1], kwargs=kwargs), start=1):
        assert samples[f"chats:2#{k}"]["input_ids"].tolist() == turn.input_ids
        assert samples[f"chats:2#{k}"]["loss_mask"].tolist() == turn.loss_mask
    assert prompt_of(samples["chats:2#2"]) == chat_ids(chats[1][:3])

    man = ds.manifest
    assert man["num_turn_samples"] == 4 and man["turn_samples_by_turn"] == {"1": 2, "2": 2}
    shared = sum(
        next(
            (n for n, (a, b) in enumerate(zip(x.tolist(), y.tolist(), strict=False)) if a != b),
            min(len(x), len(y)),
        )
        for x, y in (
            (first["input_ids"], second["input_ids"]),
            (samples["chats:2#1"]["input_ids"], samples["chats:2#2"]["input_ids"]),
        )
    )
    assert man["num_unique_tokens"] == man["num_tokens"] - shared > 0
    report = verify_dataset(str(out), 4)
    assert report.ok and all(c.relative < 1e-4 for c in report.layers), report.text()


# Runs `draftsmith extract ARGS` (argv[3:]) with `core/files.open` patched for the file whose
# name ends with argv[2] ("shard-00001.safetensors.tmp"): after 4096 bytes, in mode "pause"
# it reports on the fd argv[1] and waits (for the test's SIGTERM), in mode "full" every
# write raises ENOSPC, as on a full disk.
INTERRUPT_MID_WRITE = """
import errno, os, signal, sys
from draftsmith.core import files
fd, name, mode = int(sys.argv[1]), sys.argv[2], sys.argv[3]

class Cut:
    def __init__(self, f):
        self.f, self.room = f, 4096
    def write(self, data):
        data = memoryview(data).cast("B")
        if len(data) <= self.room:
            self.room -= len(data)
            return self.f.write(data)
        self.f.write(data[: self.room])
        self.room = 0
        if mode == "full":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        os.write(fd, b"1")
        while True:
            signal.pause()
    def __getattr__(self, attr):
        return getattr(self.f, attr)
    def __enter__(self):
        return self
    def __exit__(self, *exc):
        self.f.close()

def cut_open(path, *args, **kwargs):
    f = open(path, *args, **kwargs)
    return Cut(f) if str(path).endswith(name) else f

files.open = cut_open
from draftsmith.extract.main import main
sys.exit(main(sys.argv[4:]))
"""


def interrupted(
    args: list[str], mode: str, stop: bool, started: Callable[[], None] | None = None
) -> tuple[int, str, str]:
    """Run extraction under INTERRUPT_MID_WRITE (``started()`` once it wrote its log);
    with ``stop``, send SIGTERM to its whole process group (as `timeout` does) once it is
    4096 bytes into shard 1. Returns (exit status, stdout, stderr)."""
    ready, signal_w = os.pipe()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            INTERRUPT_MID_WRITE,
            str(signal_w),
            "shard-00001.safetensors.tmp",
            mode,
            *args,
        ],  # fmt: skip
        pass_fds=(signal_w,),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    os.close(signal_w)
    if started is not None:
        log = Path(next(a for a in args if a.startswith("--output=")).split("=", 1)[1])
        while not (log / "extract.log").is_file() and proc.poll() is None:
            time.sleep(0.1)
        started()
    if stop:
        readable, _, _ = select.select([ready], [], [], 300)
        if not readable:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail(f"no shard 1 in 300 s:\n{proc.communicate()[1][-3000:]}")
        os.killpg(proc.pid, signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    os.close(ready)
    deadline = time.monotonic() + 30  # nothing of the run is left (vLLM included)
    while time.monotonic() < deadline and group_alive(proc.pid):
        time.sleep(0.2)
    left = subprocess.run(["ps", "-o", "pid,stat,cmd", "-g", str(proc.pid)],
                          capture_output=True, text=True).stdout  # fmt: skip
    assert not group_alive(proc.pid), left
    return proc.returncode, out, err


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def same_shards(a: Path, b: Path) -> None:
    """Every planned shard of ``b`` is in ``a``, byte for byte (by sha256), and ``a``
    holds nothing half written."""
    shards = [json.loads(p.read_text()) for p in sorted(b.glob("shard-*.json"))]
    assert shards and [json.loads(p.read_text())["sha256"] for p in sorted(a.glob("shard-*.json"))
                       ] == [s["sha256"] for s in shards]  # fmt: skip
    assert not list(a.rglob("*.tmp"))
    man = json.loads((a / "manifest.json").read_text())
    assert man["complete"] and [s["sha256"] for s in man["shards"]] == [s["sha256"] for s in shards]


@pytest.fixture(scope="module")
def whole_run(tmp_path_factory, tiny_model_dir) -> tuple[list[str], Path]:
    """The settings of the interruption tests (3 conversations, a shard each) and the
    dataset an uninterrupted run writes with them."""
    tmp = tmp_path_factory.mktemp("whole")
    data = write_jsonl(tmp / "chats.jsonl", CHATS)
    common = [f"--model={tiny_model_dir}", f"--data=[{data}]", "--samples_per_shard=1",
              "--dtype=float32"]  # fmt: skip
    extract([*common, f"--output={tmp / 'ds'}"])
    return common, tmp / "ds"


@pytest.mark.parametrize("mode", ["sigterm", "full disk"])
def test_a_stopped_extraction_keeps_whole_shards_and_the_rerun_completes(tmp_path, whole_run, mode):
    """SIGTERM mid-write of shard 1 (to the whole process group), or a full disk there:
    one line (exit 143 saying how many shards were written, or exit 2 naming the path and
    the free space), no traceback, shard 0 kept, nothing of shard 1 left, no process left;
    the same command run again completes the dataset byte for byte as an uninterrupted run."""
    common, whole = whole_run
    out = tmp_path / "ds"
    args = [*common, f"--output={out}"]
    code, stdout, stderr = interrupted(
        args, "pause" if mode == "sigterm" else "full", mode == "sigterm"
    )
    lines = stderr.strip().splitlines()
    if mode == "sigterm":
        assert code == 143, stderr[-3000:]
        assert lines == [
            f"draftsmith extract: stopped by SIGTERM; 1 of 3 shards written to {out}; run the "
            "same command again to go on"
        ]
    else:
        assert code == 2, stderr[-3000:]
        shard = out / "shard-00001.safetensors"
        assert len(lines) == 1 and lines[0].startswith(
            f"draftsmith extract: error: could not write shard {shard}: No space left on device"
        ), lines
        assert "GiB free on" in lines[0]
    log = (out / "extract.log").read_text()
    assert "Traceback" not in stdout + stderr + log
    assert shard_files(out) == {0: "shard-00000"} and not list(out.glob("shard-00001*"))
    assert not list(out.rglob("*.tmp"))
    extract(args)
    same_shards(out, whole)


def test_a_stopped_producer_leaves_the_stream_open_and_a_new_one_completes_it(tmp_path, whole_run):
    """A streamed run's producer gets SIGTERM mid-write of shard 1: one line, exit 143, the
    stream not failed (the trainer waits for another producer), nothing half written; a
    producer started again writes what is still wanted, the same shards as offline."""
    from draftsmith.dataset.stream import StreamDir

    common, whole = whole_run
    out = tmp_path / "ds"
    args = [*common, f"--output={out}", "--stream=true"]
    stream = StreamDir(out)
    # what a trainer asks for, once the producer made its output directory
    code, _, stderr = interrupted(args, "pause", True, lambda: stream.want(0, [0, 1, 2]))
    assert code == 143, stderr[-3000:]
    assert stderr.strip().splitlines() == [
        f"draftsmith extract: stopped by SIGTERM; 1 of 3 shards written to {out}; run the "
        "same command again to go on"
    ]
    assert stream.failure() is None and stream.producers()[0]["state"] == "stopped by SIGTERM"
    assert shard_files(out) == {0: "shard-00000"} and not list(out.rglob("*.tmp"))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    producer = subprocess.Popen(
        [sys.executable, "-m", "draftsmith.extract", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 300
        while len(shard_files(out)) < 3 and time.monotonic() < deadline:
            stream.want(0, [0, 1, 2])  # the trainer's heartbeat
            time.sleep(0.2)
    finally:
        stream.finish()
        output = producer.communicate(timeout=120)[0]
    assert producer.returncode == 0, output[-3000:]
    same_shards(out, whole)
