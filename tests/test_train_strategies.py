"""FSDP and DeepSpeed over 2 CPU processes (gloo): fit, crash and resume, export.

Lightning starts the second process by re-running the command line, so every multi-process
run is ``python -m draftsmith.train`` in a subprocess (in-process it would re-run pytest).
All runs here use one thread per process, so the single-process reference does the same
arithmetic in the same order.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from safetensors.torch import load_file

from draftsmith.cli import main as cli_main
from draftsmith.train.checkpoints import read_checkpoint
from draftsmith.train.main import main as train_main
from draftsmith.train.strategies import CPUDeepSpeedStrategy, CPUFSDPStrategy, cpu_strategy

ROOT = Path(__file__).resolve().parents[1]
TINY_FSDP = ROOT / "configs" / "train" / "tiny-fsdp.yaml"
TINY = ROOT / "configs" / "train" / "tiny.yaml"
# 20 training samples pack into 10 rows of 256 tokens: an even number, so each process takes
# 5 rows an epoch and none is repeated to even them out; 2 validation rows, one per process.
# 2 epochs: 10 optimizer steps.
SPLIT = "--data.val_fraction=0.15"
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
NO_DEEPSPEED = "deepspeed is not installed (`pip install deepspeed`, or `make setup`)"


class RecordStrategy(Callback):
    """Writes ``<path>.<rank>``: the strategy class, whether the model is FSDP-wrapped, the world
    size and how many parameter elements this rank holds (sharded: about half of them)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_start(self, trainer, pl_module) -> None:
        from torch.distributed.fsdp import FullyShardedDataParallel

        record = {
            "strategy": type(trainer.strategy).__name__,
            "fsdp_wrapped": isinstance(trainer.strategy.model, FullyShardedDataParallel),
            "world_size": trainer.world_size,
            "local_numel": sum(p.numel() for p in trainer.strategy.model.parameters()),
        }
        Path(f"{self.path}.{trainer.global_rank}").write_text(json.dumps(record))


class SaveFullWeights(Callback):
    """At the end of fit, rank 0 saves the head's weights as the engine holds them (ZeRO-3:
    gathered from both ranks' partitions): the reference for the consolidated checkpoint."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_end(self, trainer, pl_module) -> None:
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(pl_module.head.parameters())):
            state = {k: v.detach().clone() for k, v in pl_module.head.state_dict().items()}
        if trainer.global_rank == 0:
            torch.save(state, self.path)


def train(config: Path, data: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    """``draftsmith train fit`` in a subprocess, one thread per process; helpers importable."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "tests"), env.get("PYTHONPATH")]))
    args = [
        "fit",
        f"--config={config}",
        f"--data.data={data}",
        SPLIT,
        f"--trainer.default_root_dir={out}",
        f"--checkpoint.dirpath={out / 'ckpt'}",
        *extra,
    ]
    cmd = [sys.executable, "-m", "draftsmith.train", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def check(run: subprocess.CompletedProcess, out: Path) -> None:
    log = (out / "train.log").read_text() if (out / "train.log").is_file() else ""
    assert run.returncode == 0, run.stderr[-3000:] + log[-3000:]


def head_tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    state = read_checkpoint(ckpt)["state_dict"]
    return {k: v for k, v in state.items() if k.startswith("head.")}


def export(ckpt: Path, out: Path) -> dict[str, torch.Tensor]:
    args = ["export", f"--checkpoint={ckpt}", f"--output={out}", "--dtype=float32"]
    assert cli_main(args) == 0
    return load_file(out / "model.safetensors")


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory, tiny_dataset) -> Path:
    """configs/train/tiny-fsdp.yaml, uninterrupted: 2 epochs, 10 steps, 2 CPU processes."""
    out = tmp_path_factory.mktemp("fsdp") / "run"
    record = [
        "--trainer.callbacks+=test_train_strategies.RecordStrategy",
        f"--trainer.callbacks.path={out / 'strategy.json'}",
    ]
    check(train(TINY_FSDP, tiny_dataset, out, *record), out)
    return out


