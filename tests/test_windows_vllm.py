"""A sliding-window EAGLE-3 head at long context: what training simulates is what vLLM serves.

A tiny Qwen3 target answers prompts of 1.0-1.5k tokens; a head with a 32-token window
(started from the target's last layer, so it drafts well from the first step) trains briefly,
is exported as vLLM's ``Eagle3Qwen3ForCausalLM`` and served by ``draftsmith eval``: its
acceptance length equals training's simulated walk and eval's torch replica of the windowed
head (expected). At this scale the window does not move the acceptance (the same weights
without it walked the same, 2026-11-29), so this checks that vLLM serves the exported Qwen3
head as trained, not that the window was applied; ``test_windows.py`` checks the fields.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from helpers import serve_head

from draftsmith.cli import main as cli_main
from draftsmith.train.main import main as train_main

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[1]
WINDOW = 32


def long_prompt(i: int) -> str:
    facts = " ".join(f"Item {j} of list {i} weighs {(i * 7 + j) % 13} grams." for j in
                     range(70 + 12 * i))  # fmt: skip
    return f"{facts}\nWrite a short note about list {i}."


def simulated(config: Path, ckpt: Path, out: Path, *extra: str) -> float:
    """``draftsmith train validate`` of ``ckpt`` on every sample: the simulated acceptance."""
    args = ["validate", f"--config={config}", "--data.val_fraction=1.0", f"--ckpt_path={ckpt}",
            "--trainer.logger=lightning.pytorch.loggers.CSVLogger",
            f"--trainer.logger.save_dir={out}", *extra]  # fmt: skip
    assert train_main(args) == 0
    rows = list(csv.DictReader((out / "lightning_logs" / "version_0" / "metrics.csv").open()))
    return float(rows[-1]["val/acceptance_length"])


def test_windowed_head_serves_as_simulated_at_long_context(
    tmp_path, make_tiny_target, make_hf_dataset
) -> None:
    target = make_tiny_target(tmp_path / "qwen3", "qwen3", seed=1, norm_scale=8.0)
    prompts = [long_prompt(i) for i in range(4)]
    data = make_hf_dataset(tmp_path / "data", target, prompts, max_new_tokens=48,
                           layer_ids=(2, 4, 7, 8))  # fmt: skip
    lengths = json.loads((data / "manifest.json").read_text())["num_tokens"] / len(prompts)
    assert 1000 < lengths < 2000
    config = ROOT / "configs" / "train" / "tiny.yaml"
    common = [f"--data.data={data}", "--data.row_tokens=2048", "--data.batch_size=1",
              f"--model.sliding_window={WINDOW}", "--model.init_from_target=true",
              "--model.lr=1e-3"]  # fmt: skip
    run = tmp_path / "run"
    assert train_main(["fit", f"--config={config}", *common, "--data.val_fraction=0",
                       "--trainer.max_steps=4", "--checkpoint.monitor=null",
                       f"--trainer.default_root_dir={run}",
                       f"--checkpoint.dirpath={run / 'ckpt'}"]) == 0  # fmt: skip
    ckpt = run / "ckpt" / "last.ckpt"
    windowed = simulated(config, ckpt, tmp_path / "val", *common)
    head = tmp_path / "head"
    assert cli_main(["export", f"--checkpoint={ckpt}", f"--output={head}", "--dtype=float32"]) == 0
    written = json.loads((head / "config.json").read_text())
    assert written["architectures"] == ["Eagle3Qwen3ForCausalLM"]
    assert written["sliding_window"] == WINDOW
    run_row = serve_head(target, head, prompts, tmp_path, "eagle3")
    served, expected = run_row["acceptance_length"], run_row["expected"]
    print(f"\nserved {served:.4f}, simulated {windowed:.4f}; "
          f"accepted per draft served {expected['served_per_draft']:.4f}, expected "
          f"{expected['expected_per_draft']:.4f}")  # fmt: skip
    assert windowed > 1.5
    assert abs(served - windowed) <= 0.03 * served, (served, windowed)
    assert expected["replayed_drafts"] == run_row["counters"]["num_drafts"], expected
    assert expected["flag"] is None, expected  # within 5% of the windowed replica
