"""The extraction plan: which samples exist, in which shard, and what makes them so.

The plan is computed before any state is captured and written to ``plan.json``. It
fixes the order of samples and their shard, so a resumed or data-parallel run writes
each sample exactly once. Its fingerprint (target, layers, dtype, every option that
changes the content) guards an output directory against a run with other settings.

A conversation is one sample when the chat template renders it prefix-stably; otherwise
(reasoning templates, harmony) each assistant turn is a sample ``{id}#{k}`` (k-th reply,
from 1) holding exactly what the target reads when it writes that turn, plus the turn.
Such samples repeat their conversation's prefix: ``Item.shared`` counts the tokens each
shares with the previous one, so the manifest can tell stored from unique tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from draftsmith.conversations.sources import Conversation, DataError, SkipLog
from draftsmith.conversations.template import (
    NotPrefixStable,
    TemplateError,
    is_prefix_stable,
    mask_reasoning,
    reasoning_ends,
    render_conversation,
    render_turns,
)
from draftsmith.core.targets import TargetInfo
from draftsmith.dataset.manifest import PLAN_FILE, OutputMismatch, read_plan, write_plan
from draftsmith.extract.config import ExtractConfig
from draftsmith.extract.records import DataOptions, Item, common_prefix

# What planning reads: the command's resolved options, or the config itself (same fields).
Options = DataOptions | ExtractConfig

# Options that change what is stored; anything else (engine, workers, verify) does not.
CONTENT_KEYS = (
    "data",
    "regenerate",
    "temperature",
    "max_new_tokens",
    "max_length",
    "overlong",
    "limit",
    "dtype",
    "samples_per_shard",
    "seed",
)


def fingerprint(cfg: ExtractConfig, target: TargetInfo, layer_ids: list[int]) -> dict:
    """What an output directory's content depends on."""
    fp = {
        "target_config_sha256": target.config_sha256,
        "layer_ids": list(layer_ids),
        **{key: getattr(cfg, key) for key in CONTENT_KEYS},
    }
    # Only when set: datasets written before these options still resume.
    if cfg.keep_replies:
        fp["keep_replies"] = cfg.keep_replies
    if not cfg.keep_reasoning:
        fp["keep_reasoning"] = False
    if cfg.chat_template_kwargs:
        fp["chat_template_kwargs"] = cfg.chat_template_kwargs
    return fp


def check_fingerprint(output: Path, expected: dict) -> None:
    """Refuse to mix datasets: compare `expected` with the plan already in `output`."""
    plan_file = output / PLAN_FILE
    if not plan_file.is_file():
        if output.is_dir() and any(output.glob("shard-*.safetensors")):
            raise OutputMismatch(
                f"output: {output} holds shards but no {PLAN_FILE}; "
                "choose an empty directory or delete this one."
            )
        return
    found = read_plan(output, keys=("fingerprint",))["fingerprint"]
    diff = sorted(k for k in set(found) | set(expected) if found.get(k) != expected.get(k))
    if diff:
        detail = "; ".join(f"{k}: {found.get(k)!r} there, {expected.get(k)!r} now" for k in diff)
        raise OutputMismatch(
            f"output: {output} holds a dataset made with other settings ({detail}); "
            "use another --output, or delete it to start over."
        )


def plan_items(convs: list[Conversation], tokenizer, opts: Options, skips: SkipLog) -> list[Item]:
    """Tokenise (or, with regeneration, only check) every conversation; skip and count.

    `opts.limit` counts conversations, whatever number of samples each becomes."""
    keeps = _keeper(opts.keep_replies)
    ends = None if opts.keep_reasoning else reasoning_ends(tokenizer)
    groups = [  # the items of each conversation kept
        group
        for conv in convs
        if (group := plan_conversation(conv, tokenizer, opts, keeps, ends, skips))
    ]
    if opts.limit is not None:
        groups = groups[: opts.limit]
    return [item for group in groups for item in group]


