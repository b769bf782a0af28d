"""Render: the prompt of each round in which the target answers a sample's user turns.

A regenerated sample is answered in rounds, one per user turn (``answer``). The prompt of
round r is what vLLM's chat endpoint renders for the history so far: the system and user
messages up to the r-th user turn and the target's replies of the rounds before, with the
generation prompt. A sample whose template renders it prefix-stably keeps its earlier
replies in the loss mask; a per-turn sample (``Item.rounds`` > 0) is a sample per round,
``{id}#{r}``, its prompt out of the loss, ``shared`` counting the tokens it repeats of the
previous round's prompt.

A prompt that reaches ``max_length`` ends the conversation: a per-turn sample's rounds
from there on are skipped samples; a whole sample is cut at the last round that fitted
(``overlong: truncate``, counted as truncated; that round's reply is then written again,
captured) or skipped (``overlong: skip``, or when its first round does not fit).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from draftsmith.conversations.sources import SkipLog
from draftsmith.conversations.template import render_prompt
from draftsmith.extract.records import Chat, Item, Sequence, common_prefix


@dataclass
class Dialogue:
    """One sample's conversation while the target answers it, round by round."""

    item: Item
    pending: list[dict]
    """Messages not in the history yet (the item's, without assistant turns)."""
    history: list[dict] = field(default_factory=list)
    """What the next prompt renders: messages moved in, and the target's replies."""
    last: Sequence | None = None
    """The latest round whose prompt fitted (a whole sample's cut, when the next does not)."""
    previous: list[int] = field(default_factory=list)
    """The previous round's prompt ids (what a per-turn sample shares with it)."""
    final: Sequence | None = None
    """The prompt of the round that ends the sample, answered where its states are captured."""
    done: bool = False
    """No round is left to render: the final prompt is known, or nothing more fits."""


def render_round(d: Dialogue, r: int, chat: Chat, skips: SkipLog) -> Sequence | None:
    """Round `r` (from 0) of `d`: the next user turn moved into the history and the prompt
    rendered. Returns it when the target answers it now, before the last round; the last
    round's prompt becomes ``d.final``. A prompt too long for ``max_length`` ends `d` (see
    the module docstring)."""
    item = d.item
    while d.pending:  # system/user messages up to and including the next user turn
        msg, d.pending = d.pending[0], d.pending[1:]
        d.history.append(msg)
        if msg["role"] == "user":
            break
    kw = {"tools": item.tools, "kwargs": chat.template_kwargs}
    if item.rounds:  # a sample of its own: the prompt out of the loss
        ids = render_prompt(chat.tokenizer, d.history, **kw)
        mask = [0] * len(ids)
    else:  # one sample: the earlier replies in the history are in its loss
        rendered = render_prompt(chat.tokenizer, d.history, with_mask=True, **kw)
        ids, mask = rendered.input_ids, rendered.loss_mask
    sample = item.for_turn(r + 1, common_prefix(d.previous, ids)) if item.rounds else item
    prompt, d.previous = Sequence(sample, ids, mask), ids
    if len(prompt.input_ids) >= chat.max_length:
        d.done = True
        detail = f"prompt of {len(prompt.input_ids)} tokens in round {r + 1}"
        if item.rounds:  # this round and later ones are samples that do not fit
            for k in range(r + 1, item.rounds + 1):
                skips.add(f"{item.id}#{k}", None, "too_long", detail)
        elif d.last is not None and chat.overlong == "truncate":
            d.final = d.last
            skips.truncated += 1
        else:
            skips.add(item.id, None, "too_long", detail)
        return None
    if not any(m["role"] == "user" for m in d.pending):
        d.final, d.done = prompt, True
        return None
    d.last = prompt
    return prompt
