"""DSpark drafters: the valid prefix and teacher forcing, the three-term loss by hand, the
served walk, the refusal of targets vLLM has no DSpark drafter for, a tiny run through the
train CLI whose loss falls, and the export read by vLLM's own ``Qwen3DSparkForCausalLM``
(built on CPU: every tensor consumed, the same logits and confidences)."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from helpers import CachedContextAttention, fit_then_validate

from draftsmith.core.errors import ConfigError
from draftsmith.drafters.attention.block_layout import block_mask
from draftsmith.drafters.dspark import DSpark, check_target
from draftsmith.drafters.dspark.blocks import position_weights, slot_targets
from draftsmith.drafters.dspark.export import dspark_config, dspark_tensors
from draftsmith.drafters.dspark.model import DSparkDrafter
from draftsmith.drafters.dspark.objective import block_objective, walk_blocks
from draftsmith.drafters.dspark.options import DSparkOptions

V, H = 50, 128


def tiny_drafter(**kw) -> DSparkDrafter:
    options = dict(hidden_size=H, num_heads=2, num_kv_heads=1, head_dim=64, intermediate_size=256,
                   vocab_size=V, target_layer_ids=[1, 3, 4], mask_token_id=V - 1, block_size=3,
                   markov_rank=8)  # fmt: skip
    return DSparkDrafter(**{**options, **kw})


def test_slot_targets_valid_prefix_and_teacher_forcing():
    # One row: doc 0 = 0..6 (prompt 0..1, a hole in the response at 4), doc 1 = 7..9.
    doc_ids = torch.tensor([[0] * 7 + [1] * 3])
    loss_mask = torch.tensor([[0, 0, 1, 1, 0, 1, 1, 0, 1, 1]], dtype=torch.bool)
    input_ids = torch.arange(100, 110)[None]
    anchors, keep = torch.tensor([[2, 5, 8]]), torch.tensor([[True, True, True]])
    valid, prev_row, true_ids = slot_targets(anchors, keep, input_ids, loss_mask, doc_ids, 3)
    # Anchor 2: slot 0 -> 3 (scored), slot 1 -> 4 (hole), slot 2 -> 5 scored but after the
    # hole: only the prefix counts. Anchor 5: 6, then 7 is doc 1. Anchor 8: 9, then off the row.
    assert valid.int().tolist() == [[[1, 0, 0], [1, 0, 0], [1, 0, 0]]]
    # Slot i's Markov input and teacher row: position a + i (slot 0: the anchor itself).
    assert prev_row.tolist() == [[[2, 3, 4], [5, 6, 7], [8, 9, 9]]]
    assert true_ids.tolist() == [[[103, 0, 0], [106, 0, 0], [109, 0, 0]]]
    mask = block_mask(torch.tensor([[5]]), torch.tensor([[True]]), doc_ids, 2)
    assert mask[0, 0].int().tolist() == [[1] * 5 + [0] * 5 + [1, 1]] * 2  # doc 0 before 5


def hand_setup(seed: int = 0):
    torch.manual_seed(seed)
    head = tiny_drafter()
    with torch.no_grad():
        head.markov_head.markov_w2.weight.normal_(0, 0.5)
        head.markov_head.markov_w1.weight.normal_(0, 0.5)
    lm_head = torch.randn(V, H)
    t = 8
    teacher = torch.randn(1, t, H)
    input_ids = torch.randint(0, V, (1, t))
    loss_mask = torch.tensor([[0, 1, 1, 1, 1, 1, 0, 0]], dtype=torch.bool)
    doc_ids = torch.zeros(1, t, dtype=torch.long)
    anchors, keep = torch.tensor([[1, 4]]), torch.tensor([[True, True]])
    valid, prev_row, true_ids = slot_targets(anchors, keep, input_ids, loss_mask, doc_ids, 3)
    states = torch.randn(1, 2, 3, H, requires_grad=True)
    return head, lm_head, teacher, input_ids, valid, prev_row, true_ids, states


def test_loss_by_hand_weights_prefix_and_teacher_forcing():
    head, lm_head, teacher, input_ids, valid, prev_row, true_ids, states = hand_setup()
    # Anchor 1: slots -> 2, 3, 4 all scored; anchor 4: slot 0 -> 5, slot 1 -> 6 unscored.
    assert valid.int().tolist() == [[[1, 1, 1], [1, 0, 0]]]
    opt = DSparkOptions(block_size=3, loss_chunk_size=2)  # chunks split the 4 slots
    out, correct = block_objective(head, lm_head, states, teacher, input_ids, valid, prev_row,
                                   true_ids, opt)  # fmt: skip
    w = [math.exp(-i / 4.0) for i in range(3)]
    assert position_weights(3, 4.0).tolist() == pytest.approx(w)
    terms, weights = [], []
    for j, i in [(0, 0), (0, 1), (0, 2), (1, 0)]:  # (block, slot)
        a = [1, 4][j]
        prev = input_ids[0, a + i]  # the TRUE token before the predicted one
        h = states[0, j, i]
        logits = h @ lm_head.T + head.markov_head.markov_w2(head.markov_head.markov_w1(prev))
        p = F.softmax(teacher[0, a + i] @ lm_head.T, -1)
        ce = F.cross_entropy(logits[None], input_ids[0, a + i + 1][None])
        tv = 0.5 * (F.softmax(logits, -1) - p).abs().sum()
        conf = head.confidence_head.proj(torch.cat([h, head.markov_head.markov_w1(prev)]))[0]
        bce = F.binary_cross_entropy_with_logits(conf, (1 - tv).detach())
        terms.append(0.1 * ce + 0.9 * tv + 1.0 * bce)
        weights.append(w[i])
    expected = sum(t * x for t, x in zip(terms, weights, strict=True)) / sum(weights)
    assert out.loss.item() == pytest.approx(expected.item(), rel=1e-5)
    assert out.step_count.tolist() == [2, 1, 1]
    assert out.step_loss[0].item() == pytest.approx((terms[0] + terms[3]).item() / 2, rel=1e-5)
    params = [states, head.markov_head.markov_w2.weight, head.confidence_head.proj.weight]
    got = torch.autograd.grad(out.loss, params)
    ref = torch.autograd.grad(expected, params)
    for g, r in zip(got, ref, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-6)
    # Teacher forcing: the loss reads the true previous token, not the Markov of anything else.
    other = input_ids.clone()
    other[0, 3] = (other[0, 3] + 1) % V  # slot 1 of block 0 predicts 3, slot 2 reads it
    out2, _ = block_objective(head, lm_head, states, teacher, other, valid, prev_row,
                              true_ids, opt)  # fmt: skip
    assert out2.loss.item() != pytest.approx(out.loss.item())
    assert correct.shape == (1, 2, 3) and not correct[0, 1, 1:].any()  # unscored stay false


def test_served_walk_drafts_with_the_previous_draft():
    """T = 0: each slot's Markov input is the previous ARGMAX draft (anchor first); drafts
    count while they equal the target's argmax and the slot is valid."""
    head, lm_head, teacher, input_ids, valid, prev_row, _, states = hand_setup(1)
    anchors = torch.tensor([[1, 4]])
    anchor_ids = input_ids.gather(1, anchors)
    s = states.detach()
    got = walk_blocks(head, lm_head, s, teacher, anchor_ids, valid, prev_row, 0.0)
    expected = []
    for j, a in enumerate([1, 4]):
        prev, m = anchor_ids[0, j], 0
        for i in range(3):
            draft = head.logits(s[0, j, i], prev, lm_head).argmax()
            if not (valid[0, j, i] and draft == (teacher[0, a + i] @ lm_head.T).argmax()):
                break
            m, prev = m + 1, draft
        expected.append(m)
    assert got.tolist() == [expected]
    # A drafter equal to the teacher (no Markov bias) has every valid slot accepted.
    with torch.no_grad():
        head.markov_head.markov_w2.weight.zero_()
    right = torch.stack([teacher[0, a : a + 3] for a in (1, 4)])[None]
    assert walk_blocks(head, lm_head, right, teacher, anchor_ids, valid, prev_row, 0.0).tolist() \
        == [[3, 1]]  # fmt: skip
    g = torch.Generator().manual_seed(0)
    t1 = walk_blocks(head, lm_head, right, teacher, anchor_ids, valid, prev_row, 1.0, g)
    assert t1.tolist() == [[3, 1]]  # p == q: rejection sampling accepts every draft