def plan_conversation(
    conv: Conversation, tokenizer, opts: Options, keeps, ends, skips: SkipLog
) -> list[Item]:
    """The samples of one conversation ([] when it is skipped, counted in `skips`).

    With regeneration, one item whose user turns the target answers later (``rounds`` > 0
    when the template needs a sample per turn); otherwise its rendered samples, final.
    `keeps()` says whether a conversation with replies keeps them (``keep_replies``);
    `ends` are the reasoning markers whose reply part leaves the loss (None: keep it)."""
    chat = {"tools": conv.tools, "kwargs": opts.chat_template_kwargs}
    has_replies = any(m["role"] == "assistant" for m in conv.messages)
    # The target cannot call tools here: a conversation with tool calls keeps its replies.
    if opts.regenerate and not (has_replies and (_uses_tools(conv) or keeps())):
        users = [m for m in conv.messages if m["role"] == "user"]
        if not users:
            skips.add(conv, conv.row, "no_user_turn")
            return []
        kept = [m for m in conv.messages if m["role"] != "assistant"]
        try:
            stable = len(users) < 2 or is_prefix_stable(tokenizer, _answered(kept), **chat)
        except TemplateError as err:
            _template_error(conv, err, opts, skips)
            return []
        rounds = 0 if stable else len(users)
        return [Item(conv.id, kept, tools=conv.tools, rounds=rounds)]
    try:
        try:
            whole = render_conversation(tokenizer, conv.messages, **chat)
            samples = [(conv.id, None, whole.input_ids, whole.loss_mask)]
        except NotPrefixStable:
            turns = render_turns(tokenizer, conv.messages, **chat)
            samples = [
                (f"{conv.id}#{k}", k, r.input_ids, r.loss_mask)
                for k, r in enumerate(turns, start=1)
            ]
    except TemplateError as err:
        _template_error(conv, err, opts, skips)
        return []
    group: list[Item] = []
    for sample_id, turn, ids, mask in samples:
        if ends is not None:
            mask = mask_reasoning(ids, mask, ends)
        if len(ids) > opts.max_length:
            if opts.overlong == "skip":
                detail = f"{len(ids)} > max_length {opts.max_length}"
                skips.add(conv.source, conv.row, "too_long", detail, id=sample_id)
                continue
            ids, mask = ids[: opts.max_length], mask[: opts.max_length]
            skips.truncated += 1
        if not any(mask):
            detail = "nothing of the assistant fits"
            skips.add(conv.source, conv.row, "no_loss_tokens", detail, id=sample_id)
            continue
        shared = common_prefix(group[-1].input_ids, ids) if group else 0
        group.append(Item(sample_id, conv.messages, ids, mask, conv.tools, turn, shared=shared))
    return group


# A reply standing in for the target's when checking, before it answers, how the template
# renders a conversation: with a reasoning block, which reasoning templates drop.
PROBE_REPLY = "<think>\nA thought.\n</think>\n\nAn answer."


def _answered(messages: list[dict]) -> list[dict]:
    """`messages` (no assistant turns) with a probe reply after every user turn."""
    out = []
    for m in messages:
        out.append(m)
        if m["role"] == "user":
            out.append({"role": "assistant", "content": PROBE_REPLY})
    return out


def _uses_tools(conv: Conversation) -> bool:
    return bool(conv.tools) or any(m["role"] == "tool" or "tool_calls" in m for m in conv.messages)


def _template_error(conv: Conversation, err: TemplateError, opts: Options, skips) -> None:
    if opts.bad_rows == "error":
        raise DataError(f"{conv.source}:{conv.row}: field 'messages': {err}") from err
    skips.add(conv, None, "template_error", str(err))


def _keeper(share: float):
    """A callable that says, for the next conversation with replies, whether it keeps them.

    The j-th (from 0) keeps them when ``floor((j + 1) * share) > floor(j * share)``: the
    kept ones are spread evenly, ``share`` of every prefix (0.5: every second one).
    """
    count = 0

    def keeps() -> bool:
        nonlocal count
        count += 1
        return math.floor(count * share) > math.floor((count - 1) * share)

    return keeps


@dataclass
class Plan:
    """The dataset's samples in shard order (what ``plan.json`` lists) and the planned
    item behind each sample id."""

    shards: list[list[str]]
    by_id: dict[str, Item]

    def items(self, k: int) -> list[Item]:
        """The items of shard `k`, each once, in order."""
        return shard_items(self.shards[k], self.by_id)


def plan_dataset(
    convs: list[Conversation], tokenizer, opts: Options, skips: SkipLog, output: Path, fp: dict
) -> Plan:
    """Plan every conversation (:func:`plan_items`) into shards of ``samples_per_shard``
    items and write ``plan.json`` with the fingerprint `fp` in `output` (or check the one
    there: a resumed run must plan the same samples)."""
    items = plan_items(convs, tokenizer, opts, skips)
    if not items:
        raise DataError(f"data: {opts.data} gave no usable conversation ({skips.by_reason()})")
    shards = shard_ids(items, opts.samples_per_shard)
    by_id = {sid: it for it in items for sid in it.sample_ids()}
    write_plan(output, fp, shards, skips.to_dict())
    return Plan(shards, by_id)


def shard_ids(items: list[Item], per_shard: int) -> list[list[str]]:
    """Sample ids of each shard, in order (an item's samples always share a shard)."""
    chunks = [items[i : i + per_shard] for i in range(0, len(items), per_shard)]
    return [[sid for it in chunk for sid in it.sample_ids()] for chunk in chunks]


def shard_items(sample_ids: list[str], by_sample: dict[str, Item]) -> list[Item]:
    """The items behind a shard's sample ids, each once, in order."""
    seen: dict[str, Item] = {}
    for sid in sample_ids:
        item = by_sample[sid]
        seen.setdefault(item.id, item)
    return list(seen.values())
