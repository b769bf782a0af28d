"""The fused draft loss (``model.fused_loss``): its Triton kernels under the interpreter equal
the torch path (loss, both gradients, argmaxes) for every objective; ``auto`` leaves the CPU
path as it was; ``on`` without CUDA is refused in one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from draftsmith.core.errors import ConfigError
from draftsmith.drafters.losses.fused_loss import fused_enabled, triton_missing
from draftsmith.drafters.losses.loss import ChunkedDraftLoss, Teacher, draft_loss, ttt_loss
from draftsmith.drafters.protocol.options import HeadOptions, field_docs

CASES = Path(__file__).parent / "fused_loss_cases.py"

# Tolerances on max |fused - torch| / max |torch| (``fused_loss_cases.rel``).
# fp32 inputs: both paths compute in fp32 and differ only in summation order and in
# exp(z - lse) against exp(log_softmax(z)).
FP32_TOL = 1e-5
# bf16 inputs: the loss still agrees at fp32 level (both paths see the same bf16 logits and
# do the softmax math in fp32), but the fused path stores the gradient wrt the logits in bf16
# (8 mantissa bits: up to 2^-8 = 0.4% per element) where the torch path keeps it in fp32 until
# the matmuls, and a trained lm_head's gradient is a bf16 product per chunk: ~1% apart.
BF16_TOL = {"loss": 1e-5, "grad": 2e-2}


@pytest.fixture(scope="module")
def interpreted() -> dict[str, dict]:
    """Every case of ``fused_loss_cases.py``, run once under ``TRITON_INTERPRET=1`` in a
    subprocess (the interpreter is chosen when the kernels are defined, so it must not leak
    into this process or other tests)."""
    missing = triton_missing()
    if missing:
        pytest.skip(f"{missing}: the kernels cannot run, not even under the interpreter")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run(
        [sys.executable, str(CASES)], env=env, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-4000:]
    cases = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    return {f"{c['group']}/{c['case']}": c for c in cases}


def kernel_ids() -> list[str]:
    return [
        f"kernel/n{n}-v{v}-{d}-{loss}"
        for n, v in ((5, 37), (17, 300))
        for d in ("fp32", "bf16")
        for loss in ("kl", "tv", "kl_tv")
    ]


def function_ids() -> list[str]:
    return [
        f"function/{d}-{loss}-cache{c}"
        for d in ("fp32", "bf16")
        for loss in ("kl", "tv", "kl_tv")
        for c in (0, 1)
    ]


CALLER_IDS = [
    "caller/ttt_loss-kl",
    "caller/ttt_loss-tv",
    "caller/ttt_loss-kl_tv",
    "caller/dflash-block_loss",
    "caller/peagle-parallel_loss",
]


@pytest.mark.parametrize("case", kernel_ids())
def test_kernel_pair_matches_chunk_objective(interpreted: dict, case: str) -> None:
    """Per-row loss, the in-place gradient (token weights folded in) and both argmaxes of one
    chunk, V not a multiple of the block, teacher rows read through an index."""
    c = interpreted[case]
    fp32 = c["dtype"] == "fp32"
    assert c["loss"] <= (FP32_TOL if fp32 else BF16_TOL["loss"])
    assert c["grad"] <= (FP32_TOL if fp32 else BF16_TOL["grad"])
    assert c["argmax"]


@pytest.mark.parametrize("case", function_ids())
def test_fused_function_matches_chunked(interpreted: dict, case: str) -> None:
    """``FusedDraftLoss`` against ``ChunkedDraftLoss``: total loss with non-uniform token
    weights, the states' and the lm_head's gradients (in their own dtypes), argmaxes."""
    c = interpreted[case]
    fp32 = c["dtype"] == "fp32"
    assert c["loss"] <= (FP32_TOL if fp32 else BF16_TOL["loss"])
    for key in ("grad_states", "grad_weight"):
        assert c[key] <= (FP32_TOL if fp32 else BF16_TOL["grad"]), key
    assert c["argmax"]
    want = "torch.float32" if fp32 else "torch.bfloat16"
    assert c["grad_dtypes"] == [want, want]


@pytest.mark.parametrize("case", CALLER_IDS)
def test_callers_on_and_off_agree(interpreted: dict, case: str) -> None:
    """EAGLE-3's ``ttt_loss``, DFlash's ``block_loss`` and P-EAGLE's ``parallel_loss`` with
    ``fused_loss`` on give the torch path's loss, gradients and acceptance counts."""
    c = interpreted[case]
    assert c["loss"] <= FP32_TOL and c["grad_states"] <= FP32_TOL
    assert c["grad_weight"] <= FP32_TOL and c["argmax"]