def target_info(arch: str) -> SimpleNamespace:
    return SimpleNamespace(architecture=arch, num_hidden_layers=8, hidden_size=H, path="t")


def test_targets_without_a_vllm_dspark_class_are_refused():
    check_target(target_info("Qwen3ForCausalLM"))
    with pytest.raises(ConfigError) as err:
        DSpark(DSparkOptions()).build(target_info("LlamaForCausalLM"), None, None)
    msg = str(err.value)
    assert "\n" not in msg and "model.kind dspark" in msg
    assert "LlamaForCausalLM" in msg and "Qwen3ForCausalLM" in msg
    with pytest.raises(ConfigError, match="Gemma4DSparkModel"):
        check_target(target_info("Gemma4ForConditionalGeneration"))
    with pytest.raises(ConfigError, match="model.markov_rank"):
        DSpark(DSparkOptions(markov_rank=0))
    # simulate_only trains past the check; the head is still refused at export
    with pytest.raises(AttributeError):  # None data: the build got past the target check
        DSpark(DSparkOptions(simulate_only=True)).build(target_info("LlamaForCausalLM"), None, None)
    with pytest.raises(ConfigError, match="LlamaForCausalLM"):
        DSpark.export(tiny_drafter(), target_info("LlamaForCausalLM"), Path("/nonexistent"))


