"""The pass every sample goes through, from its plan to its shard:

    plan -> render -> answer -> capture -> write

Each step is a function of the previous step's record (``records.py``): the planned
:class:`Item` (``sample_plan``), the :class:`Sequence` of each round's prompt (``render``),
the :class:`Answered` request (``answer``), the :class:`Captured` sample (``capture``) and
the written shard's ``ShardInfo`` (``write``). A sample whose replies are final at plan time
(kept replies, or sampled ones written ahead) skips render and answer: its sequence is
prefilled. The samples of one shard take each step together, as vLLM batches requests:
one engine call per round, and one that answers the last rounds and prefills the final
sequences while it captures their states.

The drivers share this pass and add only which shards it writes, and when:
- the offline loop (``main.offline``): this worker's shards in plan order behind a
  progress bar, none started that would end past the time limit;
- resume (``resume.Output.todo``): the planned shards not on disk whole, and no others;
- repair (``resume.Output.repair``): the shards that fail their checksum, deleted first;
- the streamed producer (``producer.serve``): the shards a trainer asks for, in its order;
  a streamed shard's replies are kept, so that writing it again is one prefill.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from draftsmith.conversations.sources import SkipLog
from draftsmith.core.targets import TargetInfo
from draftsmith.extract import replies
from draftsmith.extract.answer import answer_last, answer_rounds, write_replies
from draftsmith.extract.capture import capture
from draftsmith.extract.engines import LazyEngine
from draftsmith.extract.records import Captured, Chat, Item, Schedule, Sequence
from draftsmith.extract.resume import Output
from draftsmith.extract.sample_plan import Plan
from draftsmith.extract.write import write_entry


@dataclass
class ShardPass:
    """What the pass reads, resolved from the config once; ``extract(k)`` writes shard k.
    The drivers read ``cfg`` (their ``Schedule``), ``engine``, ``output``, ``shards`` and
    what the manifest records (``target``, ``layer_ids``, ``config``)."""

    cfg: Schedule
    engine: LazyEngine
    """The capture engine."""
    plan: Plan
    chat: Chat
    mask_ends: list[list[int]] | None
    """Reasoning markers whose reply part leaves the loss (``keep_reasoning: false``)."""
    dtype: str
    regenerate: bool
    keep_streamed: bool
    """Streaming with regeneration: keep each shard's replies, to write it again by prefill."""
    dataset: Output
    ahead: dict[int, tuple[list[Sequence], SkipLog]] = field(default_factory=dict)
    """Sampled replies, written ahead by a plain engine: each shard's sequences, skips."""

    @property
    def shards(self) -> list[list[str]]:
        return self.plan.shards

    @property
    def output(self) -> Path:
        return self.dataset.path

    @property
    def target(self) -> TargetInfo:
        return self.dataset.target

    @property
    def layer_ids(self) -> list[int]:
        return self.dataset.layer_ids

    @property
    def config(self) -> dict:
        return self.dataset.config

    def answer_ahead(self, writer: LazyEngine, todo: list[int]) -> None:
        """Sampled regeneration: the replies of the shards `todo` written by the plain
        engine `writer` before any capture (kept in ``replies/``, so a resumed run reuses
        them), each shard's then captured by prefill."""
        for k in todo:
            items, cache = self.plan.items(k), replies.path(self.output, k)
            if not cache.is_file():
                skips = SkipLog()
                seqs = write_replies(writer.get(), items, self.chat, skips)
                replies.save(cache, [replies.row_of(s) for s in seqs], skips)
            self.ahead[k] = replies.load(cache, self.plan.by_id)

    def extract(self, k: int) -> int:
        """Pass shard ``k`` and record it (file, then sidecar, then the manifest); returns
        its tokens."""
        started = time.monotonic()
        items = self.plan.items(k)
        written, skips = self.ahead.get(k, (None, SkipLog()))
        kept = replies.path(self.output, k)  # a streamed shard's greedy replies, once written
        replay = self.keep_streamed and written is None
        if replay and kept.is_file():
            written, skips = replies.load(kept, self.plan.by_id)
        samples = self._samples(items, written, skips)
        if replay and written is None:  # answered in this pass: keep the replies' ids
            rows = [
                replies.row(s.id, s.input_ids.tolist(), s.loss_mask.tolist(), s.turn, s.shared)
                for s in samples
                if not self.plan.by_id[s.id].input_ids  # kept replies are planned ids already
            ]
            replies.save(kept, rows, skips)
        # generation: the target answered in the capturing pass; prefill: every sequence
        # was final before it (kept replies, sampled ones, or a streamed shard's own)
        captured_by = "generation" if self.regenerate and written is None else "prefill"
        info = write_entry(self.output, k, samples, self.dtype, skips, captured_by, started)
        self.dataset.manifest()
        return info.tokens

    def _samples(
        self, items: list[Item], written: list[Sequence] | None, skips: SkipLog
    ) -> list[Captured]:
        """Render, answer and capture the samples of `items`, in the order of their sample
        ids; `written` holds sequences whose replies were written before (prefilled)."""
        llm = self.engine.get()
        ready = [Sequence(it, it.input_ids, it.loss_mask) for it in items if it.input_ids]
        earlier, last = [], []
        if written is not None:
            ready = written + ready
        else:  # render and answer every round but the last
            earlier, last = answer_rounds(llm, items, self.chat, skips, capture=True)
        # Per-turn rounds were captured as they were written: read their states before the
        # next call stages more.
        captured = [capture(answered, self.mask_ends) for answered in earlier]
        # One call answers the last rounds and prefills the final sequences, capturing both.
        answered = answer_last(llm, last, ready, self.chat, skips)
        captured += [capture(a, self.mask_ends) for a in answered]
        by_id = {sample.id: sample for sample in captured if sample is not None}
        return [by_id[sid] for it in items for sid in it.sample_ids() if sid in by_id]
