"""The train stage end to end on CPU: LightningCLI, checkpoints, resume, export, errors."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from draftsmith.cli import main as cli_main
from draftsmith.train.checkpoints import CheckpointError, read_checkpoint
from draftsmith.train.data import StatesDataModule
from draftsmith.train.main import main as train_main

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "train" / "tiny.yaml"


def fit_args(data: Path, out: Path, *extra: str) -> list[str]:
    return [
        "fit",
        f"--config={TINY}",
        f"--data.data={data}",
        f"--trainer.default_root_dir={out}",
        f"--checkpoint.dirpath={out / 'ckpt'}",
        *extra,
    ]


def head_state(ckpt: Path) -> dict[str, torch.Tensor]:
    state = torch.load(ckpt, map_location="cpu", weights_only=False)["state_dict"]
    return {k: v for k, v in state.items() if k.startswith("head.")}


def test_fit_validates_checkpoints_and_exports(tmp_path, tiny_dataset, tiny_model_dir):
    out = tmp_path / "run"
    train_main(
        fit_args(
            tiny_dataset,
            out,
            "--trainer.max_epochs=3",
            "--trainer.logger=lightning.pytorch.loggers.CSVLogger",
            f"--trainer.logger.save_dir={out}",
        )
    )
    assert (out / "ckpt" / "best.ckpt").is_file() and (out / "ckpt" / "last.ckpt").is_file()
    ckpt = read_checkpoint(out / "ckpt" / "last.ckpt")
    info = ckpt["draftsmith"]
    assert info["kind"] == "eagle3" and info["layer_ids"] == [2, 4, 5]
    assert info["target"] == str(tiny_model_dir) and info["data"]["val_samples"] == 6
    assert ckpt["hyper_parameters"]["ttt_steps"] == 3

    # Metrics: per-step loss/accuracy, simulated acceptance per k, lr, tokens/s; loss falls.
    rows = (out / "lightning_logs" / "version_0" / "metrics.csv").read_text().splitlines()
    header = rows[0].split(",")
    for key in [
        "train/loss_2",
        "train/acc_0",
        "train/lr",
        "train/tokens_per_s",
        "val/acceptance_length",
        "val/acceptance_length_k1",
        "val/acc_2",
    ]:
        assert key in header, key
    col = header.index("val/loss")
    val = [float(r.split(",")[col]) for r in rows[1:] if r.split(",")[col]]
    assert len(val) == 3 and val[-1] < val[0]
    al = info["metrics"]["val/acceptance_length"]
    assert 1.0 <= al <= 4.0 and info["metrics"]["val/acceptance_length_k1"] <= al

    # Export: vLLM's keys and config, draft vocab from the data with EOS kept.
    head_dir = tmp_path / "head"
    assert (
        cli_main(["export", f"--checkpoint={out / 'ckpt' / 'best.ckpt'}", f"--output={head_dir}"])
        == 0
    )
    config = json.loads((head_dir / "config.json").read_text())
    assert config["architectures"] == ["Eagle3LlamaForCausalLM"]
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert config["draft_vocab_size"] == 2048
    tensors = load_file(head_dir / "model.safetensors")
    d2t = tensors["d2t"]
    target_ids = d2t + torch.arange(d2t.numel())
    eos = json.loads((tiny_model_dir / "config.json").read_text())["eos_token_id"]
    assert eos in target_ids.tolist() and tensors["lm_head.weight"].dtype == torch.bfloat16
    card = (head_dir / "README.md").read_text()
    assert "val/acceptance_length" in card and str(tiny_dataset) in card


def test_lr_schedule_warms_up_then_anneals_by_steps_or_time():
    from draftsmith.train.schedule import lr_factor

    assert lr_factor(0, 2, 10, 0.1) == pytest.approx(1 / 3)  # warm-up
    assert lr_factor(2, 2, 10, 0.1) == pytest.approx(1.0)
    assert lr_factor(6, 2, 10, 0.1) == pytest.approx(0.55)  # half way down the cosine
    assert lr_factor(10, 2, 10, 0.1) == pytest.approx(0.1)
    assert lr_factor(3, 2, 10, 0.1, time_done=1.0) == pytest.approx(0.1)  # the cap is near
    assert lr_factor(6, 2, 10, 0.1, time_done=0.2) == pytest.approx(0.55)  # steps lead


def test_a_fit_stopped_by_its_time_cap_ends_annealed(tmp_path, tiny_dataset):
    out = tmp_path / "run"
    train_main(
        fit_args(
            tiny_dataset,
            out,
            "--trainer.max_epochs=100000",  # by steps the cosine would barely have started
            "--trainer.max_time=00:00:00:08",
            "--model.warmup_steps=0",
            "--trainer.log_every_n_steps=1",
            "--trainer.logger=lightning.pytorch.loggers.CSVLogger",
            f"--trainer.logger.save_dir={out}",
        )
    )
    rows = (out / "lightning_logs" / "version_0" / "metrics.csv").read_text().splitlines()
    col = rows[0].split(",").index("train/lr")
    lrs = [float(r.split(",")[col]) for r in rows[1:] if r.split(",")[col]]
    assert len(lrs) >= 3 and lrs[0] > 0.9 * 3e-3  # tiny.yaml's peak
    assert lrs[-1] < 0.5 * 3e-3 and lrs == sorted(lrs, reverse=True)  # down towards 3e-4


def test_print_config_shows_overrides(tmp_path, tiny_dataset, capsys):
    with pytest.raises(SystemExit) as exit_:
        train_main([*fit_args(tiny_dataset, tmp_path), "--model.ttt_steps=5", "--print_config"])
    assert exit_.value.code == 0
    printed = capsys.readouterr().out
    assert "ttt_steps: 5" in printed and "monitor: val/acceptance_length" in printed


def test_killed_mid_epoch_resumes_to_the_same_weights(tmp_path, tiny_dataset):
    """Checkpoint every step, crash 2 steps into epoch 1, resume: same as never stopped."""
    common = ["--trainer.max_epochs=2", "--checkpoint.every_n_train_steps=1", "--data.batch_size=1"]
    train_main(fit_args(tiny_dataset, tmp_path / "whole", *common))
    per_epoch = torch.load(tmp_path / "whole" / "ckpt" / "last.ckpt", weights_only=False)
    per_epoch = per_epoch["global_step"] // 2
    assert per_epoch >= 3
    crashed = tmp_path / "crashed"
    crash = [
        "--trainer.callbacks+=helpers.CrashAtStep",
        f"--trainer.callbacks.step={per_epoch + 2}",
    ]
    with pytest.raises(RuntimeError, match="simulated crash"):
        train_main(fit_args(tiny_dataset, crashed, *common, *crash))
    last = torch.load(crashed / "ckpt" / "last.ckpt", weights_only=False)
    assert last["global_step"] == per_epoch + 1 and last["epoch"] == 1  # mid-epoch
    resume = f"--ckpt_path={crashed / 'ckpt' / 'last.ckpt'}"
    train_main(fit_args(tiny_dataset, crashed, *common, resume))
    whole, resumed = (head_state(d / "ckpt" / "last.ckpt") for d in (tmp_path / "whole", crashed))
    for key in whole:
        torch.testing.assert_close(resumed[key], whole[key], rtol=0, atol=0, msg=key)


def test_eagle1_head_trains_and_exports(tmp_path, tiny_dataset):
    out = tmp_path / "e1"
    train_main(
        fit_args(
            tiny_dataset,
            out,
            "--model.kind=eagle",
            "--data.aux_layers=[8]",
            "--trainer.max_epochs=1",
        )
    )
    assert (
        cli_main(
            [
                "export",
                f"--checkpoint={out / 'ckpt' / 'last.ckpt'}",
                f"--output={tmp_path / 'head'}",
            ]
        )
        == 0
    )
    config = json.loads((tmp_path / "head" / "config.json").read_text())
    assert config["architectures"] == ["EagleLlamaForCausalLM"]
    assert "lm_head.weight" not in load_file(tmp_path / "head" / "model.safetensors")


def test_ddp_on_cpu_with_two_processes_splits_the_rows(tmp_path, tiny_dataset):
    out = tmp_path / "ddp"
    args = fit_args(
        tiny_dataset,
        out,
        "--trainer.max_epochs=1",
        "--trainer.strategy=ddp",
        "--trainer.devices=2",
        "--data.batch_size=1",
    )
    run = subprocess.run(
        [sys.executable, "-m", "draftsmith.train", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    log = (out / "train.log").read_text()  # Lightning's own lines: the quiet console's log
    assert run.returncode == 0, run.stderr[-3000:] + log[-3000:]
    assert "distributed_backend=gloo" in log and "distributed_backend" not in run.stderr
    assert "train: " in run.stdout  # the closing line reaches the terminal
    ckpt = torch.load(out / "ckpt" / "last.ckpt", weights_only=False)
    # 18 training samples packed into rows of 256 tokens; each rank takes half the rows.
    loader_state = ckpt["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]
    assert loader_state == {"epoch": 0, "batches_done": ckpt["global_step"]}
    data = yaml.safe_load(TINY.read_text())["data"]
    dm = StatesDataModule(**{**data, "data": str(tiny_dataset), "batch_size": 1})
    rows = dm.num_train_batches()  # one process, batch 1: one step per packed row
    assert rows >= 2 and ckpt["global_step"] == -(-rows // 2)


def test_wandb_logger_runs_offline(tmp_path, tiny_dataset, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc key
    out = tmp_path / "wb"
    train_main(
        fit_args(
            tiny_dataset,
            out,
            "--trainer.max_epochs=1",
            "--trainer.logger=lightning.pytorch.loggers.WandbLogger",
            f"--trainer.logger.save_dir={out}",
            "--trainer.logger.project=t",
        )
    )
    runs = list((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))


def test_bad_configs_say_what_to_fix(tmp_path, tiny_dataset, make_tiny_llama, capfd):
    other = make_tiny_llama(tmp_path / "other", hidden_size=64)
    cases = {  # arguments -> what the one line on stderr says
        "a": ([], "data.data: .*missing is not a directory.*draftsmith extract"),
        "b": (["--trainer.strategy=dpp"], "trainer.strategy: unknown strategy 'dpp'"),
        "c": ([f"--model.target={tmp_path / 'nope'}"], "model: .*nope.* does not exist"),
        "d": ([f"--model.target={other}"], "hidden_size 128 \\(dataset\\) != 64 \\(target\\)"),
        "e": (["--model.draft_vocab_size=0"], "model.draft_vocab_size: 0"),
        "f": (["--model.kind=eagle9"], "model.kind: 'eagle9' is not a choice; use one of \\["),
    }
    for name, (extra, expected) in cases.items():
        data = tmp_path / "missing" if name == "a" else tiny_dataset
        capfd.readouterr()
        assert train_main(fit_args(data, tmp_path / name, *extra)) == 2, name
        err = capfd.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("draftsmith train: error: "), (name, err)
        assert re.search(expected, err[0]), (name, err[0])
    with pytest.raises(CheckpointError, match="does not exist"):
        read_checkpoint(tmp_path / "none.ckpt")


@pytest.fixture(scope="module")
def one_epoch(tmp_path_factory, tiny_dataset) -> Path:
    """A finished one-epoch run of the tiny recipe: its ``ckpt/last.ckpt`` to resume."""
    out = tmp_path_factory.mktemp("resume") / "run"
    train_main(fit_args(tiny_dataset, out, "--trainer.max_epochs=1"))
    return out / "ckpt" / "last.ckpt"


@pytest.mark.parametrize(
    ("option", "named"),
    [
        ("--model.kind=dflash", "model.kind='eagle3', this run says 'dflash'"),
        ("--model.ttt_steps=5", "model.ttt_steps=3, this run says 5"),
        ("--model.draft_vocab_size=1024", "model.draft_vocab_size=2048, this run says 1024"),
    ],
)
def test_a_resume_refuses_an_option_that_changes_what_is_trained(
    one_epoch, tiny_dataset, tmp_path, capsys, option, named
):
    args = fit_args(tiny_dataset, tmp_path, "--trainer.max_epochs=2", option)
    code = cli_main(["train", *args, f"--ckpt_path={one_epoch}"])
    lines = [x for x in capsys.readouterr().err.splitlines() if not x.startswith("INFO:")]
    assert code == 2 and len(lines) == 1 and named in lines[0], lines
    assert "--ckpt_path" in lines[0] and not (tmp_path / "ckpt").exists()


def test_a_resume_applies_a_new_learning_rate_and_says_so(
    one_epoch, tiny_dataset, tmp_path, capsys
):
    args = fit_args(tiny_dataset, tmp_path, "--trainer.max_epochs=2", "--model.lr=1e-3")
    assert cli_main(["train", *args, f"--ckpt_path={one_epoch}"]) == 0
    resumed = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=False)
    assert resumed["lr_schedulers"][0]["base_lrs"] == [1e-3]  # not the checkpoint's 3e-3
    assert resumed["optimizer_states"][0]["param_groups"][0]["initial_lr"] == 1e-3
    from draftsmith.train.resume import apply_changes

    saved = torch.load(one_epoch, weights_only=False)
    said = apply_changes(
        saved, saved["hyper_parameters"], {**saved["hyper_parameters"], "lr": 1e-3}
    )
    assert said == "resuming with model.lr 0.003 -> 0.001 (applied from this step on)"


def test_init_from_a_target_says_what_it_is(tiny_dataset, tiny_model_dir, tmp_path, capsys):
    args = fit_args(tiny_dataset, tmp_path, f"--model.init_from={tiny_model_dir}")
    assert cli_main(["train", *args]) == 2
    err = capsys.readouterr().err
    assert "is a model with 8 decoder layers (LlamaForCausalLM), not a draft head" in err
    assert "fc 2H" not in err


def test_a_resume_may_change_how_a_step_is_computed():
    """The attention path, compile, the fused loss and the loss chunk may differ from the
    checkpoint's (or be missing from an older one): they change how, not what, is trained."""
    from draftsmith.core.errors import ConfigError
    from draftsmith.train.resume import check_resume

    saved = {"kind": "eagle3", "ttt_steps": 3, "loss_chunk_size": 1024}  # older: no new keys
    ours = {**saved, "loss_chunk_size": 256, "attention": "flex", "compile": "on",
            "fused_loss": "on"}  # fmt: skip
    check_resume(saved, ours, {}, {})  # no error
    with pytest.raises(ConfigError, match="model.ttt_steps=3, this run says 7"):
        check_resume(saved, {**ours, "ttt_steps": 7}, {}, {})
