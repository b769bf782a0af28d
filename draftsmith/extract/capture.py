"""Capture: the hidden states of each answered request, read from the connector's file.

The capture engine (:func:`capture_engine`) runs vLLM's ``extract_hidden_states`` method
with draftsmith's connector (``connector.py``): every finished request leaves its states
``[tokens, layers, hidden]`` and token ids in a file of the staging directory, which
:func:`capture` waits for, checks against the sequence sent (same token ids, finite states,
no layer all zeros) and deletes. A reply too short to keep leaves its file too: it is
dropped. With ``keep_reasoning: false`` each reply's reasoning leaves the loss mask here,
once the ids are final.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from draftsmith.conversations.template import mask_reasoning
from draftsmith.core.engine import EngineOptions
from draftsmith.core.readers import read_safetensors
from draftsmith.extract.records import Answered, Captured

WAIT_SECONDS = 120.0


class CaptureError(RuntimeError):
    """vLLM returned states that cannot be right (missing, zero, non-finite, misaligned)."""


def capture(answered: Answered, mask_ends: list[list[int]] | None) -> Captured | None:
    """The sample of one answered request: its staged states ``[T, L, H]``, checked against
    the ids sent, and its loss mask without the replies' reasoning when `mask_ends` (the
    reasoning markers) are given. None, its file deleted, for a reply too short to keep."""
    seq = answered.sequence
    if seq is None:
        _discard(answered.output)
        return None
    states, token_ids = _load_staged(answered.output)
    if token_ids != list(seq.input_ids):
        raise CaptureError(
            f"sample {seq.sample.id}: vLLM captured {len(token_ids)} tokens that differ from "
            f"the {len(seq.input_ids)} sent; the connector and engine disagree."
        )
    _check_states(seq.sample.id, states)
    mask = seq.loss_mask
    if mask_ends is not None:
        mask = mask_reasoning(seq.input_ids, mask, mask_ends)
    return Captured(
        seq.sample.id,
        torch.tensor(seq.input_ids, dtype=torch.int32),
        torch.tensor(mask, dtype=torch.uint8),
        states,
        seq.sample.turn,
        seq.sample.shared,
    )


def _staged_path(out) -> str:
    params = out.kv_transfer_params or {}
    path = params.get("hidden_states_path")
    if not path:
        raise CaptureError(
            f"request {out.request_id}: vLLM returned no hidden_states_path; is the "
            "draftsmith connector configured (kv_transfer_config)?"
        )
    return path


def _load_staged(out) -> tuple[torch.Tensor, list[int]]:
    """Wait for the connector's file (it appears atomically), read it, delete it."""
    path = _staged_path(out)
    deadline = time.monotonic() + WAIT_SECONDS
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise CaptureError(f"request {out.request_id}: {path} did not appear in time")
        time.sleep(0.01)
    data = read_safetensors(path, "staged states", "re-run the same command; it is captured again")
    os.remove(path)
    return data["hidden_states"], data["token_ids"].tolist()


def _discard(out) -> None:
    path = (out.kv_transfer_params or {}).get("hidden_states_path")
    deadline = time.monotonic() + WAIT_SECONDS
    while path and not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.01)
    if path and os.path.exists(path):
        os.remove(path)


def _check_states(sample_id: str, states: torch.Tensor) -> None:
    """Early warning for the failures other tools find only as ~0% acceptance."""
    if not torch.isfinite(states).all():
        raise CaptureError(f"sample {sample_id}: hidden states hold NaN or inf")
    # [tokens, layers, hidden] -> one flag per layer
    zero = (states.abs().amax(dim=(0, 2)) == 0).nonzero().flatten().tolist()
    if zero:
        raise CaptureError(
            f"sample {sample_id}: layer positions {zero} are all zeros; the engine did not "
            "fill them (wrong layer ids for this architecture?)"
        )


def clean_staging(staging: Path) -> None:
    """Remove files a killed run left behind."""
    if staging.is_dir():
        for f in staging.iterdir():
            if f.is_file():
                f.unlink()


CONNECTOR = "DraftsmithHiddenStatesConnector"
CONNECTOR_MODULE = "draftsmith.extract.connector"


def capture_engine(
    model: str, layer_ids: list[int], staging_dir: str, options: EngineOptions, max_len: int
):
    """A `vllm.LLM` whose finished requests leave their hidden states in `staging_dir`.

    Every request is captured unless its ``kv_transfer_params`` say ``save: False``.
    """
    from vllm import LLM

    from draftsmith.core.engine import engine_kwargs

    os.makedirs(staging_dir, exist_ok=True)
    kwargs = engine_kwargs(model, options, max_len)
    kwargs["speculative_config"] = {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": layer_ids}},
    }
    kwargs["kv_transfer_config"] = {
        "kv_connector": CONNECTOR,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"staging_dir": staging_dir},
    }
    # The connector writes a request's file on a later engine step; an engine inside this
    # process would not step while `capture` waits for the file, so capture always
    # runs vLLM's engine core in its own process, whatever the environment asks for.
    asked = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    try:
        return LLM(**kwargs)
    finally:  # later engines of this process (an evaluation) get what was asked for
        if asked is None:
            del os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"]
        else:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = asked
