"""`draftsmith convert`: EAGLE-3 and EAGLE-1 heads read from every published layout, written
for each consumer in its loader's names and config keys (no vLLM)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from draftsmith.cli import main as cli_main
from draftsmith.drafters import from_target_config
from draftsmith.drafters.eagle1.layouts import eagle1_layout, read_eagle1
from draftsmith.drafters.eagle1.layouts_write import write_eagle1
from draftsmith.drafters.eagle3.layouts import detect_layout, read_head
from draftsmith.drafters.eagle3.layouts_write import write_head
from draftsmith.drafters.headfiles.directory import HeadError
from draftsmith.drafters.headfiles.read import HeadFacts, read_head_files

DRAFT_VOCAB = 64
LAYER = [
    "input_layernorm.weight",
    "hidden_norm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "post_attention_layernorm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
]
TOP = {"fc.weight", "norm.weight", "lm_head.weight", "d2t"}
EXPECTED = {  # consumer -> (architecture, layer prefix, extra tensors, layout read back)
    "vllm": ("Eagle3LlamaForCausalLM", "midlayer.", set(), "draftsmith"),
    "sglang": ("LlamaForCausalLMEagle3", "midlayer.", {"t2d"}, "sglang"),
    "trtllm": ("LlamaForCausalLMEagle3", "midlayer.", set(), "modelopt"),
    "eagle": ("LlamaForCausalLM", "midlayer.", {"t2d"}, "eagle"),
    "speculators": ("Eagle3Speculator", "layers.0.", {"t2d"}, "speculators"),
}


def target_config(model_dir: Path) -> dict:
    return json.loads((model_dir / "config.json").read_text())


def random_head(model_dir: Path, seed: int = 0, **options):
    """A random EAGLE-3 head for the target, reduced vocabulary, random norms."""
    torch.manual_seed(seed)
    config = target_config(model_dir)
    options = {"draft_vocab_size": DRAFT_VOCAB, "num_layers": 1, **options}
    head = from_target_config(config, "eagle3", **options)
    if head.draft_vocab_size < head.vocab_size:
        ids = torch.randperm(config["vocab_size"])[: head.draft_vocab_size].sort().values
        head.set_draft_vocab(ids)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return head, config


def write(head, config, consumer, out, layer_ids=(2, 4, 5), dtype=torch.float32):
    head_, facts = head, _facts(list(layer_ids) if layer_ids else None)
    return write_head(head_, facts, consumer, out, config, verifier="tiny", dtype=dtype)


def _facts(ids):
    from draftsmith.drafters.eagle3.layouts import HeadFacts

    return HeadFacts(layout="draftsmith", source="test", layer_ids=ids)


def assert_same(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert set(sa) == set(sb)
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name
    assert torch.equal(a.t2d, b.t2d)


@pytest.mark.parametrize("consumer", list(EXPECTED))
def test_each_consumer_round_trips(tmp_path, tiny_model_dir, consumer):
    head, config = random_head(tiny_model_dir)
    out = write(head, config, consumer, tmp_path / consumer)
    arch, prefix, extra, layout = EXPECTED[consumer]
    written = json.loads((out / "config.json").read_text())
    names = set(load_file(out / "model.safetensors"))
    assert written["architectures"] == [arch]
    assert names == {prefix + n for n in LAYER} | TOP | extra
    assert written["draft_vocab_size"] == DRAFT_VOCAB
    assert written["target_hidden_size"] == config["hidden_size"]
    back, facts = read_head(out)
    assert facts.layout == layout == detect_layout(written, names)
    # SafeAILab EAGLE names no taps (its consumers use 2, N/2, N-3)
    assert facts.layer_ids == (None if consumer == "eagle" else [2, 4, 5])
    assert not facts.layer_ids_defaulted
    assert_same(head, back)


def test_consumer_config_keys(tmp_path, tiny_model_dir):
    head, config = random_head(tiny_model_dir)
    cfgs = {
        c: json.loads((write(head, config, c, tmp_path / c) / "config.json").read_text())
        for c in EXPECTED
    }
    assert cfgs["vllm"]["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [2, 4, 5]}
    assert cfgs["vllm"]["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert cfgs["sglang"]["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [2, 4, 5]}
    assert cfgs["trtllm"]["eagle_config"] == {
        "norm_before_fc": False,
        "return_hidden_post_norm": False,
        "eagle_aux_hidden_state_layer_ids": [2, 4, 5],
    }
    assert cfgs["trtllm"]["fc_norm"] is False and cfgs["trtllm"]["norm_output"] is False
    assert "eagle_config" not in cfgs["eagle"]
    assert "eagle_aux_hidden_state_layer_ids" not in cfgs["eagle"]
    spec = cfgs["speculators"]
    assert spec["speculators_model_type"] == "eagle3"
    assert spec["speculators_config"]["verifier"]["name_or_path"] == "tiny"
    assert spec["transformer_layer_config"]["hidden_size"] == config["hidden_size"]
    assert spec["norm_before_residual"] is False
    # vLLM tells the speculators format by a top level without model_type: the layer's
    # fields live in transformer_layer_config only.
    assert "model_type" not in spec and "hidden_size" not in spec
    for name, c in cfgs.items():
        layer = c["transformer_layer_config"] if name == "speculators" else c
        assert layer["tie_word_embeddings"] is False, name


def test_sglang_output_never_has_layers_0(tmp_path, tiny_model_dir):
    head, config = random_head(tiny_model_dir)
    # from the speculators layout (layers.0.*) to SGLang: renamed, never passed through
    src = write(head, config, "speculators", tmp_path / "src")
    back, facts = read_head(src)
    out = write_head(back, facts, "sglang", tmp_path / "sg", config, verifier="tiny")
    names = set(load_file(out / "model.safetensors"))
    assert not any(n.startswith("layers.") for n in names)
    assert {n for n in names if n.startswith("midlayer.")} == {"midlayer." + n for n in LAYER}


def test_full_vocabulary_writes_no_map_for_vllm(tmp_path, tiny_model_dir):
    head, config = random_head(tiny_model_dir, draft_vocab_size=None)
    out = write(head, config, "vllm", tmp_path / "v")
    assert "d2t" not in load_file(out / "model.safetensors")
    for consumer in EXPECTED:  # SafeAILab deletes both maps for a full vocabulary too
        out = write(head, config, consumer, tmp_path / consumer)
        names = set(load_file(out / "model.safetensors"))
        assert not names & {"d2t", "t2d"}, consumer
        assert_same(head, read_head(out)[0])


def test_modelopt_without_lm_head_takes_target_rows(tmp_path, tiny_model_dir):
    """ModelOpt: layers.0.*, eagle_config, no t2d, lm_head left to the target."""
    head, config = random_head(tiny_model_dir)
    out = write(head, config, "trtllm", tmp_path / "m")
    tensors = load_file(out / "model.safetensors")
    tensors = {k.replace("midlayer.", "layers.0."): v for k, v in tensors.items()}
    del tensors["lm_head.weight"]
    save_file(tensors, out / "model.safetensors")
    code = cli_main(
        ["convert", f"--head={out}", "--to=vllm", f"--output={tmp_path / 'v'}",
         f"--model={tiny_model_dir}", "--dtype=float32"]
    )  # fmt: skip
    assert code == 0
    back, facts = read_head(tmp_path / "v")
    from draftsmith.core.targets import read_target
    from draftsmith.drafters.target.weights import load_target_weights

    rows = load_target_weights(read_target(str(tiny_model_dir))).lm_head
    ids = head.draft_to_target(torch.arange(DRAFT_VOCAB))
    assert torch.equal(back.lm_head.weight, rows[ids].float())
    assert torch.equal(back.fc.weight, head.fc.weight)


def test_eagle_layout_gets_default_taps(tmp_path, tiny_model_dir, capsys):
    head, config = random_head(tiny_model_dir)
    src = write(head, config, "eagle", tmp_path / "eagle")
    out = tmp_path / "vllm"
    args = ["convert", f"--head={src}", "--to=vllm", f"--output={out}", "--dtype=float32"]
    assert cli_main(args) == 2  # no taps, no target
    assert "names no tapped layers" in capsys.readouterr().err
    assert cli_main([*args, f"--model={tiny_model_dir}"]) == 0
    printed = capsys.readouterr().out
    assert "vllm serve" in printed and str(out) in printed
    written = json.loads((out / "config.json").read_text())
    assert written["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]  # 2, N/2, N-3 of 8
    assert "(defaulted" in (out / "README.md").read_text()
    assert_same(head, read_head(out)[0])


def test_wrong_target_refused_in_one_line(tmp_path, tiny_model_dir, make_tiny_llama, capsys):
    head, config = random_head(tiny_model_dir)
    src = write(head, config, "vllm", tmp_path / "src")
    wide = make_tiny_llama(tmp_path / "wide", hidden_size=256, intermediate_size=512)
    out = tmp_path / "o"
    capsys.readouterr()
    code = cli_main(["convert", f"--head={src}", "--to=sglang", f"--output={out}",
                     f"--model={wide}"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "hidden size 256" in err and not out.exists()


def test_consumer_limits_refused(tmp_path, tiny_model_dir):
    head, config = random_head(tiny_model_dir, num_layers=2)
    for consumer in ("sglang", "trtllm", "eagle", "speculators"):
        with pytest.raises(HeadError, match="num_hidden_layers > 1"):
            write(head, config, consumer, tmp_path / consumer)
    write(head, config, "vllm", tmp_path / "vllm")  # vLLM builds every layer
    head, config = random_head(tiny_model_dir, fc_norm=True)
    with pytest.raises(HeadError, match="fc_norm"):
        write(head, config, "sglang", tmp_path / "sg")
    out = write(head, config, "trtllm", tmp_path / "trt")  # TensorRT-LLM reads fc_norm
    assert "fc_norm.0.weight" in load_file(out / "model.safetensors")
    assert_same(head, read_head(out)[0])
    head, config = random_head(tiny_model_dir)
    with pytest.raises(HeadError, match="SafeAILab EAGLE always taps"):
        write_head(head, _facts([1, 3, 6]), "eagle", tmp_path / "e", config, verifier="t")


def test_output_guard_and_rewrite(tmp_path, tiny_model_dir, capsys):
    head, config = random_head(tiny_model_dir)
    src = write(head, config, "vllm", tmp_path / "src")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    args = ["convert", f"--head={src}", "--to=sglang", f"--model={tiny_model_dir}"]
    assert cli_main([*args, f"--output={foreign}"]) == 2
    assert "not this command's output" in capsys.readouterr().err
    out = tmp_path / "sg"
    assert cli_main([*args, f"--output={out}"]) == 0
    assert "sglang.launch_server" in capsys.readouterr().out
    assert cli_main([*args, f"--output={out}"]) == 0  # its own output is replaced


def test_vllm_ascend_limits(tmp_path, tiny_model_dir, capsys):
    head, config = random_head(tiny_model_dir)
    src = write(head, config, "vllm", tmp_path / "src")
    args = ["convert", f"--head={src}", "--to=vllm-ascend", f"--model={tiny_model_dir}"]
    assert cli_main([*args, f"--output={tmp_path / 'a'}", "--num_speculative_tokens=16"]) == 2
    assert "num_speculative_tokens 16 + 1 > 16" in capsys.readouterr().err
    bad_tp = ["--tensor_parallel_size=4", "--draft_tensor_parallel_size=2"]
    assert cli_main([*args, f"--output={tmp_path / 'b'}", *bad_tp]) == 2
    assert "TP 1 or the target's (4)" in capsys.readouterr().err
    out = tmp_path / "c"
    ok = [
        "--num_speculative_tokens=15",
        "--tensor_parallel_size=4",
        "--draft_tensor_parallel_size=1",
    ]
    assert cli_main([*args, f"--output={out}", *ok]) == 0
    printed = capsys.readouterr().out
    assert '"draft_tensor_parallel_size": 1' in printed and "--tensor-parallel-size 4" in printed
    assert json.loads((out / "config.json").read_text())["architectures"] == [
        "Eagle3LlamaForCausalLM"
    ]


def test_shipped_embeddings_checked_against_target(tmp_path, tiny_model_dir, capsys):
    """SpecForge heads may ship embed_tokens: dropped when they are the target's, else refused."""
    from draftsmith.core.targets import read_target
    from draftsmith.drafters.target.weights import load_target_weights

    head, config = random_head(tiny_model_dir)
    embed = load_target_weights(read_target(str(tiny_model_dir))).embed
    src = write(head, config, "sglang", tmp_path / "sg")
    tensors = load_file(src / "model.safetensors")
    save_file({**tensors, "embed_tokens.weight": embed.half()}, src / "model.safetensors")
    args = ["convert", f"--head={src}", "--to=vllm", f"--model={tiny_model_dir}"]
    assert cli_main([*args, f"--output={tmp_path / 'a'}", "--dtype=float32"]) == 0
    assert "equal to the target's" in (tmp_path / "a" / "README.md").read_text()
    assert "embed_tokens.weight" not in load_file(tmp_path / "a" / "model.safetensors")
    assert_same(head, read_head(tmp_path / "a")[0])
    save_file({**tensors, "embed_tokens.weight": embed + 1}, src / "model.safetensors")
    capsys.readouterr()
    assert cli_main([*args, f"--output={tmp_path / 'b'}"]) == 2
    assert "embed_tokens that differ" in capsys.readouterr().err


