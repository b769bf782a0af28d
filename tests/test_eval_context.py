"""Acceptance by context length: the long ShareGPT set, its buckets, and eval's table and plot."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from draftsmith.conversations import longctx, sharegpt
from draftsmith.conversations.rows import SkipLog
from draftsmith.conversations.sources import load_conversations
from draftsmith.core.errors import ConfigError
from draftsmith.evaluate.context import check_buckets


def words(n: int, tag: str) -> str:
    return " ".join(f"{tag}{i}" for i in range(n))


# A character-free "tokenizer": one token per word; the template adds 2 tokens per turn and
# 1 for the generation prompt.
def tokenize(text: str) -> list[str]:
    return text.split()


def detokenize(ids: list[str]) -> str:
    return " ".join(ids)


def render(messages: list[dict]) -> list[str]:
    out = []
    for m in messages:
        out += [f"<{m['role']}>", *tokenize(m["content"]), "</>"]
    return [*out, "<assistant>"]


CONV = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": words(30, "u")},
    {"role": "assistant", "content": words(50, "a")},
    {"role": "user", "content": words(5, "v")},
    {"role": "assistant", "content": words(60, "b")},
    {"role": "user", "content": words(20, "w")},
    {"role": "assistant", "content": words(10, "c")},
]


@pytest.mark.parametrize("tokens", [40, 100, 150, 180])
def test_cut_to_context_fills_the_bucket_and_ends_on_a_user_turn(tokens):
    cut = longctx.cut_to_context(CONV, tokens, render, tokenize, detokenize)
    assert cut is not None
    messages, ids = cut
    assert tokens - 3 <= len(ids) <= tokens  # dropping a whole turn may leave its 2 tokens
    assert ids == render(messages)
    assert messages[0] == CONV[0]  # the system turn stays
    assert messages[-1]["role"] == "user"
    # The question is the first user turn whose history reaches the bucket.
    users = [i for i, m in enumerate(CONV) if m["role"] == "user"]
    reach = next(i for i in users if len(render(CONV[: i + 1])) >= tokens)
    assert messages[-1] == CONV[reach]
    # What is kept is the conversation's latest text: a suffix of it, cut inside its oldest turn.
    kept = " ".join(m["content"] for m in messages[1:])
    whole = " ".join(m["content"] for m in CONV[1 : reach + 1])
    assert whole.endswith(kept)


def test_a_conversation_shorter_than_the_bucket_gives_no_prompt():
    assert longctx.cut_to_context(CONV, 10_000, render, tokenize, detokenize) is None


def test_buckets_need_a_long_set_and_a_long_set_needs_buckets():
    with pytest.raises(ConfigError, match="sharegpt:long@heldout needs context_buckets"):
        check_buckets(["mt_bench", "sharegpt:long@heldout"], [])
    with pytest.raises(ConfigError, match="context_buckets: \\[1024\\] needs a long prompt set"):
        check_buckets(["mt_bench"], [1024])
    with pytest.raises(ConfigError, match="ascending"):
        check_buckets(["sharegpt:long@heldout"], [2048, 1024])
    check_buckets(["sharegpt:long@heldout"], [1024, 2048])


def chunk(cid: str, *turns: tuple[str, str]) -> dict:
    return {"id": cid, "conversations": [{"from": f, "value": v} for f, v in turns]}


def test_long_set_joins_the_chunks_of_a_split_conversation(tmp_path, monkeypatch):
    records = [
        chunk("a_0", ("human", "Tell me a long story about a lighthouse."), ("gpt", "Once.")),
        chunk("a_2", ("human", "Go on, please."), ("gpt", "Then.")),
        chunk("a_4", ("gpt", "And then, the end."), ("human", "Thanks!")),
        chunk("b_0", ("human", "Explain what a hash table is."), ("gpt", "A map.")),
        chunk("b_0", ("human", "Explain what a hash table is."), ("gpt", "Again.")),
    ]
    path = tmp_path / "corpus.json"
    path.write_text(json.dumps(records))
    monkeypatch.setattr(sharegpt, "corpus_path", lambda: path)
    skips = SkipLog()
    convs = load_conversations("sharegpt:long", skips=skips) + load_conversations(
        "sharegpt:long@heldout", skips=skips
    )
    by_id = {c.id: c for c in convs}
    assert set(by_id) == {"sharegpt:long:a", "sharegpt:long:b"}
    assert [m["content"] for m in by_id["sharegpt:long:a"].messages] == [
        "Tell me a long story about a lighthouse.", "Once.", "Go on, please.", "Then.",
        "And then, the end.", "Thanks!",
    ]  # fmt: skip
    # The same conversation twice (the corpus repeats ids): joined, not counted twice.
    assert len(by_id["sharegpt:long:b"].messages) == 4
    with pytest.raises(Exception, match="not a long ShareGPT spec"):
        load_conversations("sharegpt:long@test", skips=skips)


def eval_with_corpus(corpus, args: list[str]) -> subprocess.CompletedProcess:
    """``draftsmith eval`` (its main, argv as given) with the ShareGPT corpus at `corpus`."""
    code = (
        "import sys; from pathlib import Path; import draftsmith.conversations.sharegpt as s; "
        f"s.corpus_path = lambda: Path({str(corpus)!r}); "
        "from draftsmith.evaluate.main import main; sys.exit(main(sys.argv[1:]))"
    )
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "WANDB_MODE": "disabled"}
    return subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True,
                          text=True, timeout=900)  # fmt: skip


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """The first records of the bundled ShareGPT corpus (real long conversations)."""
    records = []
    for _, record in sharegpt.read_records(sharegpt.corpus_path()):
        records.append(record)
        if len(records) >= 120:
            break
    path = tmp_path_factory.mktemp("sharegpt") / "corpus.json"
    path.write_text(json.dumps(records))
    return path


@pytest.mark.vllm
def test_eval_reports_tokens_per_step_by_context_length(tmp_path, make_tiny_llama, corpus):
    from conftest import write_copy_eagle3_head

    target = make_tiny_llama(tmp_path / "tiny-long", max_position_embeddings=4096)
    head = write_copy_eagle3_head(tmp_path / "head", target)
    out = tmp_path / "eval"
    proc = eval_with_corpus(corpus, [
        f"--model={target}", f"--head={head}", "--datasets=[sharegpt:long]",
        "--context_buckets=[256,512]", "--limit=2", "--k=[2]", "--max_tokens=16",
        "--temperatures=[0.0]", "--baselines=[ngram]", "--lossless=false", "--concurrency=2",
        f"--output={out}", "--wandb=false",
    ])  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    buckets = {e["bucket"]: e for e in results["context_buckets"]}
    assert set(buckets) == {256, 512}
    for size, entry in buckets.items():
        assert entry["dataset"] == f"sharegpt:long/ctx{size}" and entry["prompts"] == 2
        assert size - 8 <= entry["prompt_tokens_min"] <= entry["prompt_tokens_max"] <= size
    runs = {(r["method"], r["context"]): r for r in results["runs"]}
    assert set(runs) == {(m, c) for m in ("eagle3", "ngram") for c in (256, 512)}
    for context in (256, 512):
        head_run = runs[("eagle3", context)]
        assert head_run["counters"]["num_drafts"] > 0 and head_run["tokens_per_step"] >= 1.0
        e = head_run["expected"]  # greedy: the replay must count what vLLM counted
        assert e["replayed_accepted_per_pos"] == head_run["counters"]["accepted_per_pos"]
        assert e["flag"] is None
    report = (out / "report.md").read_text()
    table = report[report.index("## By context length") :]
    for context in (256, 512):
        row = next(line for line in table.splitlines() if line.startswith(f"| {context} "))
        assert f"{runs[('eagle3', context)]['tokens_per_step']:.2f} (k=2)" in row
        assert f"{runs[('ngram', context)]['tokens_per_step']:.2f} (k=2)" in row
    assert (out / "tokens_per_step_by_context.png").stat().st_size > 10_000
    assert "tokens_per_step_by_context.png" in report


def test_the_replay_scores_the_reply_rows_only_and_counts_as_before():
    """Slicing the target's logits to the reply (bounded memory at long contexts) leaves
    the replay's counts what scoring every row gives."""
    import torch

    from draftsmith.evaluate.expected import Expected, acceptance, replay
    from draftsmith.evaluate.replay import replay_replies

    vocab, n = 11, 40
    gen = torch.Generator().manual_seed(0)
    table = torch.randn(n + 8, vocab, generator=gen) * 3

    class Target:  # row i of the logits depends on the position only
        def forward(self, tokens, layer_ids, keep=0):
            logits = table[: tokens.numel()]
            return (logits[-keep:] if keep else logits), torch.zeros(tokens.numel(), 1, 4)

        def continue_greedy(self, tokens, count):
            return torch.cat([tokens, torch.randint(vocab, (count,), generator=gen)])

    class Replica:
        layer_ids = [1]

        def draft_logits(self, tokens, states, k):
            for j in range(k):
                yield table[j + 1 : j + 1 + tokens.numel()] + 0.5 * j

    prompt = torch.randint(vocab, (25,), generator=gen).tolist()
    reply = torch.randint(vocab, (12,), generator=gen).tolist()
    got = replay_replies(Replica(), Target(), [prompt], [reply], 1.0, [3], greedy=False)[3]
    tokens = torch.tensor(prompt + reply)
    rows = tokens.numel()
    accept, posterior = torch.zeros(rows, 3), torch.zeros(rows, 3)
    for j, draft in enumerate(Replica().draft_logits(tokens, None, 3)):
        accept[:, j], posterior[:, j] = acceptance(table[:rows], draft, tokens, j,
                                                   1.0, False)  # fmt: skip
    want = Expected(accepted_per_pos=[0.0] * 3, expected_per_pos=[0.0] * 3)
    want.add(replay(accept, posterior, len(prompt) - 1, rows))
    assert got.num_drafts == pytest.approx(want.num_drafts) and want.num_drafts > 0
    assert got.expected_per_pos == pytest.approx(want.expected_per_pos)
    assert got.accepted_per_pos == pytest.approx(want.accepted_per_pos)