def small_inputs():
    g = torch.Generator().manual_seed(0)
    states = [torch.randn(1, 12, 8, generator=g, requires_grad=True) for _ in range(2)]
    weight = torch.randn(20, 8, generator=g, requires_grad=True)
    teacher, tw = torch.randn(1, 12, 6, generator=g), torch.randn(20, 6, generator=g)
    mask, doc = torch.ones(1, 12, dtype=torch.bool), torch.zeros(1, 12, dtype=torch.long)
    return states, weight, teacher, tw, mask, doc


def test_on_without_cuda_fails_in_one_line(monkeypatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ConfigError) as err:
        ttt_loss(*small_inputs(), fused="on")
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("model.fused_loss: 'on' needs CUDA tensors and Triton")
    assert "states are on cpu" in message and "'auto' or 'off'" in message
    with pytest.raises(ConfigError, match="model.fused_loss: 'fast' is not one of"):
        fused_enabled("fast", torch.device("cpu"))


def test_auto_on_cpu_is_the_torch_path_bit_for_bit(monkeypatch) -> None:
    """``auto`` (the default) on CPU tensors picks ``Teacher`` + ``ChunkedDraftLoss`` and
    gives the very numbers of ``off``: the CPU path, and the demo's head, are unchanged."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # even then, auto never picks Triton on CPU
    states, weight, teacher, tw, mask, doc = small_inputs()
    rows = torch.arange(12)
    picked, fn = draft_loss("auto", states[0], teacher[0], tw, rows)
    assert isinstance(picked, Teacher) and fn is ChunkedDraftLoss
    outs = [ttt_loss(states, weight, teacher, tw, mask, doc, fused=f) for f in ("auto", "off")]
    grads = [torch.autograd.grad(o.loss, [*states, weight]) for o in outs]
    assert torch.equal(outs[0].loss, outs[1].loss)
    for a, b in zip(*grads, strict=True):
        assert torch.equal(a, b)


def test_option_is_typed_documented_and_defaults_to_auto() -> None:
    assert HeadOptions().fused_loss == "auto"
    assert "Triton" in field_docs(HeadOptions)["fused_loss"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (compiled kernels)")
@pytest.mark.parametrize("loss", ["kl", "tv", "kl_tv"])
def test_cuda_fused_matches_torch_path_in_less_memory(loss: str) -> None:
    """On a GPU under bf16 autocast, at a 32k draft vocabulary: the compiled kernels give the
    torch path's loss, gradients and accuracy (bf16 tolerance) at a lower peak memory."""
    dev, rows, h, v, k = torch.device("cuda"), 2048, 1024, 32000, 2
    g = torch.Generator(device=dev).manual_seed(0)
    states = [
        torch.randn(1, rows, h, device=dev, generator=g, requires_grad=True) for _ in range(k)
    ]
    weight = (torch.randn(v, h, device=dev, generator=g) * 0.05).requires_grad_(True)
    teacher = torch.randn(1, rows, h, device=dev, generator=g)
    tw = torch.randn(v, h, device=dev, generator=g) * 0.05
    mask = torch.ones(1, rows, dtype=torch.bool, device=dev)
    doc = torch.zeros(1, rows, dtype=torch.long, device=dev)
    out, peak = {}, {}
    for fused in ("off", "on"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            res = ttt_loss(states, weight, teacher, tw, mask, doc, loss=loss, fused=fused)
        grads = torch.autograd.grad(res.loss, [*states, weight])
        torch.cuda.synchronize()
        peak[fused] = torch.cuda.max_memory_allocated() - base
        out[fused] = (res, grads)
    (a, ga), (b, gb) = out["on"], out["off"]
    torch.testing.assert_close(a.loss.float(), b.loss.float(), rtol=1e-3, atol=1e-4)
    for x, y in zip(ga, gb, strict=True):
        err = float((x.float() - y.float()).abs().max() / y.float().abs().max())
        assert err <= BF16_TOL["grad"]
    assert (a.step_accuracy - b.step_accuracy).abs().max() <= 1e-3
    assert peak["on"] < peak["off"], peak