def test_peagle_head_round_trips_to_vllm_only(tmp_path, tiny_model_dir):
    head, config = random_head(tiny_model_dir, parallel_drafting=True, mask_token_id=7)
    out = write(head, config, "vllm", tmp_path / "v")
    written = json.loads((out / "config.json").read_text())
    assert written["speculators_model_type"] == "peagle" and written["mask_token_id"] == 7
    back, facts = read_head(out)
    assert facts.layout == "draftsmith" and back.mask_token_id == 7
    assert_same(head, back)
    with pytest.raises(HeadError, match="parallel_drafting"):
        write(head, config, "sglang", tmp_path / "s")


def test_eagle3_reader_refuses_eagle1_and_unknown_layouts(tmp_path):
    names = {"layers.0.self_attn.q_proj.weight", "fc.weight"}
    with pytest.raises(HeadError, match="EAGLE-1"):  # model.init_from reads EAGLE-3 only
        detect_layout({"architectures": ["LlamaForCausalLM"]}, names)
    assert eagle1_layout({"architectures": ["LlamaForCausalLM"]}, names) == "eagle"
    with pytest.raises(HeadError, match="no EAGLE-3 layout"):
        detect_layout({"architectures": ["MedusaModel"]}, names)
    assert eagle1_layout({"architectures": ["MedusaModel"]}, names) is None