def test_export_config_and_names():
    head = tiny_drafter()
    target = {"architectures": ["Qwen3ForCausalLM"], "hidden_size": H, "vocab_size": V,
              "num_hidden_layers": 8, "max_position_embeddings": 512}  # fmt: skip
    config = dspark_config(head, target)
    assert config["architectures"] == ["Qwen3DSparkModel"] and config["model_type"] == "qwen3"
    want = {"target_layer_ids": [1, 3, 4], "mask_token_id": V - 1, "block_size": 3,
            "markov_rank": 8, "enable_confidence_head": True, "confidence_head_with_markov": True,
            "sample_from_anchor": True, "draft_vocab_size": V}  # fmt: skip
    assert {k: config[k] for k in want} == want
    assert "dflash_config" not in config and "eagle_aux_hidden_state_layer_ids" not in config
    tensors = dspark_tensors(head, torch.bfloat16)
    assert tensors["markov_head.markov_w1.weight"].shape == (V, 8)
    assert tensors["markov_head.markov_w2.weight"].shape == (V, 8)
    assert tensors["confidence_head.proj.weight"].shape == (1, H + 8)
    assert tensors["confidence_head.proj.bias"].dtype == torch.float32  # vLLM keeps it fp32
    assert not any("embed" in n or "lm_head" in n or "mask" in n for n in tensors)