def test_fsdp_on_two_processes_equals_one_process_and_exports(fsdp_run, tmp_path, tiny_dataset):
    """2 processes x 1 row, gradients averaged by FSDP == 1 process x 1 row, 2 accumulated.

    Both average the two rows' gradients, each the gradient of its row's token-mean loss
    (one process with batch 2 would weight rows by their token counts instead). With two
    ranks the average is exact in float32 (halving is exact), so the heads agree to the bit;
    the tolerance, 1e-6 absolute on weights of order 1e-1, leaves room only for summation
    order, e.g. a gloo build that reduces in another order.
    """
    single = tmp_path / "single"
    one = ["--data.batch_size=1", "--trainer.accumulate_grad_batches=2"]
    check(train(TINY, tiny_dataset, single, *one), single)
    sharded, whole = (read_checkpoint(d / "ckpt" / "last.ckpt") for d in (fsdp_run, single))

    ranks = [json.loads((fsdp_run / f"strategy.json.{r}").read_text()) for r in (0, 1)]
    for rank in ranks:
        assert rank["strategy"] == "CPUFSDPStrategy" and rank["fsdp_wrapped"], rank
        assert rank["world_size"] == 2
    weights = sum(v.numel() for k, v in whole["state_dict"].items() if k != "head.d2t")
    assert sum(r["local_numel"] for r in ranks) == weights  # each rank holds its shard only
    assert 0.4 < ranks[0]["local_numel"] / weights < 0.6
    assert sharded["global_step"] == whole["global_step"] == 10
    for key in ("val/loss", "val/acceptance_length"):  # summed over ranks == one process
        got, want = sharded["draftsmith"]["metrics"][key], whole["draftsmith"]["metrics"][key]
        assert got == pytest.approx(want, abs=1e-6), key

    exported = export(fsdp_run / "ckpt" / "last.ckpt", tmp_path / "fsdp-head")
    reference = export(single / "ckpt" / "last.ckpt", tmp_path / "single-head")
    assert set(exported) == set(reference) and "d2t" in exported
    for key, tensor in reference.items():
        torch.testing.assert_close(exported[key], tensor, rtol=0, atol=1e-6, msg=key)


def test_fsdp_killed_mid_epoch_resumes_to_the_same_weights(fsdp_run, tmp_path, tiny_dataset):
    """Crash at step 8 (a full ``last.ckpt`` at step 7, mid epoch 1), resume writing sharded
    checkpoints: the exported sharded ``last.ckpt`` equals the uninterrupted run's."""
    out = tmp_path / "crashed"
    every_step = ["--checkpoint.every_n_train_steps=1"]
    crash = ["--trainer.callbacks+=helpers.CrashAtStep", "--trainer.callbacks.step=8"]
    run = train(TINY_FSDP, tiny_dataset, out, *every_step, *crash)
    assert run.returncode != 0 and "simulated crash at step 8" in (out / "train.log").read_text()
    last = out / "ckpt" / "last.ckpt"
    state = torch.load(last, map_location="cpu", weights_only=False)
    assert state["global_step"] == 7 and state["epoch"] == 1  # FSDP's full state dict: a file

    sharded = [
        "--trainer.strategy=draftsmith.train.strategies.CPUFSDPStrategy",
        "--trainer.strategy.state_dict_type=sharded",
    ]
    check(train(TINY_FSDP, tiny_dataset, out, *every_step, *sharded, f"--ckpt_path={last}"), out)
    assert (last / "meta.pt").is_file()  # now a directory of per-rank shards
    resumed, whole = head_tensors(last), head_tensors(fsdp_run / "ckpt" / "last.ckpt")
    assert set(resumed) == set(whole)
    for key, tensor in whole.items():
        torch.testing.assert_close(resumed[key], tensor, rtol=0, atol=0, msg=key)
    assert set(export(last, tmp_path / "head")) >= {"fc.weight", "lm_head.weight", "d2t"}


