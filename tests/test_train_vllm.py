"""Overfit in training, then measure in real vLLM: the head must do there what training said.

The target is a tiny random Llama with a sharpened final norm (near-deterministic next
tokens, like a real model's greedy text); its own greedy replies to 16 prompts are the data.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from draftsmith.cli import main as cli_main
from draftsmith.train.main import main as train_main

pytestmark = pytest.mark.vllm

K = 3
TOLERANCE = 0.1  # |simulated - vLLM| acceptance length; 0.03 (3.84 vs 3.82) before the walk


def test_overfit_head_reaches_k_plus_one_in_vllm(tmp_path, make_tiny_llama, make_hf_dataset):
    target = make_tiny_llama(tmp_path / "peaked", seed=1, norm_scale=8.0)
    prompts = [f"Write a short note about topic number {i}." for i in range(16)]
    data = make_hf_dataset(tmp_path / "data", target, prompts, max_new_tokens=48)
    tiny = Path(__file__).resolve().parents[1] / "configs" / "train" / "tiny.yaml"
    common = [f"--config={tiny}", f"--data.data={data}", f"--model.ttt_steps={K}"]
    out = tmp_path / "run"
    train_main(
        [
            "fit",
            *common,
            "--trainer.max_epochs=60",
            "--data.val_fraction=0",
            "--checkpoint.monitor=null",
            f"--trainer.default_root_dir={out}",
            f"--checkpoint.dirpath={out / 'ckpt'}",
        ]
    )
    # Simulated acceptance on the training prompts themselves.
    train_main(
        [
            "validate",
            *common,
            "--data.val_fraction=1.0",
            f"--ckpt_path={out / 'ckpt' / 'last.ckpt'}",
            "--trainer.logger=lightning.pytorch.loggers.CSVLogger",
            f"--trainer.logger.save_dir={out}",
        ]
    )
    rows = list(csv.DictReader((out / "lightning_logs" / "version_0" / "metrics.csv").open()))
    simulated = float(rows[-1]["val/acceptance_length"])
    assert simulated > 3.5

    head = tmp_path / "head"
    assert (
        cli_main(
            [
                "export",
                f"--checkpoint={out / 'ckpt' / 'last.ckpt'}",
                f"--output={head}",
                "--dtype=float32",
            ]
        )
        == 0
    )
    prompt_file = tmp_path / "prompts.jsonl"
    prompt_file.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    code = cli_main(
        [
            "eval",
            f"--model={target}",
            f"--head={head}",
            f"--k=[{K}]",
            f"--datasets=[{prompt_file}]",
            "--max_tokens=48",
            "--concurrency=16",
            "--baselines=[]",
            "--lossless=false",
            "--wandb=false",
            f"--output={tmp_path / 'eval'}",
        ]
    )
    assert code == 0
    run = json.loads((tmp_path / "eval" / "results.json").read_text())["runs"][0]
    measured = run["acceptance_length"]
    assert measured > 3.4, run  # close to k + 1 = 4
    assert abs(measured - simulated) < TOLERANCE, (measured, simulated)
