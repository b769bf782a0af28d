"""Sequence parallelism: one packed row split across 2 gloo processes gives the loss, the
gradients and the validation record of the row on 1 process.

The two processes run EAGLE-3's objective (``Eagle3.loss``: the TTT unroll, the loss and, in
validation, the served walk) on their halves of the row, with documents packed, padding at
the end and a sliding window; their gradients are averaged as DDP / FSDP average them. In
float64 the only difference from one process is the order of sums (the loss of a row is the
sum of the two halves' shares; attention runs whole on each rank's heads), so the tolerance
is 1e-10 relative. The Lightning run (``data.sequence_parallel: 2``) checks the training
loop's part: rows dealt to both ranks alike, states split before they move, gradients scaled.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from draftsmith.core.errors import ConfigError
from draftsmith.drafters.attention.sequence_parallel import SequenceShard, make_shard
from draftsmith.drafters.eagle3 import Eagle3
from draftsmith.drafters.eagle3.head import Eagle3Head
from draftsmith.drafters.eagle3.options import Eagle3Options

ROOT = Path(__file__).resolve().parents[1]
H, V, T, K = 64, 300, 48, 3
SHAPES = {
    "gqa": dict(num_heads=4, num_kv_heads=2),
    "one_kv_head": dict(num_heads=2, num_kv_heads=1),  # fewer key/value heads than ranks
}


class Trainee:
    """What ``Eagle3.loss`` reads of the training loop (``DraftModule``)."""

    def __init__(self, head: Eagle3Head, shard: SequenceShard | None, training: bool) -> None:
        g = torch.Generator().manual_seed(3)
        self.head, self.sequence_shard, self.training = head, shard, training
        self.device = torch.device("cpu")
        self.target_lm_head = torch.randn(V, H, generator=g, dtype=torch.float64)
        self.norm = 1 + 0.1 * torch.randn(H, generator=g, dtype=torch.float64)

    def teacher(self, batch):
        x = batch["teacher_states"]
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.norm


def make_case(shape: str) -> tuple[Eagle3Head, dict]:
    """A float64 head (window 5, 2 layers) and two rows: documents of 15, 20, 9 tokens then 4
    of padding, and one document; loss on the second half of each document."""
    torch.manual_seed(0)
    head = Eagle3Head(hidden_size=H, head_dim=16, intermediate_size=96, vocab_size=V,
                      draft_vocab_size=120, num_layers=2, qk_norm=True, sliding_window=5,
                      **SHAPES[shape]).double()  # fmt: skip
    head.set_embeddings(torch.randn(V, H))
    head.set_draft_vocab(torch.randperm(V)[:120])
    sizes = [[15, 20, 9, 4], [48]]
    doc = torch.tensor([sum(([d if d < 3 or len(s) == 1 else -1] * n for d, n in
                             enumerate(s)), []) for s in sizes])  # fmt: skip
    pos = torch.stack([torch.cat([torch.arange(n) for n in s]) for s in sizes])
    batch = {
        "input_ids": torch.randint(1, V, (2, T)),
        "aux_states": torch.randn(2, T, 3 * H, dtype=torch.float64),
        "teacher_states": torch.randn(2, T, H, dtype=torch.float64),
        "position_ids": pos,
        "doc_ids": doc,
        "loss_mask": (pos >= 4) & (doc >= 0),
    }
    return head, batch


def run(shape: str, shard: SequenceShard | None, training: bool):
    """(loss, record, gradients) of the objective on the case, on this rank's share."""
    head, batch = make_case(shape)
    kind = Eagle3(Eagle3Options(ttt_steps=K, sliding_window=5))
    trainee = Trainee(head, shard, training)
    part = batch if shard is None else shard.take(batch)
    with torch.set_grad_enabled(training):
        loss, out = kind.loss(trainee, part)
    grads = None
    if training:
        loss.backward()
        grads = {n: p.grad.clone() for n, p in head.named_parameters() if p.grad is not None}
    return loss.detach(), out, grads


