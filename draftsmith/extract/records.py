"""The records a sample passes through on its way to a shard, in the order of the pass
(``extract/shard_pass.py``), and the settings its steps read:

    plan     -> Item       a planned sample: its id, its messages and, when they are final
                           (replies kept), its token ids and loss mask
    render   -> Sequence   the token ids and loss mask one engine request sends: a round's
                           prompt, or a sample's final sequence
    answer   -> Answered   one request's sequence (prompt + the target's reply, when it
                           wrote one) and the engine's output, whose states the connector staged
    capture  -> Captured   a sample with its hidden states, checked
    write    -> ShardInfo  the shard file's record (``dataset/shards.py``); its sidecar adds
                           what the pass counted

The command resolves its config once into these records and the settings records below
(``DataOptions``, ``Chat``, ``Schedule``); every step then reads the few fields it needs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


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
    tools: list[dict] | None = None
    """The conversation's tool definitions, given to the chat template."""
    turn: int | None = None
    """The assistant turn (from 1) this sample holds alone; None: the whole conversation."""
    rounds: int = 0
    """With regeneration, for a template that is not prefix-stable: the number of replies
    the target writes, each captured as its own sample ``{id}#{k}``. 0: one sample."""
    shared: int = 0
    """Leading tokens equal to the conversation's previous turn sample (a repeated prefix)."""

    def sample_ids(self) -> list[str]:
        """The ids of the samples this item becomes, in order."""
        return [f"{self.id}#{k}" for k in range(1, self.rounds + 1)] if self.rounds else [self.id]

    def for_turn(self, turn: int, shared: int = 0) -> Item:
        """The sample of this item's `turn`-th regenerated reply."""
        return Item(f"{self.id}#{turn}", self.messages, tools=self.tools, turn=turn, shared=shared)


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two id lists (an :attr:`Item.shared`)."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


@dataclass
class Sequence:
    """Token ids one request sends and their loss mask: a round's prompt (the target writes
    a reply after it) or a sample's final sequence (prefilled)."""

    sample: Item
    input_ids: list[int]
    loss_mask: list[int]


@dataclass
class Answered:
    """One engine request after it ran: the sequence whose states the connector staged
    (None: the reply was too short to keep; its states are dropped) and vLLM's output,
    which names the staged file."""

    sequence: Sequence | None
    output: Any


@dataclass
class Captured:
    """One sample of a shard: ``input_ids`` [T], ``loss_mask`` [T], ``hidden_states``
    [T, L, H] (L layers in ascending id order)."""

    id: str
    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    hidden_states: torch.Tensor
    turn: int | None
    shared: int

    def row(self) -> dict:
        """The sample as ``dataset.shards.write_shard`` takes it (tensors not copied)."""
        return {
            "id": self.id,
            "input_ids": self.input_ids,
            "loss_mask": self.loss_mask,
            "hidden_states": self.hidden_states,
        }


@dataclass(frozen=True)
class Chat:
    """What rendering and answering read: the template's inputs and the reply budget."""

    tokenizer: Any
    template_kwargs: dict
    """The config's ``chat_template_kwargs``, given to every render."""
    max_length: int
    """Longest stored sequence (the config's, cut to the target's positions)."""
    overlong: str
    max_new_tokens: int
    temperature: float
    reasoning_ends: list[list[int]]
    """Token ids of the markers that end a reply's reasoning (``template.reasoning_ends``)."""


@dataclass(frozen=True)
class DataOptions:
    """What reading the data and planning its samples read (``ExtractConfig``'s fields of
    the same names, ``max_length`` within the target's positions)."""

    data: list[str]
    bad_rows: str
    encoding: str
    regenerate: bool
    seed: int
    keep_replies: float
    keep_reasoning: bool
    chat_template_kwargs: dict
    max_length: int
    overlong: str
    limit: int | None
    samples_per_shard: int


@dataclass(frozen=True)
class Schedule:
    """What the drivers read: which shards are this worker's, and when to stop
    (``time_limit``; streaming, ``trainer_timeout``)."""

    worker: int
    workers: int
    time_limit: float | None
    trainer_timeout: float
