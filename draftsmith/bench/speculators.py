"""speculators' EAGLE-3 model at a target's shapes: the competitor's step, timed by bench-gpu.

Builds ``speculators.models.eagle3.Eagle3DraftModel`` (0.9.0) as its trainer does by default
for an EAGLE-3 head (one decoder layer of the target's config, flex attention, draft vocabulary
of ``draft_vocab_size``, norm before fc and on the output, norm before the residual, forward
KL by its fused Triton kernel on CUDA) with random weights, and returns one optimizer step in
the shape of its training loop: bf16 autocast over fp32 weights, backward, gradient clipping
at 1.0, AdamW. Rows are one document of ``row_tokens`` random tokens and states, as
``bench-train`` uses, in speculators' batch layout ([1, tokens, ...]).

Its ``forward`` is wrapped in ``torch.compile`` whenever CUDA is present; under torch 2.11
that compile failed on an H100 (../shared/notes/gpu.md), so by default the model's forward
is the unwrapped (eager) function, as measured then. Dynamo itself stays on: eager flex
attention compiles its own kernel call, and its backward needs that. On CPU its eager loss
(no Triton) and sdpa attention (flex has no CPU backward) stand in, so the row can be
checked without a GPU.
"""

from __future__ import annotations

import importlib.metadata
import types
from contextlib import nullcontext
from pathlib import Path

import torch

from draftsmith.bench.train import Prepared
from draftsmith.core.readers import read_json

TESTED_VERSION = "0.9.0"
ATTENTION = {"cuda": "simple_flex_attention", "cpu": "sdpa"}
LOSS = {"cuda": "fused", "cpu": "eager"}


def version() -> str | None:
    """The installed speculators version, or None when it is not installed."""
    try:
        return importlib.metadata.version("speculators")
    except importlib.metadata.PackageNotFoundError:
        return None


def prepare(
    target: str,
    ttt_steps: int,
    row_tokens: int,
    draft_vocab_size: int,
    compile: bool = False,
) -> Prepared:
    """speculators' EAGLE-3 head for the target directory ``target`` (its config.json), its
    optimizer and one batch of random rows. Raises ImportError when speculators is missing."""
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.losses import resolve_loss_config
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import AutoConfig

    device = "cuda" if torch.cuda.is_available() else "cpu"
    data = read_json(Path(target, "config.json"), "target config", "pass a target directory")
    layer = AutoConfig.for_model(**data)  # the same config transformers would read
    layer = getattr(layer, "text_config", layer)
    layer.num_hidden_layers = 1
    # Its trainer's default is flex attention; flex has no backward on CPU, where sdpa runs.
    layer._attn_implementation = ATTENTION[device]
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=layer,
        draft_vocab_size=draft_vocab_size,
        norm_before_residual=True,
        norm_before_fc=True,
        norm_output=True,
        eagle_aux_hidden_state_layer_ids=[2, 3, 4],  # three states: only the count matters
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=ttt_steps)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=None, architectures=layer.architectures or []),
        ),
    )
    with torch.device(device):
        model = Eagle3DraftModel(config)
        with torch.no_grad():  # its embeddings and lm_heads start as NaN until loaded
            for weight in (model.embed_tokens.weight, model.lm_head.weight):
                weight.normal_(0.0, 0.02)
            model.verifier_lm_head.weight.copy_(model.lm_head.weight)
    model.train()
    if not compile:  # the function torch.compile wrapped (the same one when not wrapped)
        forward = type(model).forward
        eager = getattr(forward, "_torchdynamo_orig_callable", forward)
        model.forward = types.MethodType(eager, model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    loss_config = resolve_loss_config("kl_div", LOSS[device])
    hidden = layer.hidden_size
    gen = torch.Generator().manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    batch = {
        "input_ids": torch.randint(0, draft_vocab_size, (1, row_tokens), generator=gen),
        "hidden_states": torch.randn(1, row_tokens, 3 * hidden, generator=gen).to(dtype),
        "verifier_last_hidden_states": torch.randn(1, row_tokens, hidden, generator=gen).to(dtype),
        "document_ids": torch.zeros(1, row_tokens, dtype=torch.long),
        "position_ids": torch.arange(1, row_tokens + 1).unsqueeze(0),
        "loss_mask": torch.ones(1, row_tokens, dtype=torch.bool),
    }
    batch = {k: v.to(device) for k, v in batch.items()}
    autocast = torch.autocast("cuda", torch.bfloat16) if device == "cuda" else nullcontext()

    def step() -> None:
        with autocast:
            _, loss, _ = model(
                **batch, ttt_steps=ttt_steps, ttt_step_loss_decay=1.0, loss_config=loss_config
            )
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    real = torch.zeros((), dtype=torch.long, device=device)
    return Prepared(step, model, device, hidden, real)
