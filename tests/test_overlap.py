"""The overlap guard: evaluation prompts found in training data are refused before vLLM runs."""

from __future__ import annotations

from draftsmith.conversations.sources import SkipLog, load_many
from draftsmith.evaluate.main import main
from draftsmith.evaluate.overlap import find_overlap, ngram_hashes

PROMPT = (
    "Compose an engaging travel blog post about a recent trip to Hawaii, highlighting "
    "cultural experiences and must-see attractions."
)


def test_ngram_hashes_windows_and_short_inputs():
    assert ngram_hashes([1, 2, 3, 4], 2).size == 3
    assert ngram_hashes([1, 2], 8).size == 1  # a short prompt is one n-gram
    assert ngram_hashes([1, 2], 8)[0] != ngram_hashes([2, 1], 8)[0]
    assert ngram_hashes([5, 6, 7], 2)[1] == ngram_hashes([0, 6, 7], 2)[1]


def test_exact_and_near_duplicates_are_caught_unrelated_are_not(tokenizer):
    enc = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    eval_prompts = {
        "set": [
            ("a", enc(PROMPT)),
            ("b", enc("Write a Python function that returns the n-th Fibonacci number.")),
            ("c", enc("Explain photosynthesis to a ten year old in three sentences.")),
        ]
    }
    near = PROMPT.replace("must-see", "unmissable")  # one word: 11 of its 16 8-grams survive
    train = [
        ("t0", enc("System prompt.\nuser\n" + PROMPT + "\nassistant\nAloha! Here is my post.")),
        ("t1", enc(near)),
        ("t2", enc("Write a Python function that sorts a list of numbers in place.")),
    ]
    matches, scores = find_overlap(eval_prompts, train, ngram=8, threshold=0.5)
    assert [(m.eval_id, m.train_id, m.containment) for m in matches] == [("a", "t0", 1.0)]
    matches, _ = find_overlap(eval_prompts, train[1:], ngram=8, threshold=0.5)
    assert [(m.eval_id, m.train_id) for m in matches] == [("a", "t1")]  # near duplicate
    assert 0.5 <= matches[0].containment < 1.0
    assert scores["set"][2] == 0.0 and scores["set"][1] < 0.5


def test_eval_refuses_a_planted_mt_bench_prompt(
    capsys, tmp_path, tiny_model_dir, tiny_eagle3_head, make_hf_dataset
):
    """A training set holding one MT-Bench prompt: eval exits 2 naming dataset, row and sample,
    before any engine starts."""
    rows = load_many(["mt_bench"], require_assistant=False, skips=SkipLog(), limit=3)
    planted = rows[2].messages[0]["content"]
    data = make_hf_dataset(
        tmp_path / "data", tiny_model_dir, ["Say hello.", planted], max_new_tokens=2
    )
    code = main(
        [
            f"--model={tiny_model_dir}",
            f"--head={tiny_eagle3_head}",
            "--datasets=[mt_bench]",
            "--limit=3",
            f"--train_data={data}",
            "--wandb=false",
            f"--output={tmp_path / 'eval'}",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2
    assert "1 evaluation prompt(s) overlap" in err and "mt_bench row 2" in err and "p1" in err
    assert not (tmp_path / "eval" / "results.json").exists()
