"""The scaling curve of a study (draftsmith/pipelines/curve.py): tokens, fit, crossings, plot."""

from __future__ import annotations

import math

import pytest
import yaml

from draftsmith.dataset import open_dataset
from draftsmith.pipelines import curve
from draftsmith.train.data import train_tokens
from draftsmith.train.packing import split_samples


def test_fit_recovers_a_log_law_and_solves_for_a_baseline():
    xs = [6_000.0, 12_000.0, 25_000.0, 51_000.0]
    ys = [1.1 + 0.05 * math.log(x) for x in xs]
    a, b = curve.fit_log(xs, ys)
    assert a == pytest.approx(1.1) and b == pytest.approx(0.05)
    assert curve.crossing(a, b, 1.1 + 0.05 * math.log(1e6)) == pytest.approx(1e6)
    assert curve.crossing(1.3, -0.01, 1.5) is None  # a falling fit never gets there
    with pytest.raises(ValueError, match="two distinct"):
        curve.fit_log([5.0, 5.0], [1.0, 2.0])


def test_summary_names_each_baseline_and_the_extrapolation(tmp_path):
    rows = [
        {"point": f"n{x}", "train_tokens": x, "head_tokens_per_step": 1.0 + 0.1 * math.log2(x)}
        for x in (1_000, 2_000, 4_000)
    ]
    rows[-1]["ngram_tokens_per_step"] = 2.3  # 0.1 per doubling: reached at 2^13 = 8,192
    rows.append({"point": "failed", "error": "boom"})  # rows without figures are left out
    text, fit = curve.summary(rows, k=3)
    assert fit["b"] == pytest.approx(0.1 / math.log(2))
    assert fit["crossings"]["ngram"] == pytest.approx(8_192)
    assert "+0.1000 per doubling" in text and "2x the largest point, an extrapolation" in text
    curve.plot(rows, fit, tmp_path / "curve.png", 3)
    assert (tmp_path / "curve.png").stat().st_size > 1000
    assert curve.summary(rows[:1], 3)[1] is None  # one point: no fit


def test_train_tokens_count_the_samples_that_trained(tmp_path, tiny_dataset):
    """The tokens of the first N training samples after the validation split."""
    stage = tmp_path / "train-x"
    stage.mkdir()
    data = {"data": str(tiny_dataset), "val_fraction": 0.25, "max_train_samples": 5, "seed": 3}
    (stage / "stage.yaml").write_text(yaml.safe_dump({"data": data}))
    lengths = open_dataset(tiny_dataset).lengths
    train, _ = split_samples(len(lengths), 0.25, 3)
    assert train_tokens(stage) == sum(lengths[i] for i in train[:5])
    data.pop("max_train_samples")
    (stage / "stage.yaml").write_text(yaml.safe_dump({"data": data}))
    assert train_tokens(stage) == sum(lengths[i] for i in train)