def test_by_context_table_flags_a_gap_and_the_plot_skips_simulated_rows(tmp_path):
    from draftsmith.evaluate.context import markdown_lines, plot_by_context

    def run(method, context, tps, k=3, **more):
        return {"method": method, "context": context, "k": k, "temperature": 0.0,
                "dataset": f"s/ctx{context}", "tokens_per_step": tps,
                "acceptance_length": tps, **more}  # fmt: skip

    gap = {"served_per_draft": 0.5, "expected_per_draft": 1.0, "relative_gap": -0.5,
           "flag": "gap"}  # fmt: skip
    same = {"served_per_draft": 1.0, "expected_per_draft": 1.0, "relative_gap": 0.0, "flag": None}
    results = {
        "context_buckets": [
            {"dataset": "s/ctx1024", "bucket": 1024, "tokens": 1024, "prompts": 4},
            {"dataset": "s/ctx8192", "bucket": 8192, "tokens": 8088, "prompts": 3},
        ],
        "runs": [
            run("eagle3", 1024, 2.0, expected=same),
            run("eagle3", 1024, 1.8, k=1, derived_from_k=3),  # derived: not the row shown
            run("eagle3", 8088, 1.5, expected=gap),
            run("ngram", 1024, 1.2),
            run("ngram", 8088, 1.1),
        ],
    }
    lines = "\n".join(markdown_lines(results, "eagle3"))
    assert "| 1,024 (1,024 bucket) | 4 | 2.00 (k=3) | 2.00 | +0.0% | 1.20 (k=3) |" in lines
    # Expected tokens per step: 1.5 x (1 + 1.0) / (1 + 0.5) = 2.0, the gap flagged.
    assert "| 8,088 (8,192 bucket) | 3 | 1.50 (k=3) | 2.00 | -50.0% (gap) | 1.10 (k=3) |" in lines
    assert "suffix" not in lines  # not measured: no column
    assert plot_by_context(results["runs"], "eagle3", "(test)", tmp_path / "p.png")
    simulated = [run("eagle3", 1024, None)]
    assert not plot_by_context(simulated, "eagle3", "(test)", tmp_path / "q.png")
    assert markdown_lines({"runs": results["runs"]}, "eagle3") == []  # no buckets: no section


