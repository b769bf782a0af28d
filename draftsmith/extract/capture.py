"""Capture one shard: send its samples through the engine and collect their states.

Without regeneration each sample is a prompt of its full token ids with
``max_tokens=1``. With greedy regeneration the target answers each user turn in
rounds; the last round captures prompt + reply (``include_output_tokens``) in the
same pass that writes the reply, so the states match the tokens the target produced.

Sampled regeneration cannot run in the capturing engine: in vLLM 0.32 the
``extract_hidden_states`` method's dummy draft token is accepted far too often under
sampling (replies degenerate into repeated tokens; greedy is exact). Sampled replies
are therefore written by a plain engine first (`write_replies`) and captured here by
prefilling their exact token ids. Samples that keep their own replies
(``keep_replies``) are prefilled beside the others, in the same engine call.

When the chat template is not prefix-stable (reasoning templates, harmony; see
:mod:`draftsmith.conversations.template`) every round is its own sample ``{id}#{k}``:
the prompt vLLM's chat endpoint would render for the history so far, then the reply.
Those rounds are all captured as they are written, and the history keeps each reply's
answer without its reasoning, as a chat client sends it back.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch

from draftsmith.conversations.sources import SkipLog
from draftsmith.conversations.template import mask_reasoning, reasoning_ends, render_prompt
from draftsmith.core.engine import EngineOptions
from draftsmith.core.readers import read_safetensors
from draftsmith.extract.config import ExtractConfig
from draftsmith.extract.sample_plan import Item, common_prefix, turn_item

WAIT_SECONDS = 120.0

Sequence = tuple[Item, list[int], list[int]]  # (item, input_ids, loss_mask)


class CaptureError(RuntimeError):
    """vLLM returned states that cannot be right (missing, zero, non-finite, misaligned)."""


def capture_shard(
    llm,
    tokenizer,
    items: list[Item],
    cfg: ExtractConfig,
    skips: SkipLog,
    written: list[Sequence] | None = None,
) -> list[dict]:
    """Samples ``{"id", "input_ids" [T], "loss_mask" [T], "hidden_states" [T, L, H],
    "turn", "shared"}`` in the order of the items' sample ids (see :class:`Item`).

    `written` holds sequences whose replies a plain engine already wrote (sampled
    regeneration); they are captured by prefill.
    """
    ready = [(it, it.input_ids, it.loss_mask) for it in items if it.input_ids]
    earlier: list[tuple[Item, list[int], list[int], object]] = []
    if written is not None:
        fresh, ready = [], written + ready
    else:
        fresh, earlier = _final_prompts(llm, tokenizer, _to_answer(items), cfg, skips, True)
    requests = fresh + ready  # the first len(fresh) are answered in this pass
    samples = {}
    for item, ids, mask, out in earlier:  # per-turn rounds, captured as they were written
        extended = _with_reply(item, ids, mask, out, skips)
        if extended is None:
            _discard(out)
            continue
        samples[item.id] = _sample(item, *extended, out, cfg, tokenizer)
    if requests:
        from vllm import SamplingParams

        prefill = SamplingParams(max_tokens=1, temperature=0.0)
        params = [_reply_params(cfg, len(ids), capture=True) for _, ids, _ in fresh]
        params += [prefill] * len(ready)
        outputs = llm.generate(
            [{"prompt_token_ids": ids} for _, ids, _ in requests], params, use_tqdm=False
        )
        for n, ((item, ids, mask), out) in enumerate(zip(requests, outputs, strict=True)):
            if n < len(fresh):
                extended = _with_reply(item, ids, mask, out, skips)
                if extended is None:
                    _discard(out)
                    continue
                ids, mask = extended
            samples[item.id] = _sample(item, ids, mask, out, cfg, tokenizer)
    order = [sid for it in items for sid in it.sample_ids()]
    return [samples[sid] for sid in order if sid in samples]


def _sample(item: Item, ids: list[int], mask: list[int], out, cfg: ExtractConfig, tokenizer):
    """One captured sample: the staged states of request `out`, checked against `ids`."""
    states, token_ids = _load_staged(out)
    if token_ids != list(ids):
        raise CaptureError(
            f"sample {item.id}: vLLM captured {len(token_ids)} tokens that differ from the "
            f"{len(ids)} sent; the connector and engine disagree."
        )
    _check_states(item.id, states)
    if not cfg.keep_reasoning:
        mask = mask_reasoning(ids, mask, reasoning_ends(tokenizer))
    return {
        "id": item.id,
        "input_ids": torch.tensor(ids, dtype=torch.int32),
        "loss_mask": torch.tensor(mask, dtype=torch.uint8),
        "hidden_states": states,
        "turn": item.turn,
        "shared": item.shared,
    }


def write_replies(
    llm, tokenizer, items: list[Item], cfg: ExtractConfig, skips: SkipLog
) -> list[Sequence]:
    """Answer every user turn of the items without final ids with a plain (non-capturing)
    engine; return their whole sequences (each round's, for per-turn items)."""
    requests, earlier = _final_prompts(llm, tokenizer, _to_answer(items), cfg, skips, False)
    params = [_reply_params(cfg, len(ids), capture=False) for _, ids, _ in requests]
    outputs = llm.generate(
        [{"prompt_token_ids": ids} for _, ids, _ in requests], params, use_tqdm=False
    )
    written = []
    for item, ids, mask, out in earlier + [(*r, o) for r, o in zip(requests, outputs, strict=True)]:
        extended = _with_reply(item, ids, mask, out, skips)
        if extended is not None:
            written.append((item, *extended))
    return written


def _to_answer(items: list[Item]) -> list[Item]:
    """The items whose replies the target writes (the others keep theirs: final ids)."""
    return [it for it in items if not it.input_ids]


def _with_reply(item: Item, ids: list[int], mask: list[int], out, skips: SkipLog):
    """Prompt + reply minus its last token (never fed back, so it has no state)."""
    reply = list(out.outputs[0].token_ids)
    if len(reply) < 2:
        skips.add(item.id, None, "empty_reply", "the target answered with at most one token")
        return None
    return list(ids) + reply[:-1], list(mask) + [1] * (len(reply) - 1)


def _reply_params(cfg: ExtractConfig, prompt_len: int, capture: bool):
    from vllm import SamplingParams

    budget = cfg.max_length + 1 - prompt_len  # prompt + reply - 1 tokens are stored
    return SamplingParams(
        max_tokens=max(1, min(cfg.max_new_tokens, budget)),
        temperature=cfg.temperature,
        extra_args={
            "kv_transfer_params": {"include_output_tokens": True} if capture else {"save": False}
        },
    )


def _final_prompts(
    llm, tokenizer, items: list[Item], cfg: ExtractConfig, skips: SkipLog, capture: bool
) -> tuple[list[tuple[Item, list[int], list[int]]], list[tuple[Item, list[int], list[int], Any]]]:
    """Answer all but the last user turn of every item; return final-round prompts
    ``(item, ids, mask)`` and the answered earlier rounds of per-turn items
    ``(turn item, prompt ids, mask, vLLM output)``.

    For an item with one sample, earlier turns are answered without capture (``save:
    False``); their replies become part of the final prompt, whose assistant turns are in
    its loss mask. A conversation whose next round no longer fits `max_length` ends at the
    last round that did (``overlong: truncate``, counted as truncated; that round's reply
    is written again, captured) or is skipped (``overlong: skip``, or when its first round
    does not fit). For a per-turn item (``rounds > 0``) every round is its own sample,
    captured as it is written when `capture`; rounds that no longer fit are skipped samples.
    """
    if not items:
        return [], []
    histories = {it.id: [] for it in items}
    turns = {it.id: it.messages for it in items}
    rounds = max(sum(m["role"] == "user" for m in it.messages) for it in items)
    final: dict[str, tuple[Item, list[int], list[int]]] = {}
    last: dict[str, tuple[Item, list[int], list[int]]] = {}  # latest round that fit
    previous: dict[str, list[int]] = {}  # per-turn items: the previous round's prompt
    earlier = []
    ends = reasoning_ends(tokenizer)
    for r in range(rounds):
        batch = []
        for it in items:
            if it.id in final or it.id not in turns:
                continue
            history, pending = histories[it.id], turns[it.id]
            # Move system/user messages up to and including the next user turn.
            while pending:
                msg, pending = pending[0], pending[1:]
                history.append(msg)
                if msg["role"] == "user":
                    break
            turns[it.id] = pending
            chat = {"tools": it.tools, "kwargs": cfg.chat_template_kwargs}
            if it.rounds:
                ids = render_prompt(tokenizer, history, **chat)
                mask = [0] * len(ids)
                shared = common_prefix(previous.get(it.id, []), ids)
                sample, previous[it.id] = turn_item(it, r + 1, shared), ids
            else:
                rendered = render_prompt(tokenizer, history, with_mask=True, **chat)
                ids, mask, sample = rendered.input_ids, rendered.loss_mask, it
            if len(ids) >= cfg.max_length:
                turns.pop(it.id)
                detail = f"prompt of {len(ids)} tokens in round {r + 1}"
                if it.rounds:  # this round and later ones are samples that do not fit
                    for k in range(r + 1, it.rounds + 1):
                        skips.add(f"{it.id}#{k}", None, "too_long", detail)
                elif it.id in last and cfg.overlong == "truncate":
                    final[it.id] = last[it.id]
                    skips.truncated += 1
                else:
                    skips.add(it.id, None, "too_long", detail)
                continue
            if not any(m["role"] == "user" for m in pending):
                final[it.id] = (sample, ids, mask)
            else:
                last[it.id] = (sample, ids, mask)
                batch.append((it, sample, ids, mask))
        if batch:
            params = [
                _reply_params(cfg, len(ids), capture=capture and it.rounds > 0)
                for it, _, ids, _ in batch
            ]
            # Earlier turns are captured only as per-turn samples.
            outs = llm.generate(
                [{"prompt_token_ids": ids} for _, _, ids, _ in batch], params, use_tqdm=False
            )
            for (it, sample, ids, mask), out in zip(batch, outs, strict=True):
                text = out.outputs[0].text
                if it.rounds:
                    earlier.append((sample, ids, mask, out))
                    text = _answer_text(tokenizer, list(out.outputs[0].token_ids), ends, text)
                histories[it.id].append({"role": "assistant", "content": text})
    return [final[it.id] for it in items if it.id in final], earlier


def _answer_text(tokenizer, reply: list[int], ends: list[list[int]], text: str) -> str:
    """The reply as a chat client sends it back: the answer after its reasoning (vLLM's
    reasoning parsers split it off), or `text` when the reply has no reasoning marker."""
    cut = len(reply) - sum(mask_reasoning(reply, [1] * len(reply), ends))
    return tokenizer.decode(reply[cut:], skip_special_tokens=True) if cut else text


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
    # process would not step while `capture_shard` waits for the file, so capture always
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
