"""Small test utilities shared by several test modules (imported as `helpers`)."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from torch.utils._python_dispatch import TorchDispatchMode


class LargestTensor(TorchDispatchMode):
    """Records the element count of the largest tensor any op produces inside the block."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


class CrashAtStep(Callback):
    """Raises in ``on_train_batch_end`` once ``global_step == step`` (before that step's
    checkpoint is written): a run killed mid-epoch."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_step == self.step:
            raise RuntimeError(f"simulated crash at step {self.step}")


def fit_then_validate(section: dict, tmp_path) -> tuple:
    """Train the train-stage ``section`` (a dict of a train YAML) with its checkpoints under
    ``tmp_path/ckpt``, then validate ``last.ckpt`` on the whole dataset; returns (the
    checkpoint path, the simulated acceptance length validation logged)."""
    import csv

    import yaml

    from draftsmith.train.main import main as train_main

    section["checkpoint"] = {"dirpath": str(tmp_path / "ckpt"), "monitor": None}
    section["trainer"]["default_root_dir"] = str(tmp_path / "run")
    config = tmp_path / "train.yaml"
    config.write_text(yaml.safe_dump(section))
    assert train_main(["fit", f"--config={config}"]) == 0
    ckpt = tmp_path / "ckpt" / "last.ckpt"
    logs = tmp_path / "val"
    validate = [f"--config={config}", "--data.val_fraction=1.0", f"--ckpt_path={ckpt}"]
    csv_logger = "--trainer.logger=lightning.pytorch.loggers.CSVLogger"
    assert train_main(["validate", *validate, csv_logger, f"--trainer.logger.save_dir={logs}"]) == 0
    rows = list(csv.DictReader((logs / "lightning_logs" / "version_0" / "metrics.csv").open()))
    return ckpt, float(rows[-1]["val/acceptance_length"])


def serve_head(target, head, prompts: list[str], tmp_path, method: str, *extra: str) -> dict:
    """``draftsmith eval`` of ``head`` on ``prompts`` (k = 3, 48 tokens, greedy, lossless check);
    asserts the run was lossless with drafts accepted and returns its results.json row."""
    import json

    from draftsmith.cli import main as cli_main

    prompt_file = tmp_path / "prompts.jsonl"
    prompt_file.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    args = [f"--model={target}", f"--head={head}", "--k=[3]", "--temperatures=[0.0]", *extra]
    args += [f"--datasets=[{prompt_file}]", "--max_tokens=48", "--concurrency=16"]
    args += ["--baselines=[none]", "--lossless=true", "--wandb=false"]
    assert cli_main(["eval", *args, f"--output={tmp_path / 'eval'}"]) == 0
    runs = json.loads((tmp_path / "eval" / "results.json").read_text())["runs"]
    run = next(r for r in runs if r["method"] == method)
    assert run["lossless"]["mismatches"] == [], run["lossless"]
    assert run["counters"]["num_accepted_tokens"] > 0, run
    # The head's torch replica drafts what vLLM drafted: at T = 0 its replay of the served
    # replies counts vLLM's own drafts and accepted drafts, position by position.
    e, c = run["expected"], run["counters"]
    print(f"{method}: replica {e['replayed_drafts']} drafts, {e['replayed_accepted_per_pos']} "
          f"accepted; vLLM {c['num_drafts']}, {c['accepted_per_pos']}")  # fmt: skip
    assert e["replayed_drafts"] == c["num_drafts"], (e, c)
    assert e["replayed_accepted_per_pos"] == c["accepted_per_pos"], (e, c)
    return run


class StepMarker(Callback):
    """Writes ``global_step`` to ``path`` after each training batch, then sleeps ``pause``
    seconds: a run slow enough for a test to SIGKILL it at a step of its choosing."""

    def __init__(self, path: str, pause: float = 0.2) -> None:
        self.path, self.pause = path, pause

    def on_train_batch_end(self, trainer, *args) -> None:
        import time
        from pathlib import Path

        Path(self.path).write_text(str(trainer.global_step))
        time.sleep(self.pause)


class SigtermAtStep(Callback):
    """Sends SIGTERM to this process's whole process group (as ``timeout`` does, DataLoader
    workers included) once ``global_step == step``, in ``on_train_batch_end``; with
    ``in_validation`` instead at the first validation batch at or after that step."""

    def __init__(self, step: int, in_validation: bool = False) -> None:
        self.step, self.in_validation, self.sent = step, in_validation, False

    def _send(self, trainer) -> None:
        import os
        import signal

        if not self.sent and trainer.global_step >= self.step:
            self.sent = True
            os.killpg(os.getpgrp(), signal.SIGTERM)

    def on_train_batch_end(self, trainer, *args) -> None:
        if not self.in_validation:
            self._send(trainer)

    def on_validation_batch_end(self, trainer, *args) -> None:
        if self.in_validation and not trainer.sanity_checking:
            self._send(trainer)


@contextlib.contextmanager
def one_thread():
    """Train with one compute thread: heads equal to the last bit whatever the machine's load
    (``avoid_busy_cores`` would otherwise pick the thread count by the cores free, and Adam
    turns a reduction-order difference into one of ~lr on near-zero gradients)."""
    import torch

    from draftsmith.train import main as train_stage

    threads, busy = torch.get_num_threads(), train_stage.avoid_busy_cores
    torch.set_num_threads(1)
    train_stage.avoid_busy_cores = lambda: None
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        train_stage.avoid_busy_cores = busy


class CachedContextAttention(torch.nn.Module):
    """Stands in for vLLM's paged attention kernel only, in its block drafters' modules
    (DSpark, DFlash2): the query slots attend (both ways) to the context keys / values vLLM's
    own ``precompute_and_store_context_kv`` wrote, then to the block's."""

    def __init__(self, kv: tuple[torch.Tensor, torch.Tensor], attn) -> None:
        super().__init__()
        self.kv, self.n, self.n_kv, self.hd = kv, attn.num_heads, attn.num_kv_heads, attn.head_dim

    def forward(self, q, k, v):
        k = torch.cat([self.kv[0], k.view(-1, self.n_kv, self.hd)]).transpose(0, 1)
        v = torch.cat([self.kv[1], v.view(-1, self.n_kv, self.hd)]).transpose(0, 1)
        rep = self.n // self.n_kv
        q = q.view(-1, self.n, self.hd).transpose(0, 1)
        out = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 0),
                                             v.repeat_interleave(rep, 0))  # fmt: skip
        return out.transpose(0, 1).reshape(q.shape[1], -1)
