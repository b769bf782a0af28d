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
from helpers import serve_head

from draftsmith.cli import main as cli_main
from draftsmith.train.main import main as train_main

pytestmark = pytest.mark.vllm

K = 3
EAGLE1_EPOCHS = 8  # at lr 1e-2: acceptance ~1.18 (simulated and in vLLM), ~1 min
TOLERANCE = 0.1  # |simulated - vLLM| acceptance length; 0.03 (3.84 vs 3.82) before the walk


def evaluate(target: Path, head: Path, prompt_file: Path, out: Path, *extra: str) -> dict:
    """``draftsmith eval`` of ``head`` at k = K on the prompts; its results.json run."""
    code = cli_main(
        [
            "eval",
            f"--model={target}",
            f"--head={head}",
            f"--k=[{K}]",
            "--temperatures=[0.0]",
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
            "simulated": simulated, "data": data, "prompt_list": prompts}  # fmt: skip


def test_overfit_head_reaches_k_plus_one_in_vllm(overfit):
    simulated, run = overfit["simulated"], overfit["run"]
    assert simulated > 3.5
    measured = run["acceptance_length"]
    assert measured > 3.4, run  # close to k + 1 = 4
    assert abs(measured - simulated) < TOLERANCE, (measured, simulated)


def assert_converts_back(converted: Path, original: Path, target: Path, out: Path) -> None:
    """``converted`` read back and written for vLLM holds exactly ``original``'s tensors."""
    from safetensors.torch import load_file

    assert cli_main(["convert", f"--head={converted}", f"--model={target}", "--to=vllm",
                     f"--output={out}"]) == 0  # fmt: skip
    want, got = (load_file(d / "model.safetensors") for d in (original, out))
    assert want.keys() == got.keys(), (converted, want.keys() ^ got.keys())
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=0, msg=key)


@pytest.mark.parametrize("layout", ["eagle", "speculators", "sglang", "trtllm"])
def test_converted_layouts_serve_as_the_original(overfit, layout, tmp_path):
    """The head written by ``draftsmith convert`` in another project's layout is served by
    vLLM as it is, drafting exactly what the original drafts; read back and written for
    vLLM, its tensors equal the original's."""
    converted = tmp_path / layout
    args = [f"--head={overfit['head']}", f"--model={overfit['target']}", f"--output={converted}"]
    assert cli_main(["convert", *args, f"--to={layout}"]) == 0
    run = evaluate(overfit["target"], converted, overfit["prompts"], tmp_path / "eval")
    assert run["counters"] == overfit["run"]["counters"], (layout, run["counters"])
    assert_converts_back(converted, overfit["head"], overfit["target"], tmp_path / "back")


