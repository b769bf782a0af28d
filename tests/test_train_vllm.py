"""Overfit in training, then measure in real vLLM: the head must do there what training said.

The target is a tiny random Llama with a sharpened final norm (near-deterministic next
tokens, like a real model's greedy text); its own greedy replies to 16 prompts are the data.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch

from draftsmith.cli import main as cli_main
from draftsmith.train.main import main as train_main

pytestmark = pytest.mark.vllm

K = 3
TOLERANCE = 0.1  # |simulated - vLLM| acceptance length; 0.03 (3.84 vs 3.82) before the walk


def evaluate(target: Path, head: Path, prompt_file: Path, out: Path, *extra: str) -> dict:
    """``draftsmith eval`` of ``head`` at k = K on the prompts; its results.json run."""
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
            f"--output={out}",
            *extra,
        ]
    )
    assert code == 0
    return json.loads((out / "results.json").read_text())["runs"][0]


@pytest.fixture(scope="module")
def overfit(tmp_path_factory, make_tiny_llama, make_hf_dataset) -> dict:
    """A head overfit on a near-deterministic tiny target's own replies, exported and
    measured in vLLM: its paths, training's simulated acceptance and vLLM's run."""
    tmp_path = tmp_path_factory.mktemp("overfit")
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
    run = evaluate(target, head, prompt_file, tmp_path / "eval")
    return {"target": target, "head": head, "prompts": prompt_file, "run": run,
            "simulated": simulated}  # fmt: skip


def test_overfit_head_reaches_k_plus_one_in_vllm(overfit):
    simulated, run = overfit["simulated"], overfit["run"]
    assert simulated > 3.5
    measured = run["acceptance_length"]
    assert measured > 3.4, run  # close to k + 1 = 4
    assert abs(measured - simulated) < TOLERANCE, (measured, simulated)


@pytest.mark.parametrize("layout", ["eagle", "speculators", "sglang", "trtllm"])
def test_converted_layouts_serve_as_the_original(overfit, layout, tmp_path):
    """The head written by ``draftsmith convert`` in another project's layout is served by
    vLLM as it is, drafting exactly what the original drafts; read back and written for
    vLLM, its tensors equal the original's."""
    from safetensors.torch import load_file

    converted = tmp_path / layout
    args = [f"--head={overfit['head']}", f"--model={overfit['target']}", f"--output={converted}"]
    assert cli_main(["convert", *args, f"--to={layout}"]) == 0
    run = evaluate(overfit["target"], converted, overfit["prompts"], tmp_path / "eval")
    assert run["counters"] == overfit["run"]["counters"], (layout, run["counters"])
    back = tmp_path / "back"
    assert cli_main(["convert", f"--head={converted}", f"--model={overfit['target']}",
                     "--to=vllm", f"--output={back}"]) == 0  # fmt: skip
    original, returned = (load_file(d / "model.safetensors") for d in (overfit["head"], back))
    assert original.keys() == returned.keys(), (layout, original.keys() ^ returned.keys())
    for key in original:
        torch.testing.assert_close(returned[key], original[key], rtol=0, atol=0, msg=key)