# ----- vLLM's own module, built on CPU --------------------------------------------------
def vllm_dspark(head_dir: Path, target_dir: Path, k: int, shipped: frozenset = frozenset()):
    """vLLM's ``Qwen3DSparkForCausalLM`` for ``head_dir``, its weights loaded by its own
    ``load_weights`` and the target's embeddings / lm_head shared as ``load_dspark_model``
    shares them (``shipped``: the ones the files hold themselves). VllmConfig refuses
    ``method: dspark`` on this build (the V1 runner lacks it; the V2 runner needs Triton), so
    the SpeculativeConfig vLLM built and checked is attached after the VllmConfig; the module
    itself is vLLM's, unchanged."""
    import tempfile

    from safetensors.torch import load_file
    from vllm.config import (
        CompilationConfig,
        DeviceConfig,
        ModelConfig,
        ParallelConfig,
        SpeculativeConfig,
        VllmConfig,
        set_current_vllm_config,
    )
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.distributed.parallel_state import model_parallel_is_initialized
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.model_executor.models.qwen3_dspark import Qwen3DSparkForCausalLM

    target = ModelConfig(model=str(target_dir), dtype="float32", enforce_eager=True)
    spec = SpeculativeConfig(method="dspark", model=str(head_dir), num_speculative_tokens=k,
                             target_model_config=target,
                             target_parallel_config=ParallelConfig())  # fmt: skip
    config = VllmConfig(model_config=target, device_config=DeviceConfig("cpu"),
                        compilation_config=CompilationConfig(mode=0))  # fmt: skip
    config.speculative_config = spec
    with set_current_vllm_config(config):
        if not model_parallel_is_initialized():
            init_distributed_environment(1, 0, f"file://{tempfile.mktemp()}", 0, "gloo")
            initialize_model_parallel(1, 1)
        model = Qwen3DSparkForCausalLM(vllm_config=config, prefix="draft")
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float("nan"))
        model.load_weights(load_file(head_dir / "model.safetensors").items())  # refuses extras
        unloaded = {n for n, p in model.named_parameters() if not torch.isfinite(p).all()}
        # Shared from the target at serving time; the mask embedding is an unused placeholder.
        shared = {"model.embed_tokens.weight", "lm_head.weight"} - shipped
        assert unloaded == shared | {"model.mask_embedding"}
        weights = load_file(target_dir / "model.safetensors")
        embed = weights["model.embed_tokens.weight"]
        with torch.no_grad():
            model.model.embed_tokens.weight.copy_(embed)
            model.lm_head.weight.copy_(weights.get("lm_head.weight", embed))
        process_weights_after_loading(model, target, torch.device("cpu"))
    return model, config, embed