def write_modelopt(head: Path, out: Path) -> Path:
    """``head`` (our EAGLE-3 export) as NVIDIA ModelOpt publishes one
    (``modelopt/torch/export/plugins/hf_spec_export.py``, ``EagleExporter``): its Llama
    config template with an ``eagle_config`` block (the taps there only) and no
    ``target_hidden_size``; tensors ``layers.0.*``, ``fc``, ``norm``, ``lm_head``, ``d2t``,
    no ``t2d``."""
    from safetensors.torch import load_file, save_file

    ours = json.loads((head / "config.json").read_text())
    keep = ("hidden_act", "hidden_size", "intermediate_size", "max_position_embeddings",
            "num_attention_heads", "num_key_value_heads", "num_hidden_layers", "rms_norm_eps",
            "vocab_size", "draft_vocab_size", "attention_bias", "head_dim", "mlp_bias",
            "rope_theta", "torch_dtype")  # fmt: skip
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        **{key: ours[key] for key in keep},
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
        "initializer_range": 0.02,
        "tie_word_embeddings": False,
        "use_cache": True,
        "rope_scaling": None,
        "attention_dropout": 0.0,
        "pretraining_tp": 1,
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": ours["eagle_aux_hidden_state_layer_ids"],
            "use_aux_hidden_state": True,
            "use_input_layernorm_in_first_layer": True,
            "use_last_layernorm": True,
            "use_mtp_layernorm": False,
            "next_layer_regular": True,
            "parallel_draft_step": 1,
            "parallel_draft_heads_num_layers": 1,
        },
    }
    tensors = load_file(head / "model.safetensors")
    tensors = {k.replace("midlayer.", "layers.0."): v for k, v in tensors.items() if k != "t2d"}
    out.mkdir(parents=True)
    save_file(tensors, out / "model.safetensors", {"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=4))
    return out


def test_modelopt_layout_serves_as_written(overfit, tmp_path):
    """A head in NVIDIA ModelOpt's layout, written by hand as ModelOpt publishes one, is
    served by vLLM 0.32 as it is (``llama_eagle3.py`` loads ``layers.0.*``, sizes ``fc``
    from ``eagle_config``, reads ``use_aux_hidden_state`` and ignores ModelOpt's other
    keys; the V1 runner takes the taps from ``eagle_config`` when the top level names none),
    drafting exactly what the original drafts; convert reads it back to equal tensors.
    (The taps here are the target's default ones, so a runner that ignored them would
    agree too.)"""
    modelopt = write_modelopt(overfit["head"], tmp_path / "modelopt")
    run = evaluate(overfit["target"], modelopt, overfit["prompts"], tmp_path / "eval")
    assert run["counters"] == overfit["run"]["counters"], run["counters"]
    assert_converts_back(modelopt, overfit["head"], overfit["target"], tmp_path / "back")


def generations(eval_dir: Path, method: str) -> dict[str, list[int]]:
    rows = [json.loads(line) for line in (eval_dir / "generations.jsonl").open()]
    return {r["id"]: r["token_ids"] for r in rows if r["method"] == method}


def test_eagle1_converted_to_safeailab_serves_as_the_original(overfit, tmp_path):
    """An EAGLE-1 head trained on the peaked target, converted to SafeAILab's layout, is
    served by vLLM as it is (method eagle) with the original's counters and the target's
    own greedy text; read back and written for vLLM, its tensors equal the original's."""
    out = tmp_path / "run"
    train_main(
        [
            "fit",
            f"--config={Path(__file__).resolve().parents[1] / 'configs' / 'train' / 'tiny.yaml'}",
            f"--data.data={overfit['data']}",
            "--model.kind=eagle",
            "--data.aux_layers=[8]",
            f"--model.ttt_steps={K}",
            f"--trainer.max_epochs={EAGLE1_EPOCHS}",
            "--model.lr=1e-2",
            "--data.val_fraction=0",
            "--checkpoint.monitor=null",
            f"--trainer.default_root_dir={out}",
            f"--checkpoint.dirpath={out / 'ckpt'}",
        ]
    )
    head = tmp_path / "head"
    assert cli_main(["export", f"--checkpoint={out / 'ckpt' / 'last.ckpt'}",
                     f"--output={head}", "--dtype=float32"]) == 0  # fmt: skip
    (tmp_path / "original").mkdir()
    original = serve_head(
        overfit["target"], head, overfit["prompt_list"], tmp_path / "original", "eagle"
    )
    safeailab = tmp_path / "safeailab"
    assert cli_main(["convert", f"--head={head}", f"--model={overfit['target']}",
                     "--to=eagle", f"--output={safeailab}"]) == 0  # fmt: skip
    assert json.loads((safeailab / "config.json").read_text())["architectures"] == [
        "LlamaForCausalLM"
    ]
    run = evaluate(overfit["target"], safeailab, overfit["prompts"], tmp_path / "eval",
                   "--method=eagle")  # fmt: skip
    assert run["counters"] == original["counters"], (run["counters"], original["counters"])
    target_only = generations(tmp_path / "original" / "eval", "none")
    assert generations(tmp_path / "eval", "eagle") == target_only
    assert_converts_back(safeailab, head, overfit["target"], tmp_path / "back")
