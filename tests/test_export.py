"""Exported heads: config and checkpoint in vLLM's format, and a lossless round trip in vLLM.

The engine tests start 4 engines in all (target alone, EAGLE-3, EAGLE-1, and the EAGLE-3 head
given as ``model=`` the way ``vllm serve <head_dir>`` loads it), each in its own subprocess.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from draftsmith.core.targets import read_target
from draftsmith.drafters import export_head, from_target_config, head_config

LAYER = [
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
    "post_attention_layernorm.weight",
]
EAGLE3_KEYS = {
    "fc.weight",
    "norm.weight",
    "lm_head.weight",
    "midlayer.input_layernorm.weight",
    "midlayer.hidden_norm.weight",
    *(f"midlayer.{k}" for k in LAYER),
}
EAGLE1_KEYS = {"fc.weight", *(f"layers.0.{k}" for k in LAYER)}
CHATS = [
    "Count from one to ten, then back down again.",
    "Repeat the word banana five times.",
    "List the days of the week.",
]


def target_config(target_dir: Path) -> dict:
    return json.loads((target_dir / "config.json").read_text())


def make_head(target_dir: Path, kind: str = "eagle3", seed: int = 0, **options):
    """A random head for `target_dir` with the target's embeddings (and lm_head for EAGLE-1)."""
    torch.manual_seed(seed)
    head = from_target_config(target_config(target_dir), kind, **options)
    weights = load_file(target_dir / "model.safetensors")
    embed = weights["model.embed_tokens.weight"]
    head.set_embeddings(embed)
    if kind == "eagle":
        head.set_lm_head(weights.get("lm_head.weight", embed))
    return head


def test_eagle3_config(tmp_path, tiny_model_dir):
    head = make_head(tiny_model_dir, norm_before_residual=True)
    out = export_head(
        head, "eagle3", read_target(str(tiny_model_dir)), tmp_path / "h", layer_ids=[1, 4, 8]
    )
    config = json.loads((out / "config.json").read_text())
    target = target_config(tiny_model_dir)
    assert config["architectures"] == ["Eagle3LlamaForCausalLM"]
    assert config["model_type"] == "llama"
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "head_dim"):
        assert config[key] == target[key], key
    assert config["num_key_value_heads"] == target["num_key_value_heads"]
    assert config["num_hidden_layers"] == 1
    assert config["vocab_size"] == config["draft_vocab_size"] == target["vocab_size"]
    assert config["target_hidden_size"] == target["hidden_size"]
    assert config["max_position_embeddings"] == target["max_position_embeddings"]
    assert config["rope_parameters"] == {**target["rope_parameters"]}
    assert config["rms_norm_eps"] == target["rms_norm_eps"]
    assert config["norm_before_residual"] is True and config["norm_output"] is False
    assert config["norm_before_fc"] is False and config["fc_norm"] is False
    assert config["tie_word_embeddings"] is False and config["torch_dtype"] == "float32"
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 4, 8]
    assert config["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [1, 4, 8]}
    assert config["speculators_model_type"] == "eagle3"
    spec = config["speculators_config"]
    assert spec["verifier"]["name_or_path"] == str(tiny_model_dir.resolve())
    assert spec["proposal_methods"][0]["speculative_tokens"] == 3
    assert config["transformer_layer_config"]["hidden_size"] == target["hidden_size"]


def test_eagle1_config_and_default_layer_ids(tmp_path, tiny_model_dir):
    target = target_config(tiny_model_dir)
    config = head_config(make_head(tiny_model_dir, "eagle"), "eagle", target, None, 5, "t")
    assert config["architectures"] == ["EagleLlamaForCausalLM"]
    assert config["speculators_model_type"] == "eagle"
    assert "eagle_aux_hidden_state_layer_ids" not in config and "eagle_config" not in config
    assert "fc_norm" not in config and "norm_before_fc" not in config
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 5
    # EAGLE-3 without ids: vLLM's default taps (2, N // 2, N - 3) are written out.
    config = head_config(make_head(tiny_model_dir), "eagle3", target, None, 3, "t")
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]


