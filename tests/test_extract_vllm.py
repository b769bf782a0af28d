"""End-to-end extraction with the real vLLM CPU build.

Each run is a separate `python -m draftsmith.extract` process, as users run it (vLLM
starts its workers with spawn, and a killed run must be a real process). Stopped, killed
and repaired runs are in test_extract_stops.py.
"""

from __future__ import annotations

import itertools
import json

import pytest
import torch
from extract_runs import CHATS, extract, write_jsonl

from draftsmith.conversations.template import render_conversation, render_prompt
from draftsmith.dataset.reader import open_dataset
from draftsmith.extract.verify import verify_dataset

pytestmark = pytest.mark.vllm


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
