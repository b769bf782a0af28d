"""Check stored states against Hugging Face transformers, layer by layer.

This is the early warning against wrong layer ids, silent zeros and norm mix-ups,
which otherwise show up only as ~0% acceptance in serving. Layer id k < N is
compared with ``output_hidden_states[k]``; id N with the last decoder layer's output
taken by a hook, because the tuple's last entry is after the final norm.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from draftsmith.dataset.reader import open_dataset

# Largest error relative to a layer's max |value| that each storage dtype allows.
DEFAULT_TOLERANCE = {"float32": 1e-3, "float16": 1e-2, "bfloat16": 2e-2, "fp8_e4m3": 8e-2}


@dataclass
class LayerCheck:
    layer_id: int
    max_abs_error: float
    max_abs_value: float

    @property
    def relative(self) -> float:
        return self.max_abs_error / max(self.max_abs_value, 1e-12)


@dataclass
class VerifyReport:
    samples: list[str]
    layers: list[LayerCheck]
    tolerance: float

    @property
    def ok(self) -> bool:
        return all(layer.relative <= self.tolerance for layer in self.layers)

    def text(self) -> str:
        lines = [
            f"verify: {len(self.samples)} samples against transformers "
            f"(tolerance {self.tolerance:g} of max |value|)"
        ]
        for c in self.layers:
            flag = "ok" if c.relative <= self.tolerance else "FAIL"
            lines.append(
                f"  layer {c.layer_id:>3}: max abs error {c.max_abs_error:.4g} "
                f"(max |value| {c.max_abs_value:.4g}, relative {c.relative:.2e}) {flag}"
            )
        if not self.ok:
            lines.append(
                "verify: FAILED: stored states do not match the target; check "
                "layer_ids, the model path and the engine dtype before training."
            )
        return "\n".join(lines)


def reference_states(model, input_ids: torch.Tensor, layer_ids: list[int]) -> torch.Tensor:
    """Transformers' residual stream at `layer_ids` for one sequence: [T, L, H]."""
    layers = model.model.layers
    captured = {}
    hook = layers[-1].register_forward_hook(
        lambda _m, _i, out: captured.__setitem__("last", out[0] if isinstance(out, tuple) else out)
    )
    try:
        with torch.no_grad():
            out = model(input_ids[None], output_hidden_states=True)
    finally:
        hook.remove()
    n = len(layers)
    picked = [captured["last"][0] if k == n else out.hidden_states[k][0] for k in layer_ids]
    return torch.stack(picked, dim=1).float()  # [T, L, H]


def verify_dataset(
    path: str, num_samples: int, tolerance: float | None = None, model=None
) -> VerifyReport:
    """Recompute `num_samples` samples (spread over the dataset) and compare."""
    ds = open_dataset(path)
    manifest = ds.manifest
    tol = tolerance if tolerance is not None else DEFAULT_TOLERANCE[manifest["storage_dtype"]]
    if model is None:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(
            manifest["target"]["path"], dtype=torch.float32
        ).eval()
    count = min(num_samples, len(ds))
    picks = sorted({round(i * (len(ds) - 1) / max(count - 1, 1)) for i in range(count)})
    layer_ids = manifest["layer_ids"]
    err = torch.zeros(len(layer_ids))
    peak = torch.zeros(len(layer_ids))
    ids = []
    for i in picks:
        sample = ds[i]
        ref = reference_states(model, sample["input_ids"], layer_ids)
        diff = (sample["hidden_states"].float() - ref).abs()
        err = torch.maximum(err, diff.amax(dim=(0, 2)))
        peak = torch.maximum(peak, ref.abs().amax(dim=(0, 2)))
        ids.append(sample["id"])
    checks = [
        LayerCheck(k, float(e), float(p)) for k, e, p in zip(layer_ids, err, peak, strict=True)
    ]
    return VerifyReport(ids, checks, tol)