def test_a_study_tabulates_each_points_head_by_context_beside_the_baselines():
    from draftsmith.evaluate.context import figures_by_context
    from draftsmith.pipelines.study import context_table

    def run(method, context, tps, temperature=0.0, **more):
        return {"method": method, "context": context, "k": 3, "temperature": temperature,
                "dataset": f"s/ctx{context}", "tokens_per_step": tps,
                "acceptance_length": tps, **more}  # fmt: skip

    same = {"served_per_draft": 0.5, "expected_per_draft": 0.5}
    buckets = [{"dataset": "s/ctx1024", "bucket": 1024, "tokens": 1024, "prompts": 3},
               {"dataset": "s/ctx8192", "bucket": 8192, "tokens": 7928, "prompts": 3}]  # fmt: skip
    short = {"context_buckets": buckets, "runs": [
        run("eagle3", 1024, 1.5, expected=same), run("eagle3", 7928, 1.2, expected=same),
        run("eagle3", 1024, 9.0, temperature=1.0),  # a sampled run: not the greedy table's
        run("ngram", 1024, 1.3), run("ngram", 7928, 1.4)]}  # fmt: skip
    less = {"served_per_draft": 0.2, "expected_per_draft": 0.5}  # served less than expected
    windowed = {"context_buckets": buckets, "runs": [
        run("eagle3", 1024, 1.5, expected=same),
        run("eagle3", 7928, 1.2, expected=less)]}  # fmt: skip
    rows = [{"point": "short", "by_context": figures_by_context(short, "eagle3")},
            {"point": "window", "by_context": figures_by_context(windowed, "eagle3")},
            {"point": "failed", "error": "boom"}]  # fmt: skip
    text = context_table(rows)
    assert "temperature 0.0, tokens per step" in text  # greedy: the sampled run is not shown
    assert "| point | 1,024 | 7,928 | last / first |" in text
    assert "| short | 1.500 (1.500) | 1.200 (1.200) | 0.800 |" in text
    # The window's expected: 1.2 x (1 + 0.5) / (1 + 0.2) = 1.5, where vLLM served 1.2.
    assert "| window | 1.500 (1.500) | 1.200 (1.500) | 0.800 |" in text
    assert "| ngram | 1.300 | 1.400 | 1.077 |" in text and "suffix" not in text
    assert context_table([{"point": "plain", "head_tokens_per_step": 1.2}]) == ""