def test_bad_layer_ids_and_kind_are_refused(tiny_model_dir):
    target, head = target_config(tiny_model_dir), make_head(tiny_model_dir)
    with pytest.raises(ValueError, match="does not fit a Eagle3Head"):
        head_config(head, "eagle", target, None, 3, "t")
    with pytest.raises(ValueError, match="3 target states"):
        head_config(head, "eagle3", target, [2, 4, 5, 8], 3, "t")
    with pytest.raises(ValueError, match="out of range"):
        head_config(head, "eagle3", target, [2, 4, 9], 3, "t")
    with pytest.raises(ValueError, match="tap none"):
        head_config(make_head(tiny_model_dir, "eagle"), "eagle", target, [1, 2, 3], 3, "t")


def test_full_vocab_eagle3_tensors(tmp_path, tiny_model_dir):
    head = make_head(tiny_model_dir, num_layers=2)
    out = export_head(
        head, "eagle3", read_target(str(tiny_model_dir)), tmp_path / "h", layer_ids=[2, 4, 5]
    )
    tensors = load_file(out / "model.safetensors")
    later = {f"layers.1.{k}" for k in [*LAYER, "input_layernorm.weight"]}
    assert set(tensors) == EAGLE3_KEYS | later
    assert "d2t" not in tensors and not any("embed_tokens" in k for k in tensors)
    assert tensors["lm_head.weight"].shape == (head.vocab_size, head.hidden_size)
    assert tensors["fc.weight"].shape == (head.hidden_size, 3 * head.hidden_size)
    assert torch.equal(tensors["fc.weight"], head.fc.weight.detach())
    assert all(t.dtype == torch.float32 for t in tensors.values())


def test_reduced_vocab_eagle3_tensors_in_bfloat16(tmp_path, tiny_model_dir):
    head = make_head(tiny_model_dir, draft_vocab_size=1000)
    ids = torch.randperm(head.vocab_size, generator=torch.Generator().manual_seed(0))[:1000]
    head.set_draft_vocab(ids.sort().values)
    out = export_head(
        head, "eagle3", read_target(str(tiny_model_dir)), tmp_path / "h", dtype=torch.bfloat16
    )
    tensors = load_file(out / "model.safetensors")
    assert set(tensors) == EAGLE3_KEYS | {"d2t"}
    assert tensors["d2t"].dtype == torch.int64 and tensors["d2t"].shape == (1000,)
    assert torch.equal(tensors["d2t"] + torch.arange(1000), ids.sort().values)
    assert tensors["lm_head.weight"].shape == (1000, head.hidden_size)
    assert tensors["fc.weight"].dtype == torch.bfloat16
    config = json.loads((out / "config.json").read_text())
    assert config["draft_vocab_size"] == 1000 and config["torch_dtype"] == "bfloat16"


def test_norms_before_fc_are_exported_under_vllm_names(tmp_path, tiny_model_dir):
    head = make_head(tiny_model_dir, norm_before_fc=True, fc_norm=True)
    out = export_head(
        head, "eagle3", read_target(str(tiny_model_dir)), tmp_path / "h", layer_ids=[2, 4, 5]
    )
    tensors = load_file(out / "model.safetensors")
    norms = {"input_norm.weight", "fc_norm.0.weight", "fc_norm.1.weight", "fc_norm.2.weight"}
    assert set(tensors) == EAGLE3_KEYS | norms
    assert tensors["input_norm.weight"].shape == (3 * head.hidden_size,)
    assert tensors["fc_norm.1.weight"].shape == (head.hidden_size,)
    config = json.loads((out / "config.json").read_text())
    assert config["norm_before_fc"] is True and config["fc_norm"] is True


def test_eagle1_tensors_have_no_lm_head(tmp_path, tiny_model_dir):
    out = export_head(
        make_head(tiny_model_dir, "eagle"), "eagle", read_target(str(tiny_model_dir)), tmp_path
    )
    assert set(load_file(out / "model.safetensors")) == EAGLE1_KEYS