@pytest.mark.skipif(not HAS_DEEPSPEED, reason=NO_DEEPSPEED)
@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_zero_checkpoint_exports_the_engine_weights(stage, tmp_path, tiny_dataset):
    """ZeRO-2/3 on 2 CPU processes writes its checkpoint directory with DeepSpeed's own
    ``engine.save_checkpoint`` (optimizer states partitioned; ZeRO-3: weights too);
    ``draftsmith export`` consolidates it into exactly the weights the engine held."""
    out = tmp_path / f"zero{stage}"
    reference = tmp_path / "engine-weights.pt"
    extra = [
        "--trainer.strategy=draftsmith.train.strategies.CPUDeepSpeedStrategy",
        f"--trainer.strategy.stage={stage}",
        "--trainer.max_steps=3",
        "--trainer.callbacks+=test_train_strategies.SaveFullWeights",
        f"--trainer.callbacks.path={reference}",
    ]
    check(train(TINY_FSDP, tiny_dataset, out, *extra), out)
    last = out / "ckpt" / "last.ckpt"
    shards = sorted(p.name for p in (last / "checkpoint").iterdir())
    assert "zero_pp_rank_1_mp_rank_00_optim_states.pt" in shards, shards
    if stage == 3:
        assert "zero_pp_rank_1_mp_rank_00_model_states.pt" in shards, shards

    engine = torch.load(reference, weights_only=False)
    exported = export(last, tmp_path / "head")
    assert set(exported) == set(engine)  # every weight vLLM loads, d2t included
    for key, tensor in engine.items():
        torch.testing.assert_close(exported[key], tensor, rtol=0, atol=0, msg=key)
    assert read_checkpoint(last)["global_step"] == 3


def test_gpu_only_strategies_get_their_cpu_stand_ins(tmp_path, tiny_dataset, capfd):
    assert isinstance(cpu_strategy("fsdp", "cpu"), CPUFSDPStrategy)
    if HAS_DEEPSPEED:  # (Lightning refuses to build a DeepSpeed strategy without it)
        assert isinstance(cpu_strategy("deepspeed", "cpu"), CPUDeepSpeedStrategy)
    assert cpu_strategy("fsdp", "gpu") is None and cpu_strategy("ddp", "cpu") is None
    args = [
        "fit",
        f"--config={TINY}",
        f"--data.data={tiny_dataset}",
        f"--trainer.default_root_dir={tmp_path}",
        "--trainer.strategy=lightning.pytorch.strategies.DeepSpeedStrategy",
        "--trainer.strategy.stage=3",
    ]
    capfd.readouterr()
    assert train_main(args) == 2
    err = capfd.readouterr().err
    assert "trainer.strategy: lightning.pytorch.strategies.DeepSpeedStrategy runs on CUDA" in err
    assert "draftsmith.train.strategies.CPUDeepSpeedStrategy" in err


@pytest.mark.vllm
def test_fsdp_head_is_served_by_vllm(fsdp_run, tmp_path, tiny_model_dir):
    """The head FSDP trained, exported, loads and drafts in vLLM. (One engine: it equals the
    single-process head to the bit, and exports like it are checked lossless elsewhere.)"""
    head = tmp_path / "head"
    ckpt = fsdp_run / "ckpt" / "last.ckpt"
    assert cli_main(["export", f"--checkpoint={ckpt}", f"--output={head}", "--dtype=float32"]) == 0
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Name {n} animals."}) + "\n" for n in "234"))
    out = tmp_path / "eval"
    args = [f"--model={tiny_model_dir}", f"--head={head}", f"--datasets=[{prompts}]", "--k=[3]"]
    args += ["--baselines=[]", "--lossless=false", "--max_tokens=16", "--concurrency=3"]
    args += ["--temperatures=[0.0]"]
    args += [f"--output={out}"]
    cmd = [sys.executable, "-m", "draftsmith.evaluate", *args, "--wandb=false"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = json.loads((out / "results.json").read_text())["runs"]
    (served,) = [r for r in runs if r["method"] == "eagle3"]
    c = served["counters"]
    assert c["num_drafts"] > 0 and c["num_draft_tokens"] == 3 * c["num_drafts"]
