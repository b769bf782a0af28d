"""A drafter kind defined here, outside the library, registered, then trained, validated and
exported through the same commands as the built-in kinds: adding a kind needs no library edit.

The toy kind: one linear map of the deepest tapped state, read out through the target's
lm_head, drafting one token (the token after the next). Its validation walk has k = 1.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from draftsmith import drafters
from draftsmith.core.files import write_json_atomic
from draftsmith.drafters.headfiles.directory import HeadError, write_head_dir
from draftsmith.drafters.losses.acceptance import step_validity
from draftsmith.drafters.losses.loss import loss_record
from draftsmith.drafters.losses.walk import served_walk
from draftsmith.drafters.protocol import Built, Drafter
from draftsmith.drafters.protocol.options import HeadOptions

ROOT = Path(__file__).resolve().parents[1]


class ToyHead(nn.Module):
    """[B, T, H_aux] deepest tapped state -> [B, T, H] (then the target's lm_head)."""

    def __init__(self, hidden_size: int, width: int) -> None:
        super().__init__()
        self.init_kwargs = {"hidden_size": hidden_size, "width": width}
        self.down = nn.Linear(hidden_size, width, bias=False)
        self.up = nn.Linear(width, hidden_size, bias=False)

    def forward(self, states: Tensor) -> Tensor:
        return self.up(torch.tanh(self.down(states)))


@dataclass
class ToyOptions(HeadOptions):
    """The toy kind's options."""

    toy_width: int = 16
    """Toy: the bottleneck width."""


class Toy(Drafter):
    name = "toy"
    title = "Toy"
    Options = ToyOptions
    methods = {"toy": ("ToyDraft",)}
    head_class = ToyHead

    def build(self, target, data, weights) -> Built:
        head = ToyHead(target.hidden_size, self.options.toy_width)
        return Built(head, {}, {"head_kwargs": head.init_kwargs, "layer_ids": data.aux_layer_ids})

    def loss(self, trainee, batch) -> tuple[Tensor, Any]:
        h = trainee.target_lm_head.shape[1]
        drafts = trainee.head(batch["aux_states"][..., -h:])  # [B, T, H]: stream t -> x_{t+2}
        teacher = trainee.teacher(batch)  # row p predicts x_{p+1}
        valid = step_validity(batch["loss_mask"], batch["doc_ids"], 0)  # [B, T]
        b, t = valid.nonzero(as_tuple=True)
        logits = drafts[b, t] @ trainee.target_lm_head.T
        target = (teacher[b, t + 1] @ trainee.target_lm_head.T).softmax(-1)
        loss = F.cross_entropy(logits, target)
        hit = logits.argmax(-1) == target.argmax(-1)
        accepted = torch.zeros_like(batch["input_ids"])
        shifted = torch.zeros_like(accepted)
        shifted[b, t] = hit.long()
        accepted[:, 1:] = shifted[:, :-1]  # the draft after bonus token x_{t+1}
        seen, hits = served_walk(accepted, batch["loss_mask"], batch["doc_ids"], 1)
        accuracy = hit.float().mean() if hit.numel() else loss.new_zeros(())
        record = loss_record(loss, [loss.detach()], [accuracy], [hit.numel()], seen, hits)
        return loss, record

    def walk_length(self) -> int:
        return 1

    @classmethod
    def export(cls, head, target, out_dir, *, layer_ids=None, card=None, dtype=None, **_):
        def write(tmp: Path) -> None:
            tensors = {
                k: v.detach().to(dtype or torch.float32) for k, v in head.state_dict().items()
            }
            save_file(tensors, tmp / "model.safetensors")
            config = {"architectures": ["ToyDraft"], **head.init_kwargs, "layer_ids": layer_ids}
            write_json_atomic(tmp / "config.json", config)

        return write_head_dir(out_dir, write)

    @classmethod
    def check_head(cls, head, method, config, shapes, target) -> None:
        if shapes["down.weight"][1] != target.hidden_size:
            raise HeadError(f"head: {head} reads hidden size {shapes['down.weight'][1]}")


@pytest.fixture
def toy_kind():
    drafters.register(Toy)
    yield Toy
    del drafters.KINDS[Toy.name]


def test_a_kind_defined_outside_the_library_trains_validates_and_exports(
    toy_kind, tmp_path, tiny_dataset, tiny_model_dir
):
    from draftsmith.cli import main as cli_main
    from draftsmith.core.targets import read_target
    from draftsmith.evaluate.checks import check_head, head_method
    from draftsmith.train.checkpoints import read_checkpoint
    from draftsmith.train.main import main as train_main

    out = tmp_path / "run"
    args = ["fit", f"--config={ROOT / 'configs/train/tiny.yaml'}", f"--data.data={tiny_dataset}"]
    args += [f"--trainer.default_root_dir={out}", f"--checkpoint.dirpath={out / 'ckpt'}"]
    args += ["--model.kind=toy", "--model.toy_width=8", "--trainer.max_epochs=2"]
    assert train_main(args) == 0
    ckpt = read_checkpoint(out / "ckpt" / "last.ckpt")
    info = ckpt["draftsmith"]
    assert info["kind"] == "toy" and info["head_kwargs"] == {"hidden_size": 128, "width": 8}
    assert ckpt["hyper_parameters"]["toy_width"] == 8
    assert 1.0 <= info["metrics"]["val/acceptance_length"] <= 2.0  # k = 1: one draft a step

    head_dir = tmp_path / "head"
    export = ["export", f"--checkpoint={out / 'ckpt' / 'last.ckpt'}", f"--output={head_dir}"]
    assert cli_main([*export, "--dtype=float32"]) == 0
    saved = load_file(head_dir / "model.safetensors")
    trained = {k[5:]: v for k, v in ckpt["state_dict"].items() if k.startswith("head.")}
    assert saved.keys() == trained.keys()
    for key in saved:
        torch.testing.assert_close(saved[key], trained[key], rtol=0, atol=0)
    config = json.loads((head_dir / "config.json").read_text())
    assert config["layer_ids"] == info["layer_ids"]
    assert head_method(str(head_dir)) == "toy"
    assert check_head(str(head_dir), "toy", read_target(str(tiny_model_dir)))["width"] == 8


def test_a_kind_whose_shared_option_disagrees_is_refused():
    @dataclass
    class Clashing(HeadOptions):
        """num_layers with another default than every other kind's."""

        num_layers: int = 5  # type: ignore[assignment]
        """Layers."""

    class Bad(Toy):
        name = "bad"
        Options = Clashing

    with pytest.raises(TypeError, match="num_layers"):
        drafters.register(Bad)
    assert "bad" not in drafters.KINDS