def assert_vllm_matches(
    head: DSparkDrafter, head_dir: Path, target_dir: Path, shipped: frozenset = frozenset()
) -> None:
    """One block at anchor a = T after T context tokens, through vLLM's module and ours."""
    from vllm.config import set_current_vllm_config

    bs = head.block_size
    model, config, embed = vllm_dspark(head_dir, target_dir, bs, shipped)
    head.set_embeddings(embed)
    g = torch.Generator().manual_seed(0)
    t, n_ctx = 12, len(head.target_layer_ids)
    aux = torch.randn(t, n_ctx * head.hidden_size, generator=g)
    block = torch.tensor([7] + [head.mask_token_id] * (bs - 1))
    positions, ctx_positions = torch.arange(t, t + bs), torch.arange(t)
    prev = torch.randint(0, head.vocab_size, (bs,), generator=g)
    kv = {}
    with set_current_vllm_config(config), torch.no_grad():
        for i, attn in enumerate(model.model._attn_layers):  # capture the cache writes
            attn.impl.do_kv_cache_update = lambda _l, k, v, _c, _s, i=i: kv.__setitem__(i, (k, v))
        model.precompute_and_store_context_kv(model.combine_hidden_states(aux), ctx_positions,
                                              torch.arange(t))  # fmt: skip
        for i, layer in enumerate(model.model.layers):
            layer.self_attn.attn = CachedContextAttention(kv[i], layer.self_attn)
        hidden = model(block, positions)
        markov = model.markov_embed(prev)
        logits = model.compute_draft_logits(hidden) + model.markov_bias(markov)
        confidence = model.compute_confidence(hidden, markov)
        mask = torch.ones(1, 1, bs, t + bs, dtype=torch.bool)
        ours = head(block[None], positions[None], aux[None], ctx_positions[None], mask)[0]
        our_logits = head.logits(ours, prev, embed)
        our_confidence = head.confidence_logit(ours, prev).sigmoid()
    torch.testing.assert_close(hidden, ours, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(logits, our_logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(confidence, our_confidence, rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def qwen3_target(tmp_path_factory, make_tiny_target):
    """A tiny Qwen3 with peaked next-token distributions (learnable by a tiny drafter)."""
    return make_tiny_target(tmp_path_factory.mktemp("qwen3") / "qwen3", "qwen3", seed=1,
                            norm_scale=8.0)  # fmt: skip


def random_head(target) -> DSparkDrafter:
    head = DSpark.head_from_target(target.config, target_layer_ids=[1, 3, 4], mask_token_id=5,
                                   block_size=4, markov_rank=16)  # fmt: skip
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0.0, 0.05)
    return head


@pytest.mark.vllm
@pytest.mark.parametrize("to", ["vllm", "speculators"])
def test_export_loads_into_vllms_dspark_module_with_equal_logits(tmp_path, qwen3_target, to):
    """Either layout: vLLM reads the speculators one through its own ``update_dspark``."""
    pytest.importorskip("vllm")
    from draftsmith.core.targets import read_target

    target = read_target(str(qwen3_target))
    head = random_head(target)
    head_dir = DSpark.export(head, target, tmp_path / "head", to=to)
    shipped = frozenset({"model.embed_tokens.weight", "lm_head.weight"} if to != "vllm" else ())
    assert_vllm_matches(head, head_dir, qwen3_target, shipped)


# ----- the speculators layout --------------------------------------------------------------
# Field and tensor names read from vllm-project/speculators at commit c05b95b3 (main,
# 2026-08-20): src/speculators/models/dspark/config.py (DSparkSpeculatorConfig),
# models/dflash/config.py (the DFlash fields it inherits), models/dspark/core.py and
# model_definitions.py (markov_head.markov_w{1,2}, confidence_head.proj), models/dflash/core.py
# (fc, hidden_norm, norm, layers.*; _keys_to_ignore_on_save drops verifier_lm_head and
# verifier_norm) and model.py (DraftVocabMixin: embed_tokens, lm_head). speculators is not
# installed here, so its classes cannot load the files.
SPECULATORS_DSPARK_KEYS = {
    "architectures", "speculators_model_type", "speculators_config", "transformer_layer_config",
    "draft_vocab_size", "block_size", "target_hidden_size", "aux_hidden_state_layer_ids",
    "mask_token_id", "sliding_window_non_causal", "sample_from_anchor", "markov_rank",
    "markov_head_type", "enable_confidence_head", "confidence_head_with_markov", "torch_dtype",
}  # fmt: skip
SPECULATORS_LAYER_NAMES = [
    "input_layernorm.weight", "post_attention_layernorm.weight", "mlp.gate_proj.weight",
    "mlp.up_proj.weight", "mlp.down_proj.weight", "self_attn.q_proj.weight",
    "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
    "self_attn.q_norm.weight", "self_attn.k_norm.weight",
]  # fmt: skip


def test_speculators_export_names_and_round_trip(tmp_path, qwen3_target):
    from safetensors.torch import load_file

    from draftsmith.core.targets import read_target
    from draftsmith.drafters.dspark.speculators import read_speculators
    from draftsmith.drafters.headfiles.directory import HeadError

    target = read_target(str(qwen3_target))
    head = random_head(target)
    head_dir = DSpark.export(head, target, tmp_path / "head", to="speculators")
    config = json.loads((head_dir / "config.json").read_text())
    assert set(config) == SPECULATORS_DSPARK_KEYS  # no model_type: vLLM reads it as speculators
    assert config["architectures"] == ["DSparkSpeculator"]
    assert config["speculators_model_type"] == config["speculators_config"]["algorithm"] == "dspark"
    assert config["aux_hidden_state_layer_ids"] == [2, 4, 5]  # target_layer_ids + 1
    assert config["sample_from_anchor"] is True and config["markov_head_type"] == "vanilla"
    proposal = config["speculators_config"]["proposal_methods"][0]
    assert proposal == {"proposal_type": "greedy", "speculative_tokens": 4}  # block_size
    assert config["speculators_config"]["verifier"]["name_or_path"] == str(qwen3_target)
    layer = config["transformer_layer_config"]
    assert layer["model_type"] == "qwen3" and layer["num_hidden_layers"] == 1
    tensors = load_file(head_dir / "model.safetensors")
    names = {"fc.weight", "hidden_norm.weight", "norm.weight", "embed_tokens.weight",
             "lm_head.weight", "markov_head.markov_w1.weight", "markov_head.markov_w2.weight",
             "confidence_head.proj.weight", "confidence_head.proj.bias",
             *(f"layers.0.{n}" for n in SPECULATORS_LAYER_NAMES)}  # fmt: skip
    assert set(tensors) == names
    target_weights = load_file(qwen3_target / "model.safetensors")
    embed = target_weights["model.embed_tokens.weight"]
    assert torch.equal(tensors["embed_tokens.weight"], embed.float())
    assert torch.equal(
        tensors["lm_head.weight"], target_weights.get("lm_head.weight", embed).float()
    )
    assert "speculators" in (head_dir / "README.md").read_text()
    assert DSpark.method_of(config) == "dspark"
    assert (
        DSpark.serve_hint(head_dir, config) == f"vllm serve {head_dir}  (GPU only: V2 model runner)"
    )

    # read back: the same drafter, the same tensors
    back, shared = read_speculators(head_dir)
    assert set(shared) == {"embed_tokens.weight", "lm_head.weight"}
    assert {k: back.init_kwargs[k] for k in ("target_layer_ids", "mask_token_id", "block_size",
            "markov_rank", "num_layers", "hidden_size")} == {k: head.init_kwargs[k] for k in (
            "target_layer_ids", "mask_token_id", "block_size", "markov_rank", "num_layers",
            "hidden_size")}  # fmt: skip
    ours, theirs = head.state_dict(), back.state_dict()
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name

    config["markov_head_type"] = "gated"  # speculators' other heads are not built here
    (head_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(HeadError, match="markov_head_type 'gated'"):
        read_speculators(head_dir)


def test_vllm_reads_the_speculators_config_as_the_vllm_layout(tmp_path, qwen3_target):
    """vLLM's own speculators conversion (``update_dspark``) of the speculators config gives
    the fields of the vLLM layout's config, and ``vllm serve DIR`` drafts the whole block."""
    pytest.importorskip("vllm")
    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

    from draftsmith.core.targets import read_target
    from draftsmith.drafters.dspark.speculators import speculators_config

    target = read_target(str(qwen3_target))
    head = random_head(target)
    ours = dspark_config(head, target.config)
    theirs = speculators_config(head, target.config, "verifier")
    spec = SpeculatorsConfig.extract_vllm_speculative_config(json.loads(json.dumps(theirs)))
    assert spec == {"method": "dspark", "num_speculative_tokens": head.block_size}
    read = SpeculatorsConfig.extract_transformers_pre_trained_config(json.loads(json.dumps(theirs)))
    extra = {"eagle_aux_hidden_state_layer_ids": [2, 4, 5], "dspark_bonus_anchor": False}
    assert {k: read[k] for k in extra} == extra
    assert {k: read[k] for k in ours if k != "torch_dtype"} == {
        k: v for k, v in ours.items() if k != "torch_dtype"
    }


@pytest.mark.vllm
def test_tiny_dspark_trains_validates_and_exports(tmp_path, qwen3_target, make_hf_dataset):
    """The train CLI on a tiny Qwen3 target: the loss falls, validation logs the served walk
    at T = 0 and T = 1, and ``draftsmith export`` writes what vLLM's module reads."""
    from draftsmith.cli import main as cli_main

    prompts = [f"Write a short note about topic number {i}." for i in range(16)]
    data = make_hf_dataset(tmp_path / "data", qwen3_target, prompts, max_new_tokens=48)
    logs = tmp_path / "logs"
    section = {
        "seed_everything": 0,
        "trainer": {"accelerator": "cpu", "devices": 1, "max_epochs": 10,
                    "enable_progress_bar": False, "log_every_n_steps": 1,
                    "logger": {"class_path": "lightning.pytorch.loggers.CSVLogger",
                               "init_args": {"save_dir": str(logs)}}},
        "model": {"kind": "dspark", "block_size": 4, "num_anchors": 64, "markov_rank": 16,
                  "lr": 3.0e-3, "warmup_steps": 2},
        "data": {"data": str(data), "row_tokens": 256, "batch_size": 2, "val_fraction": 0,
                 "num_workers": 0},
    }  # fmt: skip
    ckpt, simulated = fit_then_validate(section, tmp_path)
    rows = list(csv.DictReader((logs / "lightning_logs" / "version_0" / "metrics.csv").open()))
    losses = [float(r["train/loss"]) for r in rows if r.get("train/loss")]
    assert len(losses) >= 10 and sum(losses[-3:]) < 0.85 * sum(losses[:3]), losses
    val = tmp_path / "val" / "lightning_logs" / "version_0" / "metrics.csv"
    last = list(csv.DictReader(val.open()))[-1]
    t1 = float(last["val/acceptance_length_t1"])
    assert 1.0 <= simulated <= 5.0 and 1.0 <= t1 <= 5.0
    print(f"dspark tiny: loss {losses[0]:.3f} -> {losses[-1]:.3f}; simulated acceptance "
          f"T=0 {simulated:.4f}, T=1 {t1:.4f}")  # fmt: skip

    head_dir = tmp_path / "head"
    assert (
        cli_main(["export", f"--checkpoint={ckpt}", f"--output={head_dir}", "--dtype=float32"]) == 0
    )
    config = json.loads((head_dir / "config.json").read_text())
    assert config["architectures"] == ["Qwen3DSparkModel"] and config["block_size"] == 4
    assert config["target_layer_ids"] == [1, 3, 4]  # the dataset's ids 2, 4, 5 minus 1
    from draftsmith.train.checkpoints import read_checkpoint

    saved = read_checkpoint(ckpt)
    state = {k[5:]: v for k, v in saved["state_dict"].items() if k.startswith("head.")}
    assert_vllm_matches(DSpark.rebuild(saved["draftsmith"], state), head_dir, qwen3_target)
    spec_dir = tmp_path / "head-speculators"
    args = ["export", f"--checkpoint={ckpt}", f"--output={spec_dir}", "--to=speculators"]
    assert cli_main(args) == 0
    config = json.loads((spec_dir / "config.json").read_text())
    assert config["speculators_model_type"] == "dspark"
    assert config["aux_hidden_state_layer_ids"] == [2, 4, 5]  # the dataset's ids


def test_export_to_speculators_is_refused_for_a_kind_without_it(monkeypatch, tmp_path):
    import draftsmith.train.export as export
    from draftsmith.train.checkpoints import CheckpointError

    monkeypatch.setattr(export, "read_checkpoint", lambda path: {})
    info = {"kind": "eagle3", "target": "unread"}
    monkeypatch.setattr(export, "head_from_checkpoint", lambda ckpt: (None, info))
    cfg = export.ExportConfig(checkpoint="c", output=str(tmp_path / "o"), to="speculators")
    with pytest.raises(CheckpointError, match="eagle3 heads are exported as vllm: give") as err:
        export.export_checkpoint(cfg)
    assert "\n" not in str(err.value)


def test_convert_moves_a_dspark_head_between_vllm_and_speculators(tmp_path, qwen3_target, capsys):
    """``draftsmith convert`` reads either DSpark layout and writes the other; the round trip
    gives back vLLM's files tensor for tensor."""
    from safetensors.torch import load_file

    from draftsmith.cli import main as cli_main
    from draftsmith.core.targets import read_target

    target = read_target(str(qwen3_target))
    source = DSpark.export(random_head(target), target, tmp_path / "head")
    spec, back = tmp_path / "speculators", tmp_path / "back"
    model = f"--model={qwen3_target}"
    to_spec = ["convert", f"--head={source}", "--to=speculators", f"--output={spec}", model]
    assert cli_main(to_spec) == 0
    assert json.loads((spec / "config.json").read_text())["speculators_model_type"] == "dspark"
    assert cli_main(["convert", f"--head={spec}", "--to=vllm", f"--output={back}", model]) == 0
    assert "converted: DSpark speculators head -> vllm" in capsys.readouterr().out
    ours, theirs = load_file(source / "model.safetensors"), load_file(back / "model.safetensors")
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[n], theirs[n]) for n in ours)
    assert json.loads((back / "config.json").read_text()) == json.loads(
        (source / "config.json").read_text()
    )
    bad = ["convert", f"--head={source}", "--to=sglang", f"--output={tmp_path / 's'}", model]
    assert cli_main(bad) == 2
    assert "draftsmith writes DSpark heads as vllm or speculators only" in capsys.readouterr().err