def test_init_from_fine_tunes_a_published_head(tmp_path, tiny_model_dir, tiny_dataset, capsys):
    """``model.init_from``: a head in the SafeAILab EAGLE layout (no taps in its config: the
    target's default ones) is the starting point: its vocabulary and weights are kept (a
    vanishing learning rate leaves them as published), the checkpoint and the model card say
    where it came from, and a head that does not fit is refused in one line."""
    from draftsmith.cli import main as cli_main
    from draftsmith.train.checkpoints import read_checkpoint
    from draftsmith.train.main import main as train_main

    head, config = random_head(tiny_model_dir)
    published = write(head, config, "eagle", tmp_path / "published")
    tiny = Path(__file__).resolve().parents[1] / "configs" / "train" / "tiny.yaml"
    out = tmp_path / "run"
    args = ["fit", f"--config={tiny}", f"--data.data={tiny_dataset}", "--trainer.max_epochs=1"]
    args += ["--model.draft_vocab_size=null"]  # tiny.yaml asks 2048: the head has its own
    args += [f"--trainer.default_root_dir={out}", f"--checkpoint.dirpath={out / 'ckpt'}"]
    assert train_main([*args, f"--model.init_from={published}", "--model.lr=1e-30"]) == 0
    ckpt = read_checkpoint(out / "ckpt" / "last.ckpt")
    assert ckpt["draftsmith"]["init_from"]["layout"] == "eagle"
    trained = {k[5:]: v for k, v in ckpt["state_dict"].items() if k.startswith("head.")}
    for name, value in head.state_dict().items():
        if name in trained:  # embed_tokens and t2d are not saved
            torch.testing.assert_close(trained[name], value, rtol=0, atol=1e-6, msg=name)
    exported = tmp_path / "head"
    ckpt_arg = f"--checkpoint={out / 'ckpt' / 'last.ckpt'}"
    assert cli_main(["export", ckpt_arg, f"--output={exported}"]) == 0
    assert "Started from" in (exported / "README.md").read_text()

    other = write(head, config, "vllm", tmp_path / "other", layer_ids=(1, 3, 5))
    capsys.readouterr()
    assert train_main([*args, f"--model.init_from={other}", "--trainer.fast_dev_run=true"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1 and "taps layers [1, 3, 5], the dataset feeds [2, 4, 5]" in errors[0]


# ----- EAGLE-1 -------------------------------------------------------------------------------
EAGLE1 = {  # consumer -> (architecture, layout read back)
    "vllm": ("EagleLlamaForCausalLM", "draftsmith"),
    "sglang": ("LlamaForCausalLMEagle", "sglang"),
    "eagle": ("LlamaForCausalLM", "eagle"),
}
E1_LAYER = [n for n in LAYER if n not in ("hidden_norm.weight", "input_layernorm.weight")]


def random_eagle1(model_dir: Path, seed: int = 0, **options):
    """A random two-layer EAGLE-1 head for the target, random norms and biases."""
    torch.manual_seed(seed)
    config = target_config(model_dir)
    head = from_target_config(config, "eagle", **{"num_layers": 2, **options})
    with torch.no_grad():
        for name, p in head.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
    return head, config


def write1(head, config, consumer, out, dtype=torch.float32):
    facts = HeadFacts(layout="draftsmith", source="test", layer_ids=None, kind="EAGLE-1")
    return write_eagle1(head, facts, consumer, out, config, verifier="tiny", dtype=dtype)


def read1(head_dir: Path):
    return read_eagle1(head_dir, read_head_files(head_dir))


def assert_same1(a, b, skip=()):
    sa, sb = a.state_dict(), b.state_dict()
    assert set(sa) - set(skip) == set(sb) - set(skip)
    for name in set(sa) - set(skip):
        assert torch.equal(sa[name], sb[name]), name


def e1_names(num_layers: int = 2) -> set[str]:
    names = {"fc.weight"} | {f"layers.0.{n}" for n in E1_LAYER}
    for i in range(1, num_layers):
        names |= {f"layers.{i}.{n}" for n in E1_LAYER} | {f"layers.{i}.input_layernorm.weight"}
    return names


@pytest.mark.parametrize("consumer", list(EAGLE1))
def test_eagle1_each_consumer_round_trips(tmp_path, tiny_model_dir, consumer):
    head, config = random_eagle1(tiny_model_dir)
    out = write1(head, config, consumer, tmp_path / consumer)
    written = json.loads((out / "config.json").read_text())
    names = set(load_file(out / "model.safetensors"))
    arch, layout = EAGLE1[consumer]
    assert written["architectures"] == [arch]
    # SGLang always builds fc with a bias: zeros are written for a head without one
    assert names == e1_names() | ({"fc.bias"} if consumer == "sglang" else set())
    # SafeAILab reads a config without `bias` as an fc bias; SGLang and vLLM as attention biases
    assert written.get("bias") is (False if consumer == "eagle" else None)
    if consumer != "vllm":  # EAGLE-3 keys (eval tells SafeAILab EAGLE-3 heads by one)
        assert "draft_vocab_size" not in written and "target_hidden_size" not in written
    back, facts = read1(out)
    assert facts.layout == layout == eagle1_layout(written, names)
    assert_same1(head, back, skip={"fc.bias"})
    assert back.fc.bias is None or not back.fc.bias.any()


def published_safeailab_head(tmp_path, model_dir, **config_extra):
    """A head as SafeAILab publishes EAGLE-1: pytorch_model.bin with fc.bias, a copy of the
    target's embed_tokens and a rotary buffer; a config without `bias` (true)."""
    from draftsmith.core.targets import read_target
    from draftsmith.drafters.target.weights import load_target_weights

    head, config = random_eagle1(model_dir, num_layers=1, fc_bias=True)
    head.set_embeddings(load_target_weights(read_target(str(model_dir))).embed)
    keep = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
            "rms_norm_eps", "vocab_size", "max_position_embeddings", "hidden_act")  # fmt: skip
    published = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                 "num_hidden_layers": 1, **{k: config[k] for k in keep}}  # fmt: skip
    published.update(config_extra)
    state = {**head.state_dict(), "embed_tokens.weight": head.embed_tokens.clone()}
    state["layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(32)
    out = tmp_path / "published"
    out.mkdir()
    torch.save(state, out / "pytorch_model.bin")
    (out / "config.json").write_text(json.dumps(published))
    return head, out


def test_eagle1_published_head_to_vllm_folds_its_fc_bias(tmp_path, tiny_model_dir, capsys):
    """vLLM's EAGLE-1 fc has no bias (and skips one silently): convert folds SafeAILab's into
    the first layer's attention biases, and the folded head drafts the same states."""
    head, src = published_safeailab_head(tmp_path, tiny_model_dir)
    out = tmp_path / "v"
    args = ["convert", f"--head={src}", f"--model={tiny_model_dir}", "--dtype=float32"]
    assert cli_main([*args, "--to=vllm", f"--output={out}"]) == 0
    assert "EAGLE-1 eagle head -> vllm" in capsys.readouterr().out
    card = (out / "README.md").read_text()
    assert "folded" in card and "embed_tokens dropped: equal to the target's" in card
    written = json.loads((out / "config.json").read_text())
    assert written["architectures"] == ["EagleLlamaForCausalLM"] and written["attention_bias"]
    names = set(load_file(out / "model.safetensors"))
    assert "fc.bias" not in names and "embed_tokens.weight" not in names
    folded, facts = read1(out)
    assert facts.layout == "draftsmith" and folded.fc.bias is None
    folded.set_embeddings(head.embed_tokens)
    torch.manual_seed(1)
    ids, states = torch.randint(0, head.vocab_size, (2, 9)), torch.randn(2, 9, head.hidden_size)
    positions = torch.arange(9).expand(2, 9)
    with torch.no_grad():
        want, got = head(ids, states, positions)[0], folded(ids, states, positions)[0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # back to SafeAILab's own layout the bias is kept as it is
    eagle = tmp_path / "e"
    assert cli_main(["convert", f"--head={src}", "--to=eagle", f"--output={eagle}"]) == 0
    assert "bias" not in json.loads((eagle / "config.json").read_text())  # true: fc has one
    assert "embed_tokens dropped unchecked" in (eagle / "README.md").read_text()
    back, _ = read1(eagle)
    assert_same1(head, back)


def test_eagle1_qkv_bias_head(tmp_path, tiny_model_dir):
    """SafeAILab's qkv_bias: q/k/v biases, none on o_proj (read as a zero one)."""
    head, src = published_safeailab_head(tmp_path, tiny_model_dir, qkv_bias=True, bias=False)
    state = torch.load(src / "pytorch_model.bin")
    del state["fc.bias"]  # `bias: false`: SafeAILab never loads it; convert drops it
    for p in ("q", "k", "v"):
        w = state[f"layers.0.self_attn.{p}_proj.weight"]
        state[f"layers.0.self_attn.{p}_proj.bias"] = torch.randn(w.shape[0])
    torch.save(state, src / "pytorch_model.bin")
    back, facts = read1(src)
    assert back.init_kwargs["attention_bias"] and back.fc.bias is None
    assert not back.layers[0].self_attn.o_proj.bias.any()
    out = write1(back, target_config(tiny_model_dir), "eagle", tmp_path / "e")
    written = json.loads((out / "config.json").read_text())
    assert written["qkv_bias"] is True and written["attention_bias"] is False
    assert written["bias"] is False
    assert not any(n.endswith("o_proj.bias") for n in load_file(out / "model.safetensors"))
    assert_same1(back, read1(out)[0])


def test_eagle1_linear_rope_in_safeailab_keys(tmp_path, tiny_model_dir):
    """cnets1.py reads rope_scaling["type"] (default, linear or dynamic); other ropes refused."""
    linear = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    config = {**target_config(tiny_model_dir), "rope_parameters": linear}
    head = from_target_config(config, "eagle")
    out = write1(head, config, "eagle", tmp_path / "e")
    written = json.loads((out / "config.json").read_text())
    assert written["rope_scaling"]["type"] == "linear" and written["rope_scaling"]["factor"] == 2
    back, _ = read1(out)
    assert back.init_kwargs["rope_scaling"] == head.init_kwargs["rope_scaling"]
    assert_same1(head, back)
    yarn = {**config, "rope_parameters": {**linear, "rope_type": "yarn",
                                          "original_max_position_embeddings": 1024}}  # fmt: skip
    with pytest.raises(HeadError, match="yarn rope"):
        write1(from_target_config(yarn, "eagle"), yarn, "eagle", tmp_path / "y")


def test_eagle1_refused_in_one_line(tmp_path, tiny_model_dir, make_tiny_llama, capsys):
    head, config = random_eagle1(tiny_model_dir)
    src = write1(head, config, "vllm", tmp_path / "src")
    base = ["convert", f"--head={src}", f"--model={tiny_model_dir}"]

    def refused(*args: str) -> str:
        capsys.readouterr()
        assert cli_main([*args, f"--output={tmp_path / 'o'}"]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and not (tmp_path / "o").exists(), err
        return err

    for consumer in ("trtllm", "speculators", "vllm-ascend"):
        assert "use --to vllm" in refused(*base, f"--to={consumer}")
    wide = make_tiny_llama(tmp_path / "wide", hidden_size=256, intermediate_size=512)
    assert "hidden size 256" in refused("convert", f"--head={src}", f"--model={wide}", "--to=eagle")
    tensors = load_file(src / "model.safetensors")
    save_file({k: v for k, v in tensors.items() if "up_proj" not in k}, src / "model.safetensors")
    assert "layers.0.mlp.up_proj.weight" in refused(*base, "--to=eagle")
    save_file({**tensors, "fc.weight": torch.zeros(128, 384)}, src / "model.safetensors")
    assert "fc.weight is [128, 384]" in refused(*base, "--to=eagle")
    save_file(tensors, src / "model.safetensors")
    edited = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**edited, "vocab_size": 1000}))
    assert "vocabulary of 1000 ids" in refused(*base, "--to=eagle")
    narrow, config = random_eagle1(tiny_model_dir, head_dim=32)  # cnets1: hidden // heads = 64
    with pytest.raises(HeadError, match="head_dim 32"):
        write1(narrow, config, "eagle", tmp_path / "n")


def test_eagle1_safeailab_layout_serves_with_method_eagle(tmp_path, tiny_model_dir):
    """eval serves a SafeAILab EAGLE-1 directory with an explicit --method eagle; it never
    guesses it (a whole Llama model reads the same), and refuses a directory with no EAGLE-1
    fc."""
    from draftsmith.core.targets import read_target
    from draftsmith.evaluate.checks import check_head, head_method

    head, config = random_eagle1(tiny_model_dir)
    out = write1(head, config, "eagle", tmp_path / "e")
    target = read_target(str(tiny_model_dir))
    assert check_head(str(out), "eagle", target)["architectures"] == ["LlamaForCausalLM"]
    with pytest.raises(HeadError, match="give --method"):
        head_method(str(out))
    with pytest.raises(HeadError, match="fc.weight is None"):
        check_head(str(tiny_model_dir), "eagle", target)
