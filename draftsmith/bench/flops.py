"""FLOPs per trained token of a TTT step, and the bf16 peak of the GPU that runs it.

Two counts, both per token of a packed row (``bench-gpu`` reports MFU with each):

- ``6NT``: 6 x trainable parameters x TTT steps, the usual model-FLOPs convention (forward
  2N, weight gradient 2N, input gradient 2N, once per TTT step).
- hardware: ``6NT`` plus the matmuls the step runs for parameters that do not train. A
  frozen draft lm_head [V, H] still runs its forward (2VH) and its input gradient (2VH) at
  every TTT step, so ``+ 4VHT``; the teacher's logits over the draft vocabulary (states
  [tokens, H] x teacher lm_head [V, H]) run once per token, ``+ 2VH``. Attention's
  score and value matmuls are left out of both counts (about 2% of ``6NT`` at the 8B shape
  with rows of 2,048 tokens), as are the elementwise passes.
"""

from __future__ import annotations

from dataclasses import dataclass

# Dense bf16 tensor-core peak in TFLOP/s (no 2:4 sparsity), keyed by a piece of
# ``torch.cuda.get_device_name()``; the first key found in the name wins, so the specific
# form factors come before the family. Source: NVIDIA's H100 and H200 datasheets list bf16
# 1,979 TFLOP/s "with sparsity" for the H100 SXM and the H200 SXM, 1,513 for the H100 PCIe
# and 1,671 for the H100 NVL and the H200 NVL; dense is half. A100: 312 (its datasheet).
# The H100 SXM reports itself as "NVIDIA H100 80GB HBM3", the PCIe card as "NVIDIA H100 PCIe".
GPU_BF16_PEAK_TFLOPS: dict[str, float] = {
    "H100 PCIe": 756.0,
    "H100 NVL": 835.0,
    "H100": 989.0,
    "H200 NVL": 835.0,
    "H200": 989.0,
    "A100": 312.0,
}


def peak_tflops(device_name: str, override: float | None = None) -> float | None:
    """The bf16 dense peak of ``device_name`` (TFLOP/s); ``override`` wins; None if unknown."""
    if override is not None:
        return override
    return next((v for k, v in GPU_BF16_PEAK_TFLOPS.items() if k in device_name), None)


@dataclass(frozen=True)
class StepFlops:
    """FLOPs per trained token of one optimizer step (see the module docstring)."""

    trainable_params: int
    """N: parameters that train (the lm_head's included when it trains)."""
    frozen_lm_head_params: int
    """V x H of the draft lm_head when it is frozen (0 when it trains)."""
    teacher_params: int
    """V x H of the teacher's lm_head over the draft vocabulary."""
    ttt_steps: int

    @property
    def model(self) -> int:
        """6NT."""
        return 6 * self.trainable_params * self.ttt_steps

    @property
    def hardware(self) -> int:
        """6NT + 4 x frozen lm_head x T + 2 x teacher lm_head."""
        frozen = 4 * self.frozen_lm_head_params * self.ttt_steps
        return self.model + frozen + 2 * self.teacher_params

    def mfu(self, tokens_per_s: float, peak: float | None) -> dict[str, float | None]:
        """{"mfu_6nt", "mfu_hw"}: FLOP/s over ``peak`` TFLOP/s (None where peak is)."""
        if not peak:
            return {"mfu_6nt": None, "mfu_hw": None}
        return {
            "mfu_6nt": self.model * tokens_per_s / (peak * 1e12),
            "mfu_hw": self.hardware * tokens_per_s / (peak * 1e12),
        }
