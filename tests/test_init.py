"""``model.init_from_target``: draft layers copied from the target's top layers, fc passing
the deepest tapped state through; and the new ``model.*`` levers end to end (fit, checkpoint,
export)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from draftsmith.core.errors import ConfigError
from draftsmith.core.targets import read_target
from draftsmith.drafters import from_target_config
from draftsmith.drafters.eagle1.head import Eagle1Head
from draftsmith.drafters.eagle3.head import Eagle3Head
from draftsmith.drafters.target.init_layers import init_from_target
from draftsmith.drafters.target.weights import load_target_weights

H = 128  # the tiny target's hidden size (8 layers)
COPIED = [
    "self_attn.o_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
    "post_attention_layernorm.weight",
]
QKV = ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"]


@pytest.fixture(scope="module")
def target(tmp_path_factory, tiny_model_dir) -> Path:
    """The tiny target with non-trivial norms (random 1-D tensors), so copies are visible."""
    out = tmp_path_factory.mktemp("init") / "target"
    out.mkdir()
    shutil.copy(tiny_model_dir / "config.json", out)
    g = torch.Generator().manual_seed(0)
    tensors = {
        k: v + 0.2 * torch.randn(v.shape, generator=g) if v.dim() == 1 else v
        for k, v in load_file(tiny_model_dir / "model.safetensors").items()
    }
    save_file(tensors, out / "model.safetensors")
    return out


def build(target: Path, kind: str = "eagle3", **options) -> tuple[torch.nn.Module, list[int]]:
    """A head for ``target`` started from it; (head, the target layer ids copied)."""
    torch.manual_seed(0)
    head = from_target_config(json.loads((target / "config.json").read_text()), kind, **options)
    info = read_target(str(target))
    weights = load_target_weights(info)
    head.set_embeddings(weights.embed)
    return head, init_from_target(head, info, weights.norm)


def test_eagle3_starts_as_the_targets_last_layer(target) -> None:
    head, ids = build(target)
    assert isinstance(head, Eagle3Head) and ids == [7]
    t, sd = load_file(target / "model.safetensors"), head.state_dict()
    last = "model.layers.7."
    for key in QKV:  # [out, 2H] = [embedding half | hidden half]
        w = sd[f"midlayer.{key}"]
        assert w.shape == (t[last + key].shape[0], 2 * H)
        assert torch.equal(w[:, H:], t[last + key]) and not w[:, :H].any()
    for key in [*COPIED, "input_layernorm.weight"]:
        assert torch.equal(sd[f"midlayer.{key}"], t[last + key]), key
    assert torch.equal(sd["midlayer.hidden_norm.weight"], t[last + "input_layernorm.weight"])
    assert torch.equal(sd["norm.weight"], t["model.norm.weight"])
    fc = sd["fc.weight"]  # [H, 3H] over (low, mid, high): the deepest passes through
    assert fc.shape == (H, 3 * H)
    assert torch.equal(fc[:, 2 * H :], torch.eye(H)) and not fc[:, : 2 * H].any()
    aux = torch.randn(2, 5, 3 * H)
    torch.testing.assert_close(head.combine_hidden_states(aux), aux[..., 2 * H :])

    # Fed the input of the target's last layer, step 0 gives the target's own logits.
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    input_ids = torch.randint(0, head.vocab_size, (1, 12))
    with torch.no_grad():
        out = model(input_ids, output_hidden_states=True)
        states = out.hidden_states  # [k] = input of layer k (k < 8)
        hidden = head.combine_hidden_states(torch.cat([states[2], states[4], states[7]], -1))
        head.lm_head.weight.copy_(load_target_weights(read_target(str(target))).lm_head)
        normed, _ = head(input_ids, hidden, torch.arange(12)[None])
        torch.testing.assert_close(head.lm_head(normed), out.logits, atol=1e-4, rtol=1e-4)


def test_more_layers_copy_the_top_ones_and_eagle1(target) -> None:
    t = load_file(target / "model.safetensors")
    head, ids = build(target, num_layers=2, fc_norm=True, norm_before_fc=True)
    assert ids == [6, 7]
    sd = head.state_dict()
    assert torch.equal(sd["midlayer.self_attn.q_proj.weight"][:, H:], t["model.layers.6." + QKV[0]])
    for key in [*QKV, *COPIED, "input_layernorm.weight"]:
        assert torch.equal(sd[f"layers.1.{key}"], t[f"model.layers.7.{key}"]), key
    assert (sd["input_norm.weight"] == 1).all() and (sd["fc_norm.2.weight"] == 1).all()

    e1, ids = build(target, "eagle", num_layers=2)
    assert isinstance(e1, Eagle1Head) and ids == [6, 7]
    sd = e1.state_dict()
    assert "layers.0.input_layernorm.weight" not in sd  # vLLM runs EAGLE-1's first without
    for i in (0, 1):
        keys = [*QKV, *COPIED] + (["input_layernorm.weight"] if i else [])
        for key in keys:
            assert torch.equal(sd[f"layers.{i}.{key}"], t[f"model.layers.{6 + i}.{key}"]), key
    fc = sd["fc.weight"]  # [H, 2H] over cat(embeds, hidden): the hidden half passes
    assert torch.equal(fc[:, H:], torch.eye(H)) and not fc[:, :H].any()
    embeds, hidden = torch.randn(3, H), torch.randn(3, H)
    torch.testing.assert_close(e1.fc(torch.cat([embeds, hidden], -1)), hidden)


def test_heads_that_do_not_fit_are_refused(target) -> None:
    with pytest.raises(ConfigError, match="model.init_from_target: fc .* hidden size \\(128\\)"):
        build(target, target_hidden_size=64)
    with pytest.raises(ConfigError, match="model.init_from_target: .*lower model.num_layers"):
        build(target, num_layers=9)
    with pytest.raises(ConfigError, match="mlp.gate_proj.weight is \\(64, 128\\) but target"):
        build(target, intermediate_size=64)
    gelu = target.parent / "gelu"  # a head trains on it; copying its MLPs would be wrong
    gelu.mkdir()
    (gelu / "model.safetensors").symlink_to(target / "model.safetensors")
    config = json.loads((target / "config.json").read_text())
    (gelu / "config.json").write_text(json.dumps({**config, "hidden_act": "gelu"}))
    with pytest.raises(ConfigError, match="target's MLPs use 'gelu', the head's use silu"):
        build(gelu)
    offset = target.parent / "offset-norms"  # Qwen3-Next's (1 + w) norms and gated attention
    offset.mkdir()
    (offset / "model.safetensors").symlink_to(target / "model.safetensors")
    (offset / "config.json").write_text(json.dumps({**config, "model_type": "qwen3_next"}))
    with pytest.raises(ConfigError, match="qwen3_next layers scale their norms by \\(1 \\+ w\\)"):
        build(offset)


def test_module_options_are_checked_and_wired(target) -> None:
    from draftsmith.train.module import DraftModule

    with pytest.raises(ConfigError, match="model.fc_norm: .* set it false for model.kind eagle"):
        DraftModule(kind="eagle", fc_norm=True)
    with pytest.raises(ConfigError, match="model.tv_weight: 2"):
        DraftModule(loss="kl_tv", tv_weight=2)
    module = DraftModule(init_from_target=True, norm_before_fc=True, loss="tv")
    module.build(read_target(str(target)), [2, 4, 7], 8)
    assert module.info["init_from_target_layers"] == [7]
    assert module.head.input_norm is not None and module.head.fc_norm is None
    q = module.head.midlayer.self_attn.q_proj.weight
    assert torch.equal(
        q[:, H:], load_file(target / "model.safetensors")["model.layers.7." + QKV[0]]
    )


def test_eagle3_1_norm_output_reaches_the_head_and_its_config(target) -> None:
    from draftsmith.drafters import head_config
    from draftsmith.train.module import DraftModule

    with pytest.raises(
        ConfigError, match="model.norm_output: .* set it false for model.kind eagle"
    ):
        DraftModule(kind="eagle", norm_output=True)
    for on in (False, True):
        module = DraftModule(norm_output=on)
        module.build(read_target(str(target)), [2, 4, 7], 8)
        assert module.head.norm_output is on
        config = head_config(
            module.head, "eagle3", read_target(str(target)).config, [2, 4, 7], 3, "t"
        )
        assert config["norm_output"] is on


def test_new_options_fit_checkpoint_and_export(tmp_path, tiny_dataset) -> None:
    from draftsmith.cli import main as cli_main
    from draftsmith.train.checkpoints import read_checkpoint
    from draftsmith.train.main import main as train_main

    tiny = Path(__file__).resolve().parents[1] / "configs" / "train" / "tiny.yaml"
    out = tmp_path / "run"
    train_main(
        [
            "fit",
            f"--config={tiny}",
            f"--data.data={tiny_dataset}",
            f"--trainer.default_root_dir={out}",
            f"--checkpoint.dirpath={out / 'ckpt'}",
            "--trainer.max_epochs=1",
            "--model.loss=kl_tv",
            "--model.tv_weight=0.25",
            "--model.init_from_target=true",
            "--model.fc_norm=true",
        ]
    )
    ckpt = read_checkpoint(out / "ckpt" / "last.ckpt")
    hp = ckpt["hyper_parameters"]
    assert (hp["loss"], hp["tv_weight"], hp["init_from_target"], hp["fc_norm"]) == (
        "kl_tv",
        0.25,
        True,
        True,
    )
    assert hp["norm_before_fc"] is False and ckpt["draftsmith"]["init_from_target_layers"] == [7]
    assert ckpt["draftsmith"]["head_kwargs"]["fc_norm"] is True
    head_dir = tmp_path / "head"
    args = ["export", f"--checkpoint={out / 'ckpt' / 'last.ckpt'}", f"--output={head_dir}"]
    assert cli_main(args) == 0
    config = json.loads((head_dir / "config.json").read_text())
    assert config["fc_norm"] is True and config["norm_before_fc"] is False
    assert {"fc_norm.0.weight", "fc_norm.2.weight"} <= set(
        load_file(head_dir / "model.safetensors")
    )