def test_model_card_and_atomic_rewrite(tmp_path, tiny_model_dir):
    card = {"training_data": {"samples": 400, "source": "self-written"}, "metrics": [{"k": 3}]}
    out = tmp_path / "head"
    out.mkdir()
    (out / "stale.txt").write_text("from an older export")
    export_head(
        make_head(tiny_model_dir), "eagle3", read_target(str(tiny_model_dir)), out, card=card
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["head"]  # no .tmp / .old left
    assert sorted(p.name for p in out.iterdir()) == [
        "README.md",
        "config.json",
        "model.safetensors",
    ]
    text = (out / "README.md").read_text()
    assert str(tiny_model_dir.resolve()) in text and "num_speculative_tokens (k)` | 3" in text
    assert "[2, 4, 5]" in text and f"vllm serve {out}" in text
    assert "| `samples` | 400 |" in text and "| k |" in text


PARSE_SCRIPT = """
import json, sys

from vllm.engine.arg_utils import EngineArgs

for head_dir in sys.argv[1:]:
    c = EngineArgs(model=head_dir, dtype="float32", max_model_len=512).create_engine_config()
    s = c.speculative_config
    hf = s.draft_model_config.hf_config
    print(json.dumps(dict(
        model=c.model_config.model, method=s.method, k=s.num_speculative_tokens,
        draft=s.draft_model_config.model, arch=s.draft_model_config.architectures,
        ids=getattr(hf, "eagle_aux_hidden_state_layer_ids", None),
        nbr=getattr(hf, "norm_before_residual", None), rope=hf.rope_parameters,
        nbf=getattr(hf, "norm_before_fc", None), fcn=getattr(hf, "fc_norm", None),
        draft_vocab=hf.draft_vocab_size, layers=hf.num_hidden_layers,
    )))
"""


def test_vllm_reads_the_config_as_a_speculator(tmp_path, tiny_model_dir):
    """vLLM's own config path, no engine: ``model=<head_dir>`` (what ``vllm serve <head_dir>``
    builds) resolves to the verifier plus the head, with the head's rope, ids and k."""
    pytest.importorskip("vllm")
    target = tmp_path / "target"  # the tiny target with llama3 rope scaling; no weights needed
    shutil.copytree(tiny_model_dir, target, ignore=shutil.ignore_patterns("*.safetensors"))
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0}
    rope |= {"high_freq_factor": 4.0, "original_max_position_embeddings": 1024}
    cfg = target_config(target) | {"rope_parameters": rope}
    (target / "config.json").write_text(json.dumps(cfg))
    torch.manual_seed(0)
    eagle3 = from_target_config(
        cfg, "eagle3", norm_before_residual=True, draft_vocab_size=1000, fc_norm=True
    )
    h3 = export_head(
        eagle3, "eagle3", read_target(str(target)), tmp_path / "h3", layer_ids=[1, 4, 8]
    )
    eagle1 = from_target_config(cfg, "eagle", num_layers=2)
    h1 = export_head(
        eagle1, "eagle", read_target(str(target)), tmp_path / "h1", num_speculative_tokens=5
    )
    cmd = [sys.executable, "-c", PARSE_SCRIPT, str(h3), str(h1)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    common = dict(model=str(target.resolve()), rope=rope)
    assert got[0] == dict(
        common,
        method="eagle3",
        k=3,
        draft=str(h3),
        arch=["Eagle3LlamaForCausalLM"],
        ids=[1, 4, 8],
        nbr=True,
        nbf=False,
        fcn=True,
        draft_vocab=1000,
        layers=1,
    )
    assert got[1] == dict(
        common,
        method="eagle",
        k=5,
        draft=str(h1),
        arch=["EagleLlamaForCausalLM"],
        ids=None,
        nbr=None,
        nbf=None,
        fcn=None,
        draft_vocab=cfg["vocab_size"],
        layers=2,
    )


ENGINE_SCRIPT = """
import json, sys

from vllm import LLM, SamplingParams

if __name__ == "__main__":
    args = json.loads(open(sys.argv[1]).read())
    llm = LLM(**args["llm"])
    params = SamplingParams(temperature=0.0, max_tokens=args["max_tokens"], ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in args["prompts"]], params)
    counters = {m.name: m.value for m in llm.get_metrics() if hasattr(m, "value")}
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    json.dump({"tokens": tokens, "counters": counters}, open(sys.argv[2], "w"))
"""


def chat_prompts(tokenizer) -> list[list[int]]:
    """The token ids of each of CHATS rendered as a one-turn chat, ready for a reply."""
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True)
        for c in CHATS
    ]
    return [list(p["input_ids"] if hasattr(p, "keys") else p) for p in prompts]