def worker(rank: int, init: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    torch.set_num_threads(1)
    results = {}
    shard = make_shard(2, T, halo=K)
    for shape in SHAPES:
        loss, out, grads = run(shape, shard, training=True)
        for g in grads.values():  # DDP / FSDP average the ranks' gradients
            dist.all_reduce(g)
            g /= 2
        _, val, _ = run(shape, shard, training=False)
        results[shape] = (loss, out.step_loss, grads, val.loss, val.chain_seen, val.chain_hit)
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    dist.destroy_process_group()


def test_two_processes_equal_one_process(tmp_path) -> None:
    # fork: the workers start with this process's imports (a spawned one re-imports torch,
    # Lightning and draftsmith); they compute on one thread each.
    init = f"file://{tmp_path / 'store'}"
    mp.start_processes(worker, args=(init, str(tmp_path)), nprocs=2, start_method="fork")
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    close = dict(rtol=1e-10, atol=1e-12)
    for shape in SHAPES:
        loss, out, grads = run(shape, None, training=True)
        _, val, _ = run(shape, None, training=False)
        assert len(grads) > 10 and val.chain_seen.sum() > 0
        for got in (r[shape] for r in ranks):
            torch.testing.assert_close(got[0], loss, **close)
            torch.testing.assert_close(got[1], out.step_loss, **close)
            assert got[2].keys() == grads.keys()
            for name, g in grads.items():
                torch.testing.assert_close(got[2][name], g, **close, msg=name)
            torch.testing.assert_close(got[3], val.loss, **close)
            assert torch.equal(got[4], val.chain_seen) and torch.equal(got[5], val.chain_hit)


def test_shard_takes_its_rows_and_the_teacher_halo() -> None:
    states = torch.arange(8.0).view(1, 8, 1)
    first, last = (SequenceShard(None, r, 2, 8, halo=3) for r in (0, 1))
    assert first.with_halo(states).flatten().tolist() == [0, 1, 2, 3, 4, 5, 6]
    assert last.with_halo(states).flatten().tolist() == [4, 5, 6, 7, 0, 0, 0]
    batch = {"aux_states": states, "teacher_states": states, "input_ids": states.long()}
    part = last.take(batch)
    assert part["aux_states"].flatten().tolist() == [4, 5, 6, 7]
    assert part["input_ids"] is batch["input_ids"]  # the integers stay whole


def test_refusals_are_one_line() -> None:
    with pytest.raises(ConfigError, match=r"data.sequence_parallel: 3 does not divide data.row"):
        SequenceShard(None, 0, 3, 256)
    with pytest.raises(ConfigError, match=r"does not divide the 1 processes"):
        make_shard(2, 256, 3)
    assert Eagle3(Eagle3Options(parallel_drafting=True)).sequence_halo() is None
    with pytest.raises(ConfigError, match=r"model.compile: on with data.sequence_parallel"):
        Eagle3(Eagle3Options(compile="on")).sequence_halo()


def train(out: Path, data: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    args = [f"--config={ROOT / 'configs' / 'train' / 'tiny.yaml'}", f"--data.data={data}",
            "--data.val_fraction=0.15", "--data.batch_size=1", "--trainer.max_steps=3",
            "--model.sliding_window=16", f"--trainer.default_root_dir={out}",
            f"--checkpoint.dirpath={out / 'ckpt'}", "--checkpoint.monitor=null",
            *extra]  # fmt: skip
    cmd = [sys.executable, "-m", "draftsmith.train", "fit", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_lightning_fit_with_sequence_parallel_2_trains_the_one_process_head(
    tmp_path, tiny_dataset
) -> None:
    """2 processes sharing each row (``data.sequence_parallel: 2``) == 1 process: the same
    rows in the same order, the gradient of each whole row; weights after 3 steps agree to
    float32 summation order (1e-5 absolute on weights of order 1e-1)."""
    from draftsmith.train.checkpoints import read_checkpoint

    runs = {}
    for name, extra in {"one": [], "split": ["--trainer.devices=2",
                                             "--data.sequence_parallel=2"]}.items():  # fmt: skip
        run = train(tmp_path / name, tiny_dataset, *extra)
        log = (tmp_path / name / "train.log").read_text() if run.returncode else ""
        assert run.returncode == 0, run.stderr[-3000:] + log[-3000:]
        runs[name] = read_checkpoint(tmp_path / name / "ckpt" / "last.ckpt")
    one, split = (r["state_dict"] for r in (runs["one"], runs["split"]))
    assert runs["split"]["global_step"] == 3
    for key, value in one.items():
        torch.testing.assert_close(split[key], value, rtol=0, atol=1e-5, msg=key)
    moved = read_checkpoint(tmp_path / "one" / "ckpt" / "last.ckpt")["state_dict"]
    assert any(k.endswith("q_norm.weight") for k in moved)  # the windowed (Qwen3) head


def test_the_64k_recipe_splits_rows_and_its_wrong_variants_are_refused(tmp_path, capsys):
    """The 64k recipe (8 GPUs, rows of 65,536 split 8 ways, a window) passes the pipeline's
    dry run; a split that does not divide the GPUs or the row, or a kind that cannot split a
    row, is refused in one line before anything starts."""
    import yaml

    from draftsmith.pipelines.main import main as pipeline_main

    recipe = yaml.safe_load((ROOT / "configs" / "pipelines" / "qwen3-8b-64k.yaml").read_text())
    train = recipe["train"]
    assert train["data"]["row_tokens"] == 65536 and train["trainer"]["devices"] == 8
    assert train["data"]["sequence_parallel"] == 8 and train["model"]["sliding_window"] > 3
    target = ROOT / "configs" / "targets" / "qwen3-8b-yarn"
    variants = {
        None: {},
        "does not divide the 8 processes": {"data": {"sequence_parallel": 16}},
        "does not divide data.row_tokens 65532": {"data": {"row_tokens": 65532}},
        "model.kind dflash": {"model": {"kind": "dflash"}},
    }
    for n, (message, change) in enumerate(variants.items()):
        for part, values in change.items():
            recipe["train"][part] = {**train[part], **values}
        path = tmp_path / f"recipe{n}.yaml"
        path.write_text(yaml.safe_dump(recipe))
        args = [f"--config={path}", f"--model={target}", f"--output={tmp_path / str(n)}"]
        code = pipeline_main([*args, "--dry_run=true"])
        recipe["train"] = {**train}
        out = capsys.readouterr()
        if message is None:
            assert code == 0 and "train    ok" in out.out, out.out + out.err
        else:
            assert code != 0 and message in out.out + out.err, out.out + out.err
