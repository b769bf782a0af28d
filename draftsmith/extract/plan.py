"""The extraction plan: which samples exist, in which shard, and what makes them so.

The plan is computed before any state is captured and written to ``plan.json``. It
fixes the order of samples and their shard, so a resumed or data-parallel run writes
each sample exactly once. Its fingerprint (target, layers, dtype, every option that
changes the content) guards an output directory against a run with other settings.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from draftsmith.errors import DraftsmithError
from draftsmith.extract.config import ExtractConfig
from draftsmith.files import write_json_atomic
from draftsmith.sources import Conversation, DataError, SkipLog
from draftsmith.targets import TargetInfo
from draftsmith.template import TemplateError, render_conversation

PLAN_FILE = "plan.json"

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


class OutputMismatch(DraftsmithError):
    """The output directory holds a dataset made with other settings."""


@dataclass
class Item:
    """One planned sample.

    Without regeneration (or when the sample keeps its replies) `input_ids` / `loss_mask`
    are final; with it they are empty and the messages' user turns are answered by the
    target during capture.
    """

    id: str
    messages: list[dict]
    input_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)


def fingerprint(cfg: ExtractConfig, target: TargetInfo, layer_ids: list[int]) -> dict:
    """What an output directory's content depends on."""
    fp = {
        "target_config_sha256": target.config_sha256,
        "layer_ids": list(layer_ids),
        **{key: getattr(cfg, key) for key in CONTENT_KEYS},
    }
    if cfg.keep_replies:  # only when set: datasets written before the option still resume
        fp["keep_replies"] = cfg.keep_replies
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
    found = json.loads(plan_file.read_text())["fingerprint"]
    diff = sorted(k for k in set(found) | set(expected) if found.get(k) != expected.get(k))
    if diff:
        detail = "; ".join(f"{k}: {found.get(k)!r} there, {expected.get(k)!r} now" for k in diff)
        raise OutputMismatch(
            f"output: {output} holds a dataset made with other settings ({detail}); "
            "use another --output, or delete it to start over."
        )


def plan_items(
    convs: list[Conversation], tokenizer, cfg: ExtractConfig, skips: SkipLog
) -> list[Item]:
    """Tokenise (or, with regeneration, only check) every conversation; skip and count."""
    items: list[Item] = []
    keeps = _keeper(cfg.keep_replies)
    for conv in convs:
        has_replies = any(m["role"] == "assistant" for m in conv.messages)
        if cfg.regenerate and not (has_replies and keeps()):
            users = [m for m in conv.messages if m["role"] == "user"]
            if not users:
                skips.add(conv, conv.row, "no_user_turn")
                continue
            kept = [m for m in conv.messages if m["role"] != "assistant"]
            items.append(Item(conv.id, kept))
            continue
        try:
            rendered = render_conversation(tokenizer, conv.messages)
        except TemplateError as err:
            if cfg.bad_rows == "error":
                raise DataError(f"{conv.source}:{conv.row}: field 'messages': {err}") from err
            skips.add(conv, None, "template_error", str(err))
            continue
        ids, mask = rendered.input_ids, rendered.loss_mask
        if len(ids) > cfg.max_length:
            if cfg.overlong == "skip":
                skips.add(conv, conv.row, "too_long", f"{len(ids)} > max_length {cfg.max_length}")
                continue
            ids, mask = ids[: cfg.max_length], mask[: cfg.max_length]
            skips.truncated += 1
        if not any(mask):
            skips.add(conv, conv.row, "no_loss_tokens", "nothing of the assistant fits")
            continue
        items.append(Item(conv.id, conv.messages, ids, mask))
    if cfg.limit is not None:
        items = items[: cfg.limit]
    return items


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


def shard_ids(items: list[Item], per_shard: int) -> list[list[str]]:
    """Sample ids of each shard, in order."""
    return [[it.id for it in items[i : i + per_shard]] for i in range(0, len(items), per_shard)]


def write_plan(output: Path, fp: dict, shards: list[list[str]], skips: SkipLog) -> None:
    """Write ``plan.json``, or check that the one there lists the same samples."""
    plan_file = output / PLAN_FILE
    digest = hashlib.sha256(json.dumps(shards).encode()).hexdigest()
    if plan_file.is_file():
        found = json.loads(plan_file.read_text())
        if found["samples_sha256"] != digest:
            raise OutputMismatch(
                f"output: {output} was planned with other samples (the inputs changed since "
                "the first run); use another --output, or delete it to start over."
            )
        return
    output.mkdir(parents=True, exist_ok=True)
    write_json_atomic(
        plan_file,
        {"fingerprint": fp, "samples_sha256": digest, "shards": shards, "skipped": skips.to_dict()},
    )