def run_engine(tmp_path: Path, tokenizer, **llm) -> dict:
    """Greedy 24 tokens for the chat prompts in a fresh engine process; tokens and counters."""
    prompts = chat_prompts(tokenizer)
    llm = dict(dtype="float32", gpu_memory_utilization=0.3, enforce_eager=True, **llm)
    llm |= dict(max_model_len=512, disable_log_stats=False)
    tmp_path.mkdir(parents=True, exist_ok=True)
    script, args, out = (tmp_path / n for n in ("engine.py", "args.json", "out.json"))
    script.write_text(ENGINE_SCRIPT)
    args.write_text(json.dumps({"llm": llm, "prompts": prompts, "max_tokens": 24}))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, str(script), str(args), str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def target_only(tiny_model_dir, tokenizer) -> dict:
    """The target's own greedy 24 tokens for the chat prompts, by transformers (no engine)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    tokens = []
    for prompt in chat_prompts(tokenizer):
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(24):  # no stop at EOS, as `ignore_eos=True` in the engine
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        tokens.append(ids[len(prompt) :])
    return {"tokens": tokens}


def assert_lossless_with_drafts(result: dict, target_only: dict, k: int = 3) -> None:
    assert result["tokens"] == target_only["tokens"]
    assert all(len(t) == 24 for t in result["tokens"])
    c = result["counters"]
    assert c["vllm:spec_decode_num_drafts"] > 0
    assert c["vllm:spec_decode_num_draft_tokens"] == k * c["vllm:spec_decode_num_drafts"]


@pytest.mark.vllm
def test_eagle1_round_trip_in_vllm(tmp_path, tiny_model_dir, tokenizer, target_only):
    head_dir = export_head(
        make_head(tiny_model_dir, "eagle"),
        "eagle",
        read_target(str(tiny_model_dir)),
        tmp_path / "h",
    )
    spec = {"method": "eagle", "model": str(head_dir), "num_speculative_tokens": 3}
    result = run_engine(
        tmp_path / "run", tokenizer, model=str(tiny_model_dir), speculative_config=spec
    )
    assert_lossless_with_drafts(result, target_only)


@pytest.mark.vllm
def test_head_dir_alone_serves_target_and_head(tmp_path, tiny_model_dir, tokenizer, target_only):
    """`LLM(model=head_dir)` is what `vllm serve head_dir` builds: verifier + head, k from config.

    The head here has a reduced draft vocabulary (d2t) and two layers, to load those in vLLM too.
    """
    head = make_head(tiny_model_dir, draft_vocab_size=1000, num_layers=2)
    head.set_draft_vocab(torch.arange(1000))
    head_dir = export_head(
        head, "eagle3", read_target(str(tiny_model_dir)), tmp_path / "h", num_speculative_tokens=2
    )
    result = run_engine(tmp_path / "run", tokenizer, model=str(head_dir))
    assert_lossless_with_drafts(result, target_only, k=2)


def test_checkpoints_load_without_running_code(tmp_path, capsys):
    """A checkpoint is read with weights_only: a pickle that would run code is refused in
    one line, unread, and so is a file that is no checkpoint at all."""
    import pathlib

    from draftsmith.cli import main as cli_main

    marker = tmp_path / "ran"

    class Payload:  # unpickling it would create `marker`
        def __reduce__(self):
            return (pathlib.Path.touch, (marker,))

    torch.save({"state_dict": {}, "payload": Payload()}, tmp_path / "evil.ckpt")
    (tmp_path / "junk.ckpt").write_bytes(b"not a checkpoint at all")
    for name, said in (("evil.ckpt", "not plain tensors"),
                       ("junk.ckpt", "is not a whole torch file")):  # fmt: skip
        code = cli_main(["export", f"--checkpoint={tmp_path / name}", f"--output={tmp_path / 'o'}"])
        err = capsys.readouterr().err.strip()
        assert code == 2 and "\n" not in err and said in err, err
        assert err.startswith(f"draftsmith export: error: {tmp_path / name}: ")
    assert not marker.exists()
